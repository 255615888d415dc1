"""Both attention backends vs a dense naive causal attention, through store_kv and forward."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.attention.backend import get_attention_backend

# Float32 must agree to ~1e-5: the CPU engine is checked token-for-token against HF transformers.
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2}}

CASES = [
    # (query_lens, seq_lens, Hq, Hkv, head_size, block_size, dtype)
    ([1, 9, 1, 1, 30, 1], [40, 9, 200, 17, 75, 129], 8, 2, 64, 16, torch.float32),  # mixed, GQA 4
    ([1, 1, 1], [3, 33, 64], 8, 1, 128, 32, torch.float32),  # decode only, GQA 8
    ([13, 2], [13, 50], 2, 2, 64, 16, torch.float32),  # prefill only, MHA
    ([1, 6, 1], [21, 26, 90], 4, 1, 64, 16, torch.bfloat16),
]


def _fresh_step(batch):
    """The step's new K/V, with their cache slots poisoned so only store_kv can fill them."""
    starts = batch.query_start_loc.tolist()
    new_k = torch.cat(
        [k[k.shape[0] - (b - a) :] for k, a, b in zip(batch.keys, starts, starts[1:], strict=False)]
    )
    new_v = torch.cat(
        [v[v.shape[0] - (b - a) :] for v, a, b in zip(batch.values, starts, starts[1:], strict=False)]
    )
    cache = batch.token_major_cache()
    block_size = cache.shape[2]
    for half in (0, 1):
        cache[half, batch.slot_mapping // block_size, batch.slot_mapping % block_size] = float("nan")
    batch.layout.fill_from_token_major(batch.kv_cache, cache)  # the poison, in the cache's own layout
    return new_k, new_v


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
@pytest.mark.parametrize(("query_lens", "seq_lens", "hq", "hkv", "head_size", "block_size", "dtype"), CASES)
def test_store_then_attend_matches_dense(
    paged_batch, dense_attention, backend_name, query_lens, seq_lens, hq, hkv, head_size, block_size, dtype
):
    batch = paged_batch(query_lens, seq_lens, hq, hkv, head_size, block_size, dtype)
    want = dense_attention(batch, head_size**-0.5)
    new_k, new_v = _fresh_step(batch)
    backend = get_attention_backend(backend_name)
    assert backend.name == backend_name
    metadata = batch.metadata()
    backend.store_kv(new_k, new_v, batch.kv_cache, metadata)
    out = backend.forward(batch.query, batch.kv_cache, metadata, head_size**-0.5)
    assert out.dtype == dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


def test_torch_backend_many_decodes(paged_batch, dense_attention):
    # 40 decodes of scattered lengths: several length buckets, padded slots full of NaN.
    gen = torch.Generator().manual_seed(3)
    seq_lens = torch.randint(1, 300, (40,), generator=gen).tolist()
    batch = paged_batch([1] * 40, seq_lens, 4, 2, 32, 16)
    out = get_attention_backend("torch").forward(batch.query, batch.kv_cache, batch.metadata(), 0.2)
    torch.testing.assert_close(out, dense_attention(batch, 0.2), **TOL[torch.float32])


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_padding_tokens_skipped_and_zero(paged_batch, dense_attention, backend_name):
    # A CUDA-graph padded decode step: two trailing tokens belong to no request and have slot -1.
    batch = paged_batch([1, 1], [30, 7], 4, 1, 64, 16)
    want = dense_attention(batch, 0.1)
    new_k, new_v = _fresh_step(batch)
    batch.query = torch.cat([batch.query, torch.randn_like(batch.query)])
    batch.slot_mapping = torch.cat([batch.slot_mapping, batch.slot_mapping.new_full((2,), -1)])
    before = batch.kv_cache.clone()
    metadata = batch.metadata()
    backend = get_attention_backend(backend_name)
    backend.store_kv(torch.cat([new_k, new_k]), torch.cat([new_v, new_v]), batch.kv_cache, metadata)
    changed = (batch.kv_cache != before) & ~(batch.kv_cache.isnan() & before.isnan())
    assert int(changed.sum()) == 2 * 2 * 64  # K and V of the two real tokens only
    out = backend.forward(batch.query, batch.kv_cache, metadata, 0.1)
    torch.testing.assert_close(out[:2], want, **TOL[torch.float32])
    assert torch.all(out[2:] == 0)


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash")


def test_cpu_path_needs_no_triton():
    # The CPU engine imports the kernels package and the torch backend; none of it may pull in triton.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import engine.kernels as k\n"
        "from engine.attention.backend import get_attention_backend\n"
        "assert get_attention_backend('torch').name == 'torch'\n"
        "assert not k.triton_available()\n"
        "try:\n    k.rms_norm\nexcept ImportError:\n    pass\n"
        "else:\n    raise SystemExit('rms_norm imported without triton')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
