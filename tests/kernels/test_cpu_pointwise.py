"""The C++ fused pointwise ops vs the torch references (engine/kernels/reference.py): same rounding
op by op, so float32 agrees to the last bit or two and bfloat16 to one bf16 ulp."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu as cpu_kernels
from engine.kernels import reference
from engine.layers.rope_scaling import cos_sin_cache

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels could not be built here")

DTYPES = [torch.float32, torch.bfloat16]
# float32: the norm's sum of squares runs in another order than torch's, and exp is a polynomial:
# a few ulp. bfloat16: at most one ulp of the result (2^-7 relative), from the same float32 causes.
TOL = {torch.float32: {"atol": 1e-6, "rtol": 2e-6}, torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3}}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (7, 576), (64, 512), (3, 100)])  # 100: a scalar tail
def test_rms_norm(dtype, rows, hidden):
    x = (torch.randn(rows, hidden, generator=_gen(0)) * 3).to(dtype)
    w = torch.randn(hidden, generator=_gen(1)).to(dtype)
    out = torch.empty_like(x)
    torch.ops.inflight_cpu.rms_norm(out, x, None, w, 1e-5)
    torch.testing.assert_close(out, reference.rms_norm(x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_in_place(dtype):
    x = torch.randn(9, 576, generator=_gen(2)).to(dtype)
    residual = torch.randn(9, 576, generator=_gen(3)).to(dtype)
    w = torch.randn(576, generator=_gen(4)).to(dtype)
    want_out, want_res = reference.fused_add_rms_norm(x, residual, w, 1e-6)
    torch.ops.inflight_cpu.rms_norm(x, x, residual, w, 1e-6)  # out aliases x, as the model calls it
    # The residual sum is one rounding of the same two numbers: exact in both dtypes.
    torch.testing.assert_close(residual, want_res, atol=0, rtol=0)
    torch.testing.assert_close(x, want_out, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128, 40])  # 40: half of 20, a scalar tail
def test_rotary_in_place_on_strided_views(dtype, head_size):
    tokens, hq, hkv = 11, 6, 2
    cache = cos_sin_cache(head_size, 4096, 10000.0, None)
    positions = torch.randint(0, 4096, (tokens,), generator=_gen(5))
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_size, generator=_gen(6)).to(dtype)
    q = qkv[:, : hq * head_size].view(tokens, hq, head_size)
    k = qkv[:, hq * head_size : (hq + hkv) * head_size].view(tokens, hkv, head_size)
    v_before = qkv[:, (hq + hkv) * head_size :].clone()
    want_q, want_k = reference.rotary_embedding(positions, q.clone(), k.clone(), cache)
    torch.ops.inflight_cpu.rotary(q, k, positions, cache)
    exact = {"atol": 0, "rtol": 0} if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(q, want_q, **exact)
    torch.testing.assert_close(k, want_k, **exact)
    assert torch.equal(qkv[:, (hq + hkv) * head_size :], v_before)  # V untouched


def test_rotary_rejects_positions_outside_the_cache():
    cache = cos_sin_cache(64, 16, 10000.0, None)
    q, k = torch.randn(1, 2, 64), torch.randn(1, 1, 64)
    with pytest.raises(RuntimeError, match="outside the rotary cache"):
        torch.ops.inflight_cpu.rotary(q, k, torch.tensor([16]), cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 24])  # 24: a scalar tail
def test_silu_and_mul(dtype, inter):
    x = (torch.randn(13, 2 * inter, generator=_gen(7)) * 4).to(dtype)
    x[0, 0], x[0, 1] = -200.0, 200.0  # exp(-x) far past float range on both sides
    out = torch.empty(13, inter, dtype=dtype)
    torch.ops.inflight_cpu.silu_and_mul(out, x)
    torch.testing.assert_close(out, reference.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize(("rows", "vocab"), [(1, 7), (64, 8192), (5, 49152 + 3)])
def test_argmax_rows_matches_torch(rows, vocab):
    x = torch.randn(rows, vocab, generator=_gen(8))
    x[0, vocab // 2] = x[0].max() + 1.0
    if rows > 2:
        x[1, 3] = x[1, vocab - 1] = x[1].max() + 1.0  # a tie: the first index wins
        x[2, -1] = float("nan")  # NaN counts as the maximum, as in torch
        x[2, 1] = float("nan")
    got = torch.ops.inflight_cpu.argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))
    strided = torch.randn(3, 2 * vocab, generator=_gen(9))[:, :vocab]  # rows strided, as a slice of logits
    assert torch.equal(torch.ops.inflight_cpu.argmax_rows(strided), strided.argmax(dim=-1))
    all_inf = torch.full((1, vocab), float("-inf"))
    assert torch.equal(torch.ops.inflight_cpu.argmax_rows(all_inf), all_inf.argmax(dim=-1))


def _twice(t: torch.Tensor) -> torch.Tensor:
    """Columns 32..47 a copy of columns 0..15: the first 32 go through the bf16 pair path (two values a
    32-bit word), the next 16 through the 16-lane path."""
    t = t.clone()
    t[:, 32:48] = t[:, :16]
    return t


def test_bf16_pair_path_rounds_as_the_sixteen_lane_path():
    h = _twice((torch.randn(5, 48, generator=_gen(11)) * 3).to(torch.bfloat16))
    residual = _twice(torch.randn(5, 48, generator=_gen(12)).to(torch.bfloat16))
    w = _twice(torch.randn(1, 48, generator=_gen(13)).to(torch.bfloat16))[0]
    torch.ops.inflight_cpu.rms_norm(h, h, residual, w, 1e-6)
    assert torch.equal(residual[:, :16], residual[:, 32:48])
    assert torch.equal(h[:, :16], h[:, 32:48])


def test_silu_and_mul_bf16_pair_path_rounds_as_the_sixteen_lane_path():
    gate = _twice((torch.randn(5, 48, generator=_gen(14)) * 4).to(torch.bfloat16))
    up = _twice(torch.randn(5, 48, generator=_gen(15)).to(torch.bfloat16))
    gate[0, 0] = gate[0, 32] = -200.0  # exp(-x) past float range, on both paths
    gate[1, 1] = gate[1, 33] = float("nan")
    out = torch.empty(5, 48, dtype=torch.bfloat16)
    torch.ops.inflight_cpu.silu_and_mul(out, torch.cat([gate, up], dim=1))
    assert torch.equal(out[:, :16].view(torch.int16), out[:, 32:48].view(torch.int16))
    want = reference.silu_and_mul(torch.cat([gate[:, :16], up[:, :16]], dim=1))
    torch.testing.assert_close(out[:, :16], want, equal_nan=True, **TOL[torch.bfloat16])
