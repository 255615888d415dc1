"""The engine's public behaviour: bad input refused cleanly, sampling options, statistics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.inputs import EngineRequest
from engine.llm_engine import LLMEngine
from engine.models.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tiny_llama_path: Path) -> LLM:
    return LLM(str(tiny_llama_path), max_model_len=256, num_blocks=64, block_size=8)


def assert_clean(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def serves_after(llm: LLM) -> None:
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert_clean(llm.engine)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([], "empty"), ([7] * 300, "max_model_len"), ([1, 5000], r"\[0, "), ("", "empty")],
)
def test_bad_prompts_are_refused_and_harm_nothing(llm: LLM, prompt: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3], prompt], SamplingParams(max_tokens=2))  # type: ignore[list-item]
    serves_after(llm)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"n": 0}, "n must"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_bad_sampling_params_raise(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_request_that_never_fits_the_cache_is_rejected(llm: LLM) -> None:
    # 64 blocks of 8 = 512 slots, but max_model_len caps at 256; use a tinier pool.
    small = LLM(str(llm.engine.config.model_path), num_blocks=4, block_size=8)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([[3] * 20], SamplingParams(max_tokens=100))
    serves_after(small)


def test_duplicate_request_id_and_unknown_abort(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("dup", [4, 5], SamplingParams(max_tokens=2))
    engine.abort_request("never-seen")  # a no-op
    engine.abort_request("dup")
    outs = engine.step()
    assert outs and outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert_clean(engine)


def test_unknown_model_path_architecture_and_engine_args(tmp_path: Path, tiny_llama_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no model"):
        LLM(str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(bad))
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(str(tiny_llama_path), max_num_seq=4)
    with pytest.raises(ValueError, match="batching"):
        LLM(str(tiny_llama_path), batching="dynamic")


def test_stop_strings_never_leak(llm: LLM) -> None:
    base = llm.generate(["the quick"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    text = base.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(
        ["the quick"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    )
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)]
    assert stop not in c.text


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    base = llm.generate([[9, 8, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    toks = base.outputs[0].token_ids
    stop_at = toks[4]
    first = toks.index(stop_at)
    out = llm.generate([[9, 8, 7]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]))
    c = out[0].outputs[0]
    assert c.token_ids == toks[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_at
    # The stop token's text is not part of the answer unless asked for, as with a stop string.
    asked = SamplingParams(
        temperature=0, max_tokens=10, stop_token_ids=[stop_at], include_stop_str_in_output=True
    )
    kept = llm.generate([[9, 8, 7]], asked)[0].outputs[0]
    assert kept.token_ids == c.token_ids
    assert kept.text.startswith(c.text) and len(kept.text) > len(c.text)


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[11, 12, 13]], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    mixed = llm.generate([[40, 41], [11, 12, 13], [50] * 30], [others, params, others])
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = llm.generate([[11, 12, 13]], SamplingParams(**{**params.__dict__, "seed": 99}))
    assert other_seed[0].outputs[0].token_ids != alone


def test_logprobs_are_returned_per_token(llm: LLM) -> None:
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))
    c = out[0].outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 4
    for token, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert token in lp and len(lp) >= 3
        assert lp[token] == max(lp.values())  # greedy picked the most likely token
        assert all(v <= 0.0 for v in lp.values())


def test_resumed_stream_continues_exactly(llm: LLM) -> None:
    """What a crashed worker's successor does: prefill prompt + emitted tokens, carry on."""
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=14, ignore_eos=True)
    whole = llm.generate([[21, 22, 23, 24]], params)[0].outputs[0]
    full = whole.token_ids
    engine = llm.engine
    for cut in range(1, 13):
        # What the first engine streamed before the cut (the detokenizer's view, held-back text included).
        first = llm.generate([[21, 22, 23, 24]], SamplingParams(**{**params.__dict__, "max_tokens": cut}))
        assert first[0].outputs[0].token_ids == full[:cut]
        engine.add_request(
            EngineRequest(f"resumed-{cut}", [21, 22, 23, 24], params, resume_token_ids=full[:cut])
        )
        tail: list[int] = []
        text = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    tail += c.token_ids
                    text += c.text
        assert full[:cut] + tail == full
        assert whole.text.endswith(text) and len(text) > 0


