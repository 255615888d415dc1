"""Greedy output equals HF transformers token for token, under everything the scheduler does:
mid-run arrivals, chunked prefill under a small budget, preemption by a tiny KV pool, prefix-cache
hits and n > 1. The checkpoints are random-weight tiny models written by engine.models.tiny."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.attention.backend import KVLayout
from engine.attention.cpu_backend import PREFILL_SDPA_MIN
from engine.kernels import cpu as cpu_kernels
from engine.llm_engine import LLMEngine
from engine.models.tiny import write_tiny_checkpoint
from tests.engine.hf_reference import hf_greedy

MAX_NEW = 12


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llama"), arch="llama", seed=1)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Qwen2 shape: q/k/v biases and tied embeddings.
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen2"), arch="qwen2", seed=2, tie_word_embeddings=True
    )


def prompts(n: int, seed: int, lo: int = 3, hi: int = 70, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 1000) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(5, 1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(max_tokens: int = MAX_NEW, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


def assert_matches_hf(path: Path, batch: list[list[int]], got: list[list[int]]) -> None:
    for prompt, tokens in zip(batch, got, strict=True):
        assert tokens == hf_greedy(path, prompt, len(tokens)), f"diverged on prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_batch_with_chunked_prefill_matches_hf(model: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(model)
    batch = prompts(6, seed=3)
    llm = LLM(str(path), max_num_batched_tokens=24, block_size=16, max_num_seqs=4)
    outs = llm.generate(batch, greedy())
    assert_matches_hf(path, batch, [o.outputs[0].token_ids for o in outs])
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_total_blocks


def test_mid_run_arrivals_match_hf(llama: Path) -> None:
    engine = LLMEngine.from_engine_args(str(llama), max_num_batched_tokens=32, max_num_seqs=8, block_size=8)
    batch = prompts(5, seed=4)
    got: dict[str, list[int]] = {}
    pending = list(enumerate(batch))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:  # a new request joins every third step
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, greedy())
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids if out.outputs else [])
        steps += 1
    assert_matches_hf(llama, batch, [got[f"r{i}"] for i in range(len(batch))])


def test_preemption_by_tiny_kv_pool_matches_hf(llama: Path) -> None:
    batch = prompts(5, seed=5, lo=20, hi=40)
    llm = LLM(str(llama), num_blocks=18, block_size=4, max_num_seqs=5, enable_prefix_caching=False)
    outs = llm.generate(batch, greedy(16))
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert_matches_hf(llama, batch, [o.outputs[0].token_ids for o in outs])
    llm.engine.kv.check_integrity()


def test_prefix_cache_hits_match_hf(llama: Path) -> None:
    batch = prompts(4, seed=6, lo=3, hi=10, shared_prefix=40)
    llm = LLM(str(llama), block_size=8)
    first = llm.generate(batch[:1], greedy())
    rest = llm.generate(batch[1:], greedy())
    pool = llm.engine.kv.pool
    assert pool.num_cache_hits >= 3 * 40 // 8 * 8, "each later request should reuse the 40-token prefix"
    assert all(o.metrics is not None and o.metrics.num_cached_tokens >= 40 for o in rest)
    assert_matches_hf(llama, batch, [o.outputs[0].token_ids for o in first + rest])


def test_n_greater_than_one_shares_the_prompt(llama: Path) -> None:
    batch = prompts(2, seed=7, lo=30, hi=40)
    llm = LLM(str(llama), block_size=8)
    outs = llm.generate(batch, greedy(8, n=3))
    for prompt, out in zip(batch, outs, strict=True):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        reference = hf_greedy(llama, prompt, 8)
        assert all(c.token_ids == reference for c in out.outputs)
    # Siblings were admitted together; the later two read the first one's full prompt blocks.
    assert llm.engine.kv.pool.num_cache_hits >= 2 * 2 * (30 // 8) * 8


def test_llama3_rope_scaling_and_shards_match_hf(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(
        tmp_path,
        arch="llama",
        seed=8,
        num_shards=3,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    batch = prompts(3, seed=9, lo=50, hi=90)
    outs = LLM(str(path)).generate(batch, greedy())
    assert_matches_hf(path, batch, [o.outputs[0].token_ids for o in outs])


def test_mistral_matches_hf(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, arch="mistral", seed=10)
    batch = prompts(3, seed=11)
    outs = LLM(str(path), max_num_batched_tokens=16, max_num_seqs=4).generate(batch, greedy())
    assert_matches_hf(path, batch, [o.outputs[0].token_ids for o in outs])


def _greedy_by_backend(
    model: str, batch: list[list[int]], max_tokens: int, **kwargs: object
) -> dict[str, tuple[list[list[int]], LLM]]:
    """The same run through the C++ kernels and the torch path: tokens, and the LLM to inspect."""
    runs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(model, attention_backend=backend, dtype="float32", **kwargs)
        outs = llm.generate(batch, greedy(max_tokens))
        llm.engine.kv.check_integrity()
        runs[backend] = ([o.outputs[0].token_ids for o in outs], llm)
    return runs


def _assert_cache_layouts(runs: dict[str, tuple[list[list[int]], LLM]]) -> None:
    """The cpu backend's caches are head-major with key-interleaved K pages, [2, blocks, Hkv, block_size, D]
    in size; torch's token-major."""
    for backend, layout in (("cpu", KVLayout.HEAD_MAJOR_KT), ("torch", KVLayout.TOKEN_MAJOR)):
        runner = runs[backend][1].engine.runner
        config = runner.config
        dims = (runner.num_blocks, config.block_size, runner.model.num_kv_heads, config.model.head_dim)
        assert runner.kv_layout is layout
        assert all(tuple(c.shape) == layout.shape(*dims) for c in runner.kv_caches)


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels could not be built here")
def test_cpu_backend_head_major_pages_decode_as_the_torch_backend(llama: Path) -> None:
    # A pool small enough to preempt, with prefix caching on over a shared prefix: blocks freed,
    # reused and shared mid-run must read back the same under either layout.
    batch = prompts(5, seed=12, lo=10, hi=30, shared_prefix=16)
    runs = _greedy_by_backend(
        str(llama), batch, 16, num_blocks=24, block_size=4, max_num_seqs=5, enable_prefix_caching=True
    )
    _assert_cache_layouts(runs)
    for _, llm in runs.values():
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
        assert llm.engine.kv.pool.num_cache_hits > 0, "the shared prefix was meant to hit the cache"
    assert runs["cpu"][0] == runs["torch"][0]
    assert_matches_hf(llama, batch, runs["cpu"][0])


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels could not be built here")
def test_smollm2_geometry_cpu_backend_decodes_as_the_torch_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2-135M's attention geometry (9 query / 3 kv heads of 64, tied embeddings) on two random
    layers: the kernel's GQA-3 case, with prompts long enough (>= 32 tokens) for a long prefill chunk,
    through each of its two paths over head-major, key-interleaved pages: the kernel and SDPA."""
    smollm2 = write_tiny_checkpoint(
        tmp_path / "smollm2-geometry",
        arch="llama",
        seed=13,
        tie_word_embeddings=True,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=256,
        num_hidden_layers=2,
    )
    batch = prompts(4, seed=13, lo=20, hi=60, shared_prefix=24)
    assert max(len(p) for p in batch) >= PREFILL_SDPA_MIN
    kwargs: dict[str, object] = {"max_model_len": 256, "max_num_seqs": 4, "enable_prefix_caching": True}
    monkeypatch.setenv("INFLIGHT_CPU_PREFILL_ATTENTION", "kernel")
    runs = _greedy_by_backend(str(smollm2), batch, 12, **kwargs)
    _assert_cache_layouts(runs)
    assert runs["cpu"][0] == runs["torch"][0]
    monkeypatch.setenv("INFLIGHT_CPU_PREFILL_ATTENTION", "sdpa")
    via_sdpa = LLM(str(smollm2), attention_backend="cpu", dtype="float32", **kwargs)
    outs = via_sdpa.generate(batch, greedy(12))
    via_sdpa.engine.kv.check_integrity()
    assert [o.outputs[0].token_ids for o in outs] == runs["torch"][0]
