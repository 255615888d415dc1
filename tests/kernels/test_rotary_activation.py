"""Triton rotary embedding and SiLU-and-mul vs the torch references."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import reference
from engine.kernels.activation import silu_and_mul
from engine.kernels.rotary import rotary_embedding

# bf16: up to two roundings apart, and the interpreter truncates float32 -> bf16 instead of rounding.
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _cos_sin_cache(max_pos: int, head_size: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)  # [max_pos, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_size", "dtype"),
    [(4, 1, 64, torch.float32), (8, 2, 128, torch.bfloat16), (3, 3, 32, torch.float32)],
)
def test_rotary_matches_reference(device, num_heads, num_kv_heads, head_size, dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens = 9
    # q and k as views into a fused QKV output, as the model passes them.
    qkv = (
        torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=gen)
        .to(dtype)
        .to(device)
    )
    query = qkv[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    key = qkv[:, num_heads * head_size : (num_heads + num_kv_heads) * head_size].view(
        num_tokens, num_kv_heads, head_size
    )
    positions = torch.tensor([0, 1, 2, 7, 3, 100, 101, 5, 60], device=device)
    cache = _cos_sin_cache(128, head_size).to(device)
    q, k = rotary_embedding(positions, query, key, cache)
    want_q, want_k = reference.rotary_embedding(positions, query, key, cache)
    assert q.dtype == dtype and k.shape == key.shape
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_size", "dtype"),
    [(4, 2, 64, torch.float32), (8, 2, 128, torch.bfloat16)],
)
def test_rotary_in_place_on_strided_views(device, num_heads, num_kv_heads, head_size, dtype):
    # The model's Triton path: q and k rotated where the fused QKV projection wrote them, no copies.
    gen = torch.Generator().manual_seed(2)
    num_tokens, q_size, kv_size = 7, num_heads * head_size, num_kv_heads * head_size
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype).to(device)
    before = qkv.clone()
    query = qkv[:, :q_size].view(num_tokens, num_heads, head_size)
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_size)
    positions = torch.tensor([4, 0, 9, 1, 33, 2, 8], device=device)
    cache = _cos_sin_cache(64, head_size).to(device)
    want_q, want_k = reference.rotary_embedding(positions, query.clone(), key.clone(), cache)
    q, k = rotary_embedding(positions, query, key, cache, inplace=True)
    assert q.data_ptr() == qkv.data_ptr() and k.data_ptr() == key.data_ptr() and not q.is_contiguous()
    torch.testing.assert_close(qkv[:, :q_size].view_as(want_q), want_q, **TOL[dtype])
    torch.testing.assert_close(qkv[:, q_size : q_size + kv_size].view_as(want_k), want_k, **TOL[dtype])
    assert torch.equal(qkv[:, q_size + kv_size :], before[:, q_size + kv_size :])  # V untouched


def test_rotary_reference_is_hf_rotate_half():
    gen = torch.Generator().manual_seed(1)
    query, key = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 1, 16, generator=gen)
    positions = torch.tensor([0, 3, 4, 9, 2])
    cos_half, sin_half = _cos_sin_cache(10, 16)[positions].chunk(2, dim=-1)
    cos = torch.cat([cos_half, cos_half], -1)[:, None]  # HF's [T, 1, D] layout
    sin = torch.cat([sin_half, sin_half], -1)[:, None]

    def rotate_half(x):
        return torch.cat([-x[..., 8:], x[..., :8]], dim=-1)

    q, k = reference.rotary_embedding(positions, query, key, _cos_sin_cache(10, 16))
    torch.testing.assert_close(q, query * cos + rotate_half(query) * sin, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, key * cos + rotate_half(key) * sin, atol=1e-6, rtol=1e-6)
    assert torch.equal(q[0], query[0])  # position 0 is the identity


@pytest.mark.parametrize(("inter", "dtype"), [(96, torch.float32), (1500, torch.bfloat16)])
def test_silu_and_mul(device, inter, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (2 * torch.randn(5, 2 * inter, generator=gen)).to(dtype).to(device)
    out = silu_and_mul(x)
    assert out.shape == (5, inter) and out.dtype == dtype
    torch.testing.assert_close(out, reference.silu_and_mul(x), **TOL[dtype])