def test_prompts_as_text_and_token_ids(llm: LLM) -> None:
    tok = llm.tokenizer
    ids = tok.encode("hello world")
    a, b = llm.generate(["hello world", ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert a.prompt_token_ids == ids and a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].text == tok.decode(a.outputs[0].token_ids)


def test_checkpoint_without_tokenizer_serves_token_ids(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, with_tokenizer=False)
    llm = LLM(str(path))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="token ids"):
        llm.generate(["text"], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs(tiny_llama_path: Path, dtype: str) -> None:
    llm = LLM(str(tiny_llama_path), dtype=dtype, max_model_len=128)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    assert llm.engine.runner.kv_caches[0].dtype.__repr__().endswith(dtype)


def test_step_statistics_and_request_metrics(tiny_llama_path: Path) -> None:
    llm = LLM(str(tiny_llama_path), block_size=8, max_num_batched_tokens=16, max_num_seqs=4)
    steps = []
    llm.engine.metrics.step_listeners.append(steps.append)
    prompt = list(range(10, 50))
    outs = llm.generate([prompt, prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert steps, "no step was recorded"
    assert max(s.stats.num_scheduled_tokens for s in steps) <= 16
    assert any(s.stats.kv_usage > 0 for s in steps)
    assert steps[-1].stats.prefix_cache_hits > 0  # the second copy of the prompt hit the first
    assert all(s.stats.num_running + s.stats.num_waiting <= 2 for s in steps)
    m = outs[0].metrics
    assert m is not None and m.ttft is not None and m.ttft > 0 and m.tpot is not None
    assert m.queue_time is not None and m.queue_time >= 0


def test_static_batching_mode_gives_the_same_greedy_tokens(tiny_llama_path: Path) -> None:
    batch = [[5, 6, 7], [8] * 20, [9, 10]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cont = LLM(str(tiny_llama_path)).generate(batch, params)
    static = LLM(str(tiny_llama_path), batching="static").generate(batch, params)
    assert [o.outputs[0].token_ids for o in cont] == [o.outputs[0].token_ids for o in static]


def test_aborts_followed_by_an_idle_step_release_runner_rows(tiny_llama_path: Path) -> None:
    """Rows of requests aborted before an empty step must still be freed, or the next full batch
    finds no row (a leak that only shows once max_num_seqs requests run again)."""
    engine = LLMEngine.from_engine_args(str(tiny_llama_path), max_num_seqs=4, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for round_ in range(3):
        ids = [f"r{round_}-{i}" for i in range(4)]
        for rid in ids:
            engine.add_request(rid, [3, 4, 5, round_], params)
        engine.step()
        engine.step()
        for rid in ids:
            engine.abort_request(rid)
        assert all(o.finished for o in engine.step())  # nothing left to schedule: an empty step
        assert not engine.has_unfinished_requests()
        assert not engine.runner.input_batch.row_of
    engine.kv.check_integrity()


def test_published_load_follows_arrivals_steps_and_aborts(tiny_llama_path: Path) -> None:
    """Other threads read ``engine.load``, a snapshot replaced at every change, never the live scheduler."""
    engine = LLMEngine.from_engine_args(str(tiny_llama_path), max_num_seqs=4, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert (engine.load.num_waiting, engine.load.num_running, engine.load.kv_usage) == (0, 0, 0.0)
    engine.add_request("a", [3, 4, 5], params)
    engine.add_request("b", [6, 7, 8], params)
    assert (engine.load.num_waiting, engine.load.num_running) == (2, 0)
    before = engine.load
    engine.step()
    assert (engine.load.num_waiting, engine.load.num_running) == (0, 2)
    assert engine.load.kv_usage == engine.kv.usage > 0
    assert engine.load.num_total_blocks == engine.kv.num_total_blocks
    assert before.num_waiting == 2  # a snapshot a reader holds never changes under it
    engine.abort_request("a")
    assert engine.load.num_running == 1
    engine.abort_request("b")
    assert (engine.load.num_running, engine.load.kv_usage) == (0, 0.0)
    while engine.has_unfinished_requests():
        engine.step()
    assert_clean(engine)
