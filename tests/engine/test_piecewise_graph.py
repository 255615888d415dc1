"""Piecewise CUDA graphs for mixed steps (engine/runner/piecewise_graph.py), run eagerly on the CPU.

Without a GPU nothing is captured (the last test captures where CUDA is present); what is checked
is everything around the capture: the sizes, padded mixed steps giving the unpadded engine's tokens,
and padded rows writing nothing into the KV cache.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.backend import AttentionMetadata, KVLayout
from engine.runner.cuda_graph import GraphedDecode
from engine.runner.piecewise_graph import PiecewiseGraphs, piecewise_buckets

# Runs of the same prompts compared: a prefix-cache hit would change the steps, not the padding.
_ARGS: dict[str, Any] = dict(
    dtype="float32", block_size=8, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False
)


def _prompts() -> list[list[int]]:
    # Lengths that make steps of many token counts: chunked prefills next to decodes.
    rng = random.Random(3)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(3, 60))] for _ in range(16)]


def _params(logprobs: int | None = None) -> list[SamplingParams]:
    # Requests end at different steps, so new ones join running decodes one at a time.
    return [
        SamplingParams(temperature=0.0, max_tokens=4 + 3 * (i % 5), ignore_eos=True, logprobs=logprobs)
        for i in range(16)
    ]


def _install(llm: LLM, max_tokens: int, decode_graphs: bool) -> list[AttentionMetadata]:
    """Eager (capture=False) piecewise graphs up to max_tokens on the engine's runner, and, as on a
    GPU, the decode graphs for decode-only steps; returns the metadata of every piecewise step."""
    runner = llm.engine.runner
    if decode_graphs:
        runner.graphs = GraphedDecode(
            runner.model,
            runner.kv_caches,
            runner.config.max_num_seqs,
            runner.max_blocks_per_req,
            runner.config.max_model_len,
            torch.device("cpu"),
            capture=False,
        )
    piecewise = PiecewiseGraphs(runner.model, runner.kv_caches, piecewise_buckets(max_tokens), capture=False)
    runner.piecewise = piecewise
    seen: list[AttentionMetadata] = []
    run = piecewise.run

    def recording(
        input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        seen.append(metadata)
        return run(input_ids, positions, metadata)

    piecewise.run = recording  # type: ignore[method-assign]
    return seen


def test_buckets() -> None:
    assert piecewise_buckets(64) == [8, 16, 24, 32, 40, 48, 56, 64]
    assert piecewise_buckets(4) == [4]
    assert piecewise_buckets(300)[-5:] == [240, 248, 256, 288, 300]
    sizes = piecewise_buckets(2048)
    assert len(sizes) == 56 and sizes[-1] == 2048
    for n in range(1, 2049):
        b = next(s for s in sizes if s >= n)
        assert b - n < max(8, b // 8), n  # padding stays under an eighth past the fine sizes


def test_bucket_for(tiny_llama_path: Path) -> None:
    llm = LLM(str(tiny_llama_path), **_ARGS)
    runner = llm.engine.runner
    piecewise = PiecewiseGraphs(runner.model, runner.kv_caches, [8, 16, 24, 32], capture=False)
    assert [piecewise.bucket_for(t) for t in (1, 8, 9, 17, 32)] == [8, 8, 16, 24, 32]
    assert piecewise.bucket_for(33) is None and piecewise.max_tokens == 32


# auto: the C++ kernels where they build (in-place norms and rotary); torch: the plain ops.
_BACKENDS = pytest.mark.parametrize("backend", ["auto", "torch"])


@_BACKENDS
def test_mixed_steps_match_eager(tiny_llama_path: Path, backend: str) -> None:
    args = {**_ARGS, "attention_backend": backend}
    eager = LLM(str(tiny_llama_path), **args).generate(_prompts(), _params(logprobs=3))

    llm = LLM(str(tiny_llama_path), **args)
    # Sizes up to 48 of a 64-token budget: the larger steps run eager, as above the largest size.
    seen = _install(llm, 48, decode_graphs=True)
    model = llm.engine.runner.model
    eager_tokens: list[int] = []
    forward = model.forward

    def recording(
        input_ids: torch.Tensor, positions: torch.Tensor, kv: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        if not meta.decode_only:
            eager_tokens.append(meta.num_tokens)
        return forward(input_ids, positions, kv, meta)

    model.forward = recording  # type: ignore[method-assign,assignment]
    got = llm.generate(_prompts(), _params(logprobs=3))
    llm.engine.kv.check_integrity()

    for a, b in zip(got, eager, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs is not None and b.outputs[0].logprobs is not None
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)

    def query_lens(m: AttentionMetadata) -> list[int]:
        q = m.query_start_loc_cpu
        return [q[i + 1] - q[i] for i in range(m.num_seqs)]

    assert seen and all(not m.decode_only for m in seen), "decode-only steps keep the decode graphs"
    assert any(1 in query_lens(m) and max(query_lens(m)) > 1 for m in seen), "no prefill next to a decode"
    assert any(m.num_tokens % 8 for m in seen), "no step was padded"
    assert all(m.num_tokens <= 48 for m in seen)
    assert eager_tokens and all(t > 48 for t in eager_tokens), eager_tokens


def _written_slots(kv_cache: torch.Tensor, layout: KVLayout) -> set[int]:
    """Flat slots holding anything in K or V ([2, num_blocks, block_size, Hkv, D] -> slot ids)."""
    cache = layout.to_token_major(kv_cache)
    written = cache.reshape(2, cache.shape[1] * cache.shape[2], -1).ne(0).any(-1).any(0)
    return set(written.nonzero().flatten().tolist())


@_BACKENDS
def test_padded_rows_write_nothing_into_the_kv_cache(tiny_llama_path: Path, backend: str) -> None:
    llm = LLM(str(tiny_llama_path), **{**_ARGS, "attention_backend": backend})
    seen = _install(llm, 64, decode_graphs=False)  # every step padded through the piecewise path
    engine = llm.engine
    for i, (prompt, params) in enumerate(zip(_prompts()[:8], _params(), strict=False)):
        engine.add_request(f"r{i}", prompt, params)
    real_slots: set[int] = set()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        num_seen = len(seen)
        engine.step()
        for meta in seen[num_seen:]:
            real_slots.update(meta.slot_mapping.tolist())
        for kv_cache in engine.runner.kv_caches:
            assert _written_slots(kv_cache, engine.runner.kv_layout) == real_slots
    assert not engine.has_unfinished_requests()
    assert any(m.num_tokens % 8 for m in seen), "no step was padded"
    assert -1 not in real_slots


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_replay_equals_eager_padded_run(tiny_llama_path: Path) -> None:
    """On a GPU: each mixed step replayed from the captured graphs equals the same padded step run
    eagerly through the same segments, bit for bit (same kernels, launch parameters and inputs;
    storing K/V twice writes the same values into the same slots)."""
    llm = LLM(str(tiny_llama_path), **{**_ARGS, "device": "cuda"})
    runner = llm.engine.runner
    captured = runner.piecewise
    assert captured is not None and captured.use_graphs, "piecewise graphs were not captured"
    eager = PiecewiseGraphs(runner.model, runner.kv_caches, captured.buckets, capture=False)
    replay = captured.run
    compared: list[int] = []

    def checked(
        input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        got = replay(input_ids, positions, metadata).clone()
        want = eager.run(input_ids, positions, metadata)
        assert torch.equal(got, want), float((got - want).abs().max())
        compared.append(metadata.num_tokens)
        return got

    captured.run = checked  # type: ignore[method-assign]
    llm.generate(_prompts(), _params())
    assert compared and any(t % 8 for t in compared), compared
