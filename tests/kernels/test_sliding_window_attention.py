"""Sliding-window attention and logit soft-capping in every backend, against a dense reference.

The dense reference is HF's definition written out (transformers' masking_utils: a query at q sees keys
kv with q - W < kv <= q; Gemma 2: scaled scores, then cap * tanh(scores / cap), then the mask), from the
dense K/V, independent of paging. Every slot before the step's first window start of a request is
NaN in the cache, as a block freed by the KV manager and reused may hold anything: a backend that
reads one shows NaN.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import AttentionMetadata, KVLayout, get_attention_backend
from engine.kernels import cpu as cpu_kernels
from engine.kernels import reference
from engine.kernels.paged_attention import paged_attention
from tests.kernels.conftest import PagedBatch, make_paged_batch

SCALE = 0.3  # large enough that the soft cap (below) bends many scores


def dense_window_attention(
    batch: PagedBatch, scale: float, window: int | None, cap: float | None
) -> torch.Tensor:  # [T, Hq, D] float32
    num_heads = batch.query.shape[1]
    starts = batch.query_start_loc.tolist()
    out = torch.zeros(batch.query.shape, dtype=torch.float32)
    for r, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q = batch.query[starts[r] : starts[r + 1]].float().cpu()
        q_len, s_len = q.shape[0], k.shape[0]
        group = num_heads // k.shape[1]
        k_rep = k.float().cpu().repeat_interleave(group, dim=1)
        v_rep = v.float().cpu().repeat_interleave(group, dim=1)
        q_idx = torch.arange(s_len - q_len, s_len)[:, None]
        kv_idx = torch.arange(s_len)[None, :]
        allowed = kv_idx <= q_idx
        if window is not None:
            allowed &= kv_idx > q_idx - window
        for h in range(num_heads):
            scores = (q[:, h] @ k_rep[:, h].T) * scale
            if cap is not None:
                scores = torch.tanh(scores / cap) * cap
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[starts[r] : starts[r + 1], h] = scores.softmax(-1) @ v_rep[:, h]
    return out


def poison_before_windows(batch: PagedBatch, window: int | None) -> None:
    """NaN every cached position before each request's first query's window start."""
    if window is None:
        return
    cache = batch.token_major_cache()  # [2, num_blocks, block_size, Hkv, D]
    block_size = cache.shape[2]
    starts = batch.query_start_loc.tolist()
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        first = reference.window_start(seq_len - (starts[r + 1] - starts[r]), window)
        for pos in range(first):
            block = int(batch.block_tables[r, pos // block_size])
            cache[:, block, pos % block_size] = float("nan")
    batch.layout.fill_from_token_major(batch.kv_cache, cache.to(batch.kv_cache.device))


# (query_lens, seq_lens): prefill chunks (first and later) and decodes mixed in one step.
STEPS = [
    ([1, 1, 1], [7, 32, 93]),  # decodes only (a context of 32: equal to the window 32)
    ([24, 1, 9, 1], [24, 57, 70, 5]),  # a whole prompt, decodes, a later chunk
    ([40, 3], [120, 45]),  # long later chunk
    ([48, 1], [48, 60]),  # a whole prompt long enough for the CPU's SDPA route, a decode
]
# Off, tiny, not a multiple of any block size, a multiple (and one context's length), > every context.
WINDOWS = [None, 5, 13, 32, 200]
CAPS = [None, 1.5]
HEADS = [(4, 1), (4, 2), (3, 3)]  # GQA groups of 4, 2 and 1


def _batch(
    step: int,
    heads: tuple[int, int],
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    layout: KVLayout = KVLayout.TOKEN_MAJOR,
    device: torch.device | None = None,
) -> PagedBatch:
    query_lens, seq_lens = STEPS[step]
    return make_paged_batch(
        query_lens,
        seq_lens,
        heads[0],
        heads[1],
        head_size,
        block_size,
        dtype=dtype,
        seed=step,
        layout=layout,
        **({} if device is None else {"device": device}),
    )


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert not got.isnan().any(), "a key outside the window was read"
    atol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), want, atol=atol, rtol=0)


def test_window_start_is_hfs_rule() -> None:
    # kv_idx > q_idx - W: W keys, the query's own included.
    assert reference.window_start(9, 4) == 6
    assert reference.window_start(2, 4) == 0
    assert reference.window_start(9, None) == 0
    assert reference.window_start(9, 1) == 9


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("step", range(len(STEPS)))
def test_reference_matches_dense(step: int, window: int | None, cap: float | None) -> None:
    batch = _batch(step, (4, 2), 16, 8, torch.float32)
    poison_before_windows(batch, window)
    got = reference.paged_attention(
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        SCALE,
        window,
        cap,
    )
    _check(got, dense_window_attention(batch, SCALE, window, cap), torch.float32)


def _metadata(batch: PagedBatch) -> AttentionMetadata:
    return batch.metadata()


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("step", range(len(STEPS)))
def test_torch_backend(step: int, heads: tuple[int, int], window: int | None, cap: float | None) -> None:
    batch = _batch(step, heads, 16, 4, torch.float32)
    poison_before_windows(batch, window)
    backend = get_attention_backend("torch")
    got = backend.forward(
        batch.query, batch.kv_cache, _metadata(batch), SCALE, sliding_window=window, logits_soft_cap=cap
    )
    _check(got, dense_window_attention(batch, SCALE, window, cap), torch.float32)


@pytest.mark.parametrize(("window", "cap"), [(13, None), (5, 1.5), (200, 1.5)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_triton_kernel(window: int | None, cap: float | None, block_size: int) -> None:
    # Interpreted on a CPU host: a few cases, mixed steps and GQA 2 (each case takes seconds).
    batch = _batch(1, (4, 2), 16, block_size, torch.float32)
    poison_before_windows(batch, window)
    meta = _metadata(batch)
    got = paged_attention(
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        SCALE,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        sliding_window=window,
        logits_soft_cap=cap,
    )
    _check(got, dense_window_attention(batch, SCALE, window, cap), torch.float32)


@pytest.mark.parametrize("num_splits", [2, 4])
def test_triton_split_k_decodes_with_a_window(num_splits: int) -> None:
    batch = _batch(0, (4, 1), 16, 4, torch.float32)
    poison_before_windows(batch, 13)
    got = paged_attention(
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        SCALE,
        num_splits=num_splits,
        sliding_window=13,
        logits_soft_cap=1.5,
    )
    _check(got, dense_window_attention(batch, SCALE, 13, 1.5), torch.float32)


needs_cpu_kernels = pytest.mark.skipif(
    not cpu_kernels.load(), reason="the C++ CPU kernels could not be built"
)


@needs_cpu_kernels
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(
    ("block_size", "dtype"), [(4, torch.float32), (16, torch.float32), (32, torch.bfloat16)]
)
@pytest.mark.parametrize("step", range(len(STEPS)))
def test_cpu_kernel(
    step: int,
    block_size: int,
    dtype: torch.dtype,
    heads: tuple[int, int],
    window: int | None,
    cap: float | None,
) -> None:
    batch = _batch(step, heads, 32, block_size, dtype, KVLayout.HEAD_MAJOR_KT, torch.device("cpu"))
    poison_before_windows(batch, window)
    meta = _metadata(batch)
    got = torch.empty_like(batch.query)
    torch.ops.inflight_cpu.paged_attention(
        got,
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        SCALE,
        meta.max_query_len,
        window or 0,
        cap or 0.0,
    )
    _check(got, dense_window_attention(batch, SCALE, window, cap), dtype)


@needs_cpu_kernels
@pytest.mark.parametrize("route", ["kernel", "sdpa"])
@pytest.mark.parametrize(("window", "cap"), [(None, None), (13, None), (32, 1.5), (200, None)])
@pytest.mark.parametrize("step", [2, 3])
def test_cpu_backend_through_either_prefill_route(
    monkeypatch: pytest.MonkeyPatch, route: str, window: int | None, cap: float | None, step: int
) -> None:
    # The 40-token chunk of step 2 and the 48-token prompt of step 3 are long enough for the SDPA route;
    # the decodes stay on the kernel. Given the step's own K/V, as the model passes them, the whole
    # prompt attends them instead of its cached copy: the same result.
    monkeypatch.setenv("INFLIGHT_CPU_PREFILL_ATTENTION", route)
    batch = _batch(step, (4, 2), 32, 16, torch.float32, KVLayout.HEAD_MAJOR_KT, torch.device("cpu"))
    poison_before_windows(batch, window)
    backend = get_attention_backend("cpu")
    got = backend.forward(
        batch.query, batch.kv_cache, _metadata(batch), SCALE, sliding_window=window, logits_soft_cap=cap
    )
    _check(got, dense_window_attention(batch, SCALE, window, cap), torch.float32)
    starts = batch.query_start_loc.tolist()
    new_k, new_v = (
        torch.cat([t[t.shape[0] - (b - a) :] for t, a, b in zip(ts, starts, starts[1:], strict=False)])
        for ts in (batch.keys, batch.values)
    )
    if route == "sdpa":
        batch.kv_cache.fill_(float("nan"))  # the whole prompt must not read the cache; the rest reads NaN
    own = backend.forward(
        batch.query,
        batch.kv_cache,
        _metadata(batch),
        SCALE,
        sliding_window=window,
        logits_soft_cap=cap,
        new_kv=(new_k, new_v),
    )
    prompt = slice(0, 48) if step == 3 else slice(0, 0)
    assert torch.equal(own[prompt], got[prompt])
    if route == "kernel":
        assert torch.equal(own, got)  # the kernel reads the cache in place: new_kv changes nothing


def test_triton_backend_passes_window_and_cap() -> None:
    batch = _batch(1, (4, 2), 16, 4, torch.float32)
    poison_before_windows(batch, 13)
    backend = get_attention_backend("triton")
    got = backend.forward(
        batch.query, batch.kv_cache, _metadata(batch), SCALE, sliding_window=13, logits_soft_cap=1.5
    )
    _check(got, dense_window_attention(batch, SCALE, 13, 1.5), torch.float32)
