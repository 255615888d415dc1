"""Triton RMSNorm kernels vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import reference
from engine.kernels.norm import fused_add_rms_norm, rms_norm

# bf16: up to two roundings apart, and the interpreter truncates float32 -> bf16 instead of rounding.
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _inputs(hidden, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(7, hidden, generator=gen)).to(dtype).to(device)
    residual = torch.randn(7, hidden, generator=gen).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    return x, residual, weight


@pytest.mark.parametrize(
    ("hidden", "dtype"), [(64, torch.float32), (96, torch.bfloat16), (1024, torch.float32)]
)
def test_rms_norm(device, hidden, dtype):
    x, _, weight = _inputs(hidden, dtype, device)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-6), **TOL[dtype])


@pytest.mark.parametrize(("hidden", "dtype"), [(64, torch.float32), (96, torch.bfloat16)])
def test_fused_add_rms_norm(device, hidden, dtype):
    x, residual, weight = _inputs(hidden, dtype, device, seed=1)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    want_out, want_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    if device.type == "cuda":
        assert torch.equal(new_residual, want_residual)  # one rounding of the same sum
    torch.testing.assert_close(new_residual, want_residual, **TOL[dtype])
    torch.testing.assert_close(out, want_out, **TOL[dtype])


def test_strided_rows(device):
    x, _, weight = _inputs(64, torch.float32, device)
    wide = torch.cat([x, x], dim=1)[:, :64]  # row stride 128
    torch.testing.assert_close(rms_norm(wide, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))


def test_reference_follows_hf_rounding():
    # HF rounds the normalised row to bf16 before the weight multiply; a float32 multiply differs.
    x, _, weight = _inputs(64, torch.bfloat16, torch.device("cpu"), seed=2)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(reference.rms_norm(x, weight, 1e-6), weight * normed.to(torch.bfloat16))
