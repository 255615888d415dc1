"""EngineCoreClient: the engine core in its own process answers as the in-process engine does.

Real processes throughout: each test spawns a core that loads the tiny checkpoint.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import SamplingParams
from engine.core.client import EngineCoreClient
from engine.core.watchdog import EngineStalled, StallPolicy
from engine.inputs import ContextLengthError, EngineRequest
from engine.llm import LLM
from engine.metrics import RequestRecord, StepRecord

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ARGS = {"block_size": 8, "max_model_len": 256}


@pytest.fixture
async def core(tiny_llama_path: Path):  # type: ignore[no-untyped-def]
    client = EngineCoreClient(str(tiny_llama_path), ARGS, torch_threads=1)
    await client.start()
    yield client
    await client.shutdown()


async def kv_clean(client: EngineCoreClient) -> bool:
    await client.inspect("kv_integrity")  # raises (through the reply) if the pool's books disagree
    free = await client.inspect("num_free_blocks")
    return bool(free == client.load.num_total_blocks and free > 0)


async def test_streams_what_the_in_process_engine_generates(
    core: EngineCoreClient, tiny_llama_path: Path
) -> None:
    steps: list[StepRecord] = []
    finished: list[RequestRecord] = []
    core.metrics.step_listeners.append(steps.append)
    core.metrics.request_listeners.append(finished.append)
    prompt = "streaming is the point"
    deltas = [out async for out in core.generate(EngineRequest("s1", prompt, GREEDY))]
    tokens = [t for d in deltas for c in d.outputs for t in c.token_ids]
    text = "".join(c.text for d in deltas for c in d.outputs)
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    offline = LLM(str(tiny_llama_path), **ARGS).generate([prompt], GREEDY)[0].outputs[0]
    assert tokens == offline.token_ids and text == offline.text
    # The statistics came with the outputs: a record per step, the request's record, the load after.
    assert len(steps) >= 10 and all(s.batch and s.batch[0][0] == "s1" for s in steps)
    assert [r.request_id for r in finished] == ["s1"] and finished[0].num_output_tokens == 10
    assert core.load.num_running == 0 and core.num_unfinished == 0
    assert core.tokenizer is not None and core.max_model_len == 256
    assert await kv_clean(core)


async def test_concurrent_streams_and_n_greater_than_one(core: EngineCoreClient) -> None:
    async def run(i: int, n: int) -> dict[int, int]:
        counts: dict[int, int] = {}
        params = SamplingParams(temperature=0.8, seed=i, n=n, max_tokens=10, ignore_eos=True)
        async for out in core.generate(EngineRequest(f"c{i}", [10 + i, 11, 12], params)):
            for c in out.outputs:
                counts[c.index] = counts.get(c.index, 0) + len(c.token_ids)
        return counts

    results = await asyncio.gather(*(run(i, 1 + i % 3) for i in range(6)))
    assert results == [{j: 10 for j in range(1 + i % 3)} for i in range(6)]
    assert await kv_clean(core)


async def test_abort_and_early_exit_free_everything(core: EngineCoreClient) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    seen = []
    async for out in core.generate(EngineRequest("a1", [1, 2, 3], long)):
        seen.append(out)
        if len(seen) == 3:
            await core.abort("a1")
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    async for _ in core.generate(EngineRequest("a2", [4, 5, 6], long)):
        break  # leaving the stream aborts the request in the core
    for _ in range(100):  # the abort travels through the sender and the core's next step
        if core.load.num_running == 0 and core.load.num_waiting == 0:
            break
        await asyncio.sleep(0.02)
    assert await kv_clean(core)


async def test_a_stop_string_found_beside_the_client_finishes_the_sequence_in_the_core(
    core: EngineCoreClient, tiny_llama_path: Path
) -> None:
    # Text is made in this process; the core only hears of the stop string, and must end the sequence
    # there (else it would run to max_tokens and its record would say "length").
    finished: list[RequestRecord] = []
    core.metrics.request_listeners.append(finished.append)
    llm = LLM(str(tiny_llama_path), **ARGS)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    whole = llm.generate(["stop strings are the client's"], long)[0].outputs[0].text
    stop = whole[20:24]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, stop=[stop])
    offline = llm.generate(["stop strings are the client's"], params)[0].outputs[0]
    deltas = [o async for o in core.generate(EngineRequest("st", "stop strings are the client's", params))]
    last = deltas[-1].outputs[0]
    assert "".join(c.text for d in deltas for c in d.outputs) == offline.text == whole[: whole.index(stop)]
    assert deltas[-1].finished and (last.finish_reason, last.stop_reason) == ("stop", stop)
    assert [(r.request_id, r.finish_reason) for r in finished] == [("st", "stop")]
    assert finished[0].num_output_tokens < 200 and deltas[-1].metrics is not None
    assert core.load.num_running == 0 and await kv_clean(core)


async def test_refused_input_raises_and_the_core_keeps_serving(core: EngineCoreClient) -> None:
    with pytest.raises(ValueError, match=r"token ids must be in \[0, "):
        async for _ in core.generate(EngineRequest("bad", [10**6], GREEDY)):
            pass
    with pytest.raises(ValueError, match="already in flight"):
        stream = core.generate(EngineRequest("dup", [1, 2], GREEDY))
        first = await stream.__anext__()
        async for _ in core.generate(EngineRequest("dup", [1, 2], GREEDY)):
            pass
    assert first.request_id == "dup"
    await stream.aclose()
    outs = [o async for o in core.generate(EngineRequest("ok", [7, 8], GREEDY))]
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 10
    assert await kv_clean(core)


async def test_a_killed_core_fails_its_streams(core: EngineCoreClient) -> None:
    long = SamplingParams(temperature=0, max_tokens=10_000 // 50, ignore_eos=True)
    with pytest.raises(RuntimeError, match="engine loop has died"):
        async for out in core.generate(EngineRequest("k1", [1, 2, 3], long)):
            if out.outputs[0].token_ids and core.pid is not None:
                os.kill(core.pid, signal.SIGKILL)
    assert core.dead_error is not None and "exit code -9" in str(core.dead_error)
    with pytest.raises(RuntimeError, match="engine loop has died"):
        async for _ in core.generate(EngineRequest("after", [1, 2], GREEDY)):
            pass


def fail_after_three_steps(engine: Any) -> None:
    """Spawn pickles this by name: the core imports this module to run it."""
    step, calls = engine.step, [0]

    def failing() -> Any:
        calls[0] += 1
        if calls[0] > 3:
            raise RuntimeError("injected: the step fails")
        return step()

    engine.step = failing


async def death_of_a_core(model: Path, setup: Callable[[Any], None]) -> str:
    """Start a core with ``setup``, run one request into the step failure it injects; the error text."""
    client = EngineCoreClient(str(model), ARGS, torch_threads=1, setup=setup)
    await client.start()
    try:
        with pytest.raises(RuntimeError, match="engine loop has died"):
            async for _ in client.generate(EngineRequest("f1", [1, 2, 3], GREEDY)):
                pass
        return str(client.dead_error)
    finally:
        await client.shutdown()


async def test_a_failing_step_reports_the_error(tiny_llama_path: Path) -> None:
    assert "injected: the step fails" in await death_of_a_core(tiny_llama_path, fail_after_three_steps)


def report_the_collector(engine: Any) -> None:
    """The first step fails with what the cyclic collector tracks by then (spawn imports this by name)."""

    def step() -> Any:
        import gc

        raise RuntimeError(f"collector: frozen={gc.get_freeze_count()} tracked={len(gc.get_objects())}")

    engine.step = step


async def test_the_core_serves_with_its_start_up_heap_frozen(tiny_llama_path: Path) -> None:
    # A full collection walks every tracked object: with torch and a model loaded, a stall of tens of
    # milliseconds in the middle of some step. What start-up built must be out of its sight.
    error = await death_of_a_core(tiny_llama_path, report_the_collector)
    found = re.search(r"collector: frozen=(\d+) tracked=(\d+)", error)
    assert found is not None, error
    frozen, tracked = int(found[1]), int(found[2])
    assert frozen > 50_000  # torch, the model, the engine
    assert tracked < frozen // 10  # a full collection now walks only what serving created


async def test_start_up_errors_reach_the_caller(tmp_path: Path) -> None:
    client = EngineCoreClient(str(tmp_path / "missing"), ARGS)
    with pytest.raises(RuntimeError, match="failed to start"):
        await client.start()


async def test_the_core_exits_when_its_client_is_gone(tiny_llama_path: Path) -> None:
    client = EngineCoreClient(str(tiny_llama_path), ARGS, torch_threads=1)
    await client.start()
    client._closing = True  # what a crashed worker leaves: no Shutdown, only a closed pipe
    assert client._commands is not None
    client._outbox.put(None)
    for thread in client._threads:
        thread.join(5)
    client._commands.close()
    await asyncio.to_thread(client._proc.join, 20)
    assert client._proc.exitcode == 0


async def test_an_over_long_prompt_is_refused_with_its_param_and_the_next_request_runs(
    core: EngineCoreClient,
) -> None:
    """A refusal crosses the pipe as data: the reader lives on, and the caller gets the typed error."""
    with pytest.raises(ContextLengthError) as refused:
        async for _ in core.generate(EngineRequest("too-long", list(range(1, 401)), GREEDY)):
            pass
    assert refused.value.param == "prompt" and "maximum context length" in str(refused.value)
    assert core.dead_error is None and core.num_unacknowledged == 0
    outs = [o async for o in core.generate(EngineRequest("after-refusal", [7, 8], GREEDY))]
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 10
    assert outs[0].prompt_token_ids == [7, 8]  # the prompt came back once, with the acknowledgement
    assert await kv_clean(core)


async def test_an_exception_in_the_reader_marks_the_engine_dead(core: EngineCoreClient) -> None:
    def broken_listener(_: StepRecord) -> None:  # the listeners run on the reader thread
        raise KeyError("injected into the reader")

    core.metrics.step_listeners.append(broken_listener)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with pytest.raises(RuntimeError, match="engine loop has died"):
        async for _ in core.generate(EngineRequest("r1", [1, 2, 3], long)):
            pass
    assert core.dead_error is not None and "reader failed" in str(core.dead_error)
    assert "injected into the reader" in str(core.dead_error)
    with pytest.raises(RuntimeError, match="engine loop has died"):
        async for _ in core.generate(EngineRequest("r2", [1, 2], GREEDY)):
            pass


async def test_a_request_counts_as_unacknowledged_until_the_core_takes_it(
    core: EngineCoreClient,
) -> None:
    """SIGSTOP holds the core, so the request is handed to the client but not acknowledged, whatever
    the host's speed; the count moves to the core's load with the acknowledgement, never to nowhere."""
    assert core.pid is not None and core.num_unacknowledged == 0
    os.kill(core.pid, signal.SIGSTOP)
    try:
        stream = core.generate(EngineRequest("u1", [1, 2, 3], GREEDY))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.2)  # the request reaches the sender and the pipe; the core is stopped
        assert not first.done()
        assert core.num_unacknowledged == 1 and core.load.num_waiting + core.load.num_running == 0
    finally:
        os.kill(core.pid, signal.SIGCONT)
    out = await first
    assert core.num_unacknowledged == 0 and out.request_id == "u1"
    async for _ in stream:
        pass
    assert core.dead_error is None


async def test_a_stalled_core_is_killed_and_its_streams_fail(tiny_llama_path: Path) -> None:
    stall = StallPolicy(floor_s=1.0, warmup_steps=0)
    client = EngineCoreClient(str(tiny_llama_path), ARGS, torch_threads=1, stall=stall)
    await client.start()
    try:
        assert client.pid is not None
        pid = client.pid
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        began = 0.0
        with pytest.raises(RuntimeError, match="engine loop has died") as failed:
            async for out in client.generate(EngineRequest("st1", [1, 2, 3], long)):
                if out.outputs[0].num_output_tokens == 3:
                    os.kill(pid, signal.SIGSTOP)  # what a wedged driver looks like from outside
                    began = time.monotonic()
        waited = time.monotonic() - began
        assert isinstance(failed.value.__cause__, EngineStalled)
        assert isinstance(client.dead_error, EngineStalled)
        # Detected no sooner than the bound, and within it plus a watch interval (and this host's lag).
        assert 1.0 <= waited < 1.0 + stall.tick_s + 5.0
        # The kill follows the failure from the watchdog's thread: wait for the process to be reaped
        # (a loaded host can take seconds to tear down a stopped process's address space).
        deadline = time.monotonic() + 60
        while client._proc.exitcode is None and time.monotonic() < deadline:
            await asyncio.to_thread(client._proc.join, 1)
        assert client._proc.exitcode == -signal.SIGKILL  # killed, though stopped
    finally:
        await client.shutdown()


async def test_an_idle_core_is_never_a_stall(tiny_llama_path: Path) -> None:
    """No work, no expected message: a stopped idle core is not killed (only one with work is)."""
    stall = StallPolicy(floor_s=0.5, warmup_steps=0)
    client = EngineCoreClient(str(tiny_llama_path), ARGS, torch_threads=1, stall=stall)
    await client.start()
    try:
        outs = [o async for o in client.generate(EngineRequest("i1", [5, 6], GREEDY))]
        assert outs[-1].finished
        assert client.pid is not None
        os.kill(client.pid, signal.SIGSTOP)
        await asyncio.sleep(1.5)  # three bounds with nothing to do
        assert client.dead_error is None
        os.kill(client.pid, signal.SIGCONT)
        outs = [o async for o in client.generate(EngineRequest("i2", [5, 6], GREEDY))]
        assert outs[-1].finished and client.dead_error is None
    finally:
        await client.shutdown()
