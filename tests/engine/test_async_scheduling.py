"""Async scheduling (step N+1 planned while step N runs) gives the synchronous path's outputs.

Greedy and seeded sampling depend only on the tokens and (seed, position), so the same requests must
produce the same tokens, texts and finish reasons token for token, whatever the one-step lag changes
in the batches: chunked prefill, preemption, EOS / stop tokens / stop strings / max_tokens, penalties,
logprobs, n > 1, resumed streams, aborts mid-flight. And the engine drains clean: no block leaked, no
placeholder left, no output after a request's last one.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.async_scheduling import decide_async_scheduling
from engine.inputs import EngineRequest
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sched.async_scheduler import AsyncScheduler

VOCAB = 1024  # the tiny checkpoint's


@dataclass
class Arrival:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    at_step: int
    resume: list[int] | None = None


@dataclass
class Run:
    tokens: dict[str, dict[int, list[int]]] = field(default_factory=dict)  # id -> index -> tokens
    text: dict[str, dict[int, str]] = field(default_factory=dict)
    finish: dict[str, dict[int, str | None]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)


def mixed_traffic(seed: int, num: int = 14) -> tuple[list[Arrival], dict[int, list[str]]]:
    """Requests covering every way a request ends, arriving over the first steps, and some aborts."""
    rng = random.Random(seed)
    arrivals = []
    for i in range(num):
        kind = i % 7
        kw: dict[str, Any] = {"max_tokens": rng.randint(3, 18), "seed": rng.randrange(1 << 30)}
        if kind == 0:
            kw.update(temperature=0.0, ignore_eos=True)
        elif kind == 1:  # seeded, stops on a token's value (about one id in seven)
            kw.update(temperature=1.0, top_k=50, stop_token_ids=list(range(3, VOCAB, 7)))
        elif kind == 2:  # stop strings, found by the detokenizer
            kw.update(temperature=0.9, top_p=0.9, stop=["a", "e"], max_tokens=30)
        elif kind == 3:  # penalties read the previous (in flight) token's value
            kw.update(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, logprobs=2)
        elif kind == 4:
            kw.update(temperature=0.7, n=2, min_tokens=2, stop_token_ids=list(range(5, VOCAB, 9)))
        elif kind == 5:
            kw.update(temperature=0.0, frequency_penalty=0.4, ignore_eos=True)
        else:
            kw.update(temperature=1.0, min_p=0.05, ignore_eos=True)
        prompt = [rng.randrange(5, VOCAB) for _ in range(rng.randint(2, 40))]
        resume = [rng.randrange(5, VOCAB) for _ in range(2)] if i % 5 == 4 else None
        arrivals.append(Arrival(f"r{i}", prompt, SamplingParams(**kw), rng.randint(0, 6), resume))
    aborts = {3: ["r2"], 5: ["r9", "r11"]}
    return arrivals, aborts


def drive(engine: LLMEngine, arrivals: list[Arrival], aborts: dict[int, list[str]]) -> Run:
    run = Run()
    finished: set[str] = set()
    step = 0
    while step < 400 and (engine.has_unfinished_requests() or any(a.at_step >= step for a in arrivals)):
        for a in arrivals:
            if a.at_step == step:
                engine.add_request(EngineRequest(a.request_id, a.prompt, a.params, resume_token_ids=a.resume))
        for rid in aborts.get(step, []):
            if rid not in finished:
                run.aborted.add(rid)
            engine.abort_request(rid)
        for out in engine.step():
            assert out.request_id not in finished, f"{out.request_id} had output after its last"
            for c in out.outputs:
                run.tokens.setdefault(out.request_id, {}).setdefault(c.index, []).extend(c.token_ids)
                run.text.setdefault(out.request_id, {}).setdefault(c.index, "")
                run.text[out.request_id][c.index] += c.text
                if c.logprobs:
                    run.logprobs.setdefault(out.request_id, []).extend(c.logprobs)
                if c.finish_reason is not None:
                    run.finish.setdefault(out.request_id, {})[c.index] = c.finish_reason
            if out.finished:
                finished.add(out.request_id)
        step += 1
    assert not engine.has_unfinished_requests(), "the engine did not drain"
    assert finished == {a.request_id for a in arrivals}
    return run


def assert_drained(engine: LLMEngine) -> None:
    kv = engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_total_blocks and not kv.req_blocks
    assert not engine.scheduler.requests
    if isinstance(engine.scheduler, AsyncScheduler):
        assert engine.scheduler.num_in_flight == 0


def make_engine(path: Path, on: bool, **kw: Any) -> LLMEngine:
    args: dict[str, Any] = dict(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, seed=3)
    args.update(kw)
    return LLMEngine.from_engine_args(str(path), async_scheduling=on, **args)


@pytest.mark.parametrize("pool", [None, 24], ids=["roomy", "preempting"])
def test_mixed_traffic_matches_the_synchronous_path(tiny_llama_path: Path, pool: int | None) -> None:
    arrivals, aborts = mixed_traffic(seed=11 if pool is None else 12)
    runs = {}
    for on in (False, True):
        engine = make_engine(tiny_llama_path, on, num_blocks=pool)
        assert engine.config.async_scheduling is on
        runs[on] = drive(engine, arrivals, aborts)
        assert_drained(engine)
        if pool is not None:
            assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    sync, lagged = runs[False], runs[True]
    kept = [a.request_id for a in arrivals if a.request_id not in sync.aborted | lagged.aborted]
    assert len(kept) >= 10
    for rid in kept:
        assert lagged.tokens[rid] == sync.tokens[rid], rid
        assert lagged.text[rid] == sync.text[rid], rid
        assert lagged.finish[rid] == sync.finish[rid], rid
        # Same entries; values to float precision (a different batch may sum in another order).
        got, want = lagged.logprobs.get(rid, []), sync.logprobs.get(rid, [])
        assert [sorted(lp) for lp in got] == [sorted(lp) for lp in want], rid
        for lp_got, lp_want in zip(got, want, strict=True):
            assert lp_got == pytest.approx(lp_want, abs=1e-4), rid
    reasons = {r for rid in kept for r in sync.finish[rid].values()}
    assert reasons == {"stop", "length"}, "the mix should end requests both ways"
    for rid in sync.aborted | lagged.aborted:
        # Aborted at the same step, the two runs may have emitted different numbers of tokens, but each
        # emitted only tokens of the same sequence: one is a prefix of the other.
        for index, seq in sync.tokens.get(rid, {}).items():
            other = lagged.tokens.get(rid, {}).get(index, [])
            assert seq[: len(other)] == other[: len(seq)], rid


def test_inline_launches_match_too(tiny_llama_path: Path) -> None:
    """The CUDA structure on the CPU: each step runs inside submit() (the stream would queue it) and
    its result is collected a step later. Same outputs as the synchronous path."""
    arrivals, aborts = mixed_traffic(seed=13)
    runs = {}
    for on in (False, True):
        engine = make_engine(tiny_llama_path, on)
        if engine.runner.overlap is not None:
            engine.runner.overlap.close()
            engine.runner.overlap._pool = None
        runs[on] = drive(engine, arrivals, aborts)
        assert_drained(engine)
    aborted = runs[False].aborted | runs[True].aborted
    for a in arrivals:
        if a.request_id not in aborted:
            assert runs[True].tokens[a.request_id] == runs[False].tokens[a.request_id], a.request_id


@pytest.mark.parametrize("on", [False, True], ids=["sync", "async"])
def test_penalties_see_the_token_still_in_flight(tiny_llama_path: Path, on: bool) -> None:
    """Flat logits: greedy with a presence penalty must pick the lowest id not yet output, so every
    step depends on the value of the token sampled just before (which, with async scheduling, the host
    does not know yet when it plans the step: the device side patches it in)."""
    engine = make_engine(tiny_llama_path, on)
    engine.runner.model.compute_logits = lambda hidden: torch.zeros(  # type: ignore[method-assign]
        hidden.shape[0], VOCAB, dtype=torch.float32
    )
    for i in range(3):
        params = SamplingParams(temperature=0.0, presence_penalty=1.0, max_tokens=12, ignore_eos=True)
        engine.add_request(f"p{i}", [40 + i, 50, 60], params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert tokens == {f"p{i}": list(range(12)) for i in range(3)}
    assert_drained(engine)


def test_requests_ending_at_max_model_len_match(tiny_llama_path: Path) -> None:
    """A pending token that brings a request to max_model_len is its last: no step is planned past it."""
    got = {}
    for on in (False, True):
        engine = make_engine(tiny_llama_path, on, max_model_len=32)
        for i, n in enumerate((20, 30, 31)):
            greedy = SamplingParams(temperature=0.0, ignore_eos=True)
            engine.add_request(f"m{i}", list(range(7, 7 + n)), greedy)
        run: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                run.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        assert_drained(engine)
        got[on] = run
    assert got[True] == got[False]
    assert [len(got[True][f"m{i}"]) for i in range(3)] == [12, 2, 1]


def test_abort_while_its_step_runs_emits_nothing_after(tiny_llama_path: Path) -> None:
    engine = make_engine(tiny_llama_path, True, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("keep", [7, 8, 9, 10], params)
    engine.add_request("drop", [11, 12, 13], params)
    for _ in range(4):
        engine.step()
    assert isinstance(engine.scheduler, AsyncScheduler) and engine.scheduler.num_in_flight == 1
    engine.abort_request("drop")  # its next token is being computed right now
    outs = engine.step()  # the abort's final output, then the in-flight step's tokens
    drop = [o for o in outs if o.request_id == "drop"]
    assert len(drop) == 1 and drop[0].finished and drop[0].outputs[0].finish_reason == "abort"
    assert drop[0].outputs[0].token_ids == []
    while engine.has_unfinished_requests():
        assert all(o.request_id == "keep" for o in engine.step())
    assert_drained(engine)


def test_id_reused_while_its_old_step_runs(tiny_llama_path: Path) -> None:
    """Aborted and added again under the same id before the old step reports: the old tokens go to
    neither the new request nor its runner row (both are matched by identity, not id)."""
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)
    engine = make_engine(tiny_llama_path, True)
    engine.add_request("x", [9, 8, 7, 6], params)
    for _ in range(3):
        engine.step()
    assert isinstance(engine.scheduler, AsyncScheduler) and engine.scheduler.num_in_flight == 1
    engine.abort_request("x")  # the step running now still computes the old "x"
    engine.add_request("x", [100, 200, 300], params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
    assert_drained(engine)
    fresh = make_engine(tiny_llama_path, False)
    fresh.add_request("x", [100, 200, 300], params)
    expected: list[int] = []
    while fresh.has_unfinished_requests():
        for out in fresh.step():
            expected += out.outputs[0].token_ids
    assert tokens == expected and len(tokens) == 10


def test_last_output_leaves_nothing_in_flight(tiny_llama_path: Path) -> None:
    """When every request finished on the tokens just seen, the wasted step still running is waited
    for in the same call: has_unfinished_requests() is false with the last output."""
    engine = make_engine(tiny_llama_path, True)
    stop_at_once = SamplingParams(temperature=1.0, seed=1, stop_token_ids=list(range(VOCAB)))
    engine.add_request("a", [5, 6, 7], stop_at_once)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
    assert len(outs[-1].outputs[0].token_ids) == 1
    assert_drained(engine)


def test_model_runs_on_a_worker_thread_while_the_next_step_is_planned(tiny_llama_path: Path) -> None:
    """Each forward waits until the engine thread has scheduled the next step: that can only happen
    when the two overlap (synchronously, every wait would time out)."""
    engine = make_engine(tiny_llama_path, True)
    forward = engine.runner.model.forward
    schedule = engine.scheduler.schedule
    cond = threading.Condition()
    threads: set[str] = set()
    num_schedules = num_forwards = num_overlapped = 0

    def watched_schedule() -> Any:
        nonlocal num_schedules
        with cond:
            num_schedules += 1
            cond.notify_all()
        return schedule()

    def waiting_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal num_forwards, num_overlapped
        threads.add(threading.current_thread().name)
        with cond:
            num_forwards += 1
            mine = num_forwards  # this step came from schedule call number `mine`
            num_overlapped += cond.wait_for(lambda: num_schedules > mine, timeout=1.0)
        return forward(*args, **kwargs)

    engine.runner.model.forward = waiting_forward  # type: ignore[method-assign]
    engine.scheduler.schedule = watched_schedule  # type: ignore[method-assign]
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert threads and all(name.startswith("inflight-step") for name in threads)
    assert num_forwards == 6 and num_overlapped == 6, "step N+1 should be scheduled while step N runs"
    assert_drained(engine)


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(tiny_llama_path: Path) -> None:
    engine = make_engine(tiny_llama_path, True)
    forward = engine.runner.model.forward
    calls = 0

    def flaky(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("device lost")
        return forward(*args, **kwargs)

    engine.runner.model.forward = flaky  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["a"].error is not None and "device lost" in finals["a"].error
    engine.add_request("b", [5, 6, 7], params)  # serving goes on
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["b"].error is None and finals["b"].outputs[0].num_output_tokens == 8
    assert_drained(engine)


def test_auto_rule() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decide_async_scheduling(None, cuda)[0] is True
    assert decide_async_scheduling(None, cpu, torch_threads=3, cores=4)[0] is False  # measured: no gain
    assert decide_async_scheduling(None, cpu, torch_threads=4, cores=4)[0] is False
    assert decide_async_scheduling(None, cpu, torch_threads=8, cores=4)[0] is False
    assert decide_async_scheduling(False, cuda) == (False, "set explicitly")
    assert decide_async_scheduling(True, cpu, torch_threads=4, cores=4)[0] is True
