"""RMSNorm and residual-add + RMSNorm (Triton), with HF Llama's rounding points."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [T, H]
    residual_out_ptr,  # [T, H], x + residual (HAS_RESIDUAL only)
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H] (HAS_RESIDUAL only)
    weight_ptr,  # [H]
    stride_x,
    stride_r,
    stride_out,
    stride_res_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,  # hidden rounded up to a power of two: one row per program
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # The sum is rounded to the model dtype before it is normalised, as HF's residual stream is.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_res_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    # HF rounds the normalised row to the input dtype, then multiplies by the weight.
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [T, H] with contiguous rows, got {tuple(x.shape)}"
    num_tokens, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous(), (tuple(weight.shape), hidden)
    assert weight.dtype == x.dtype, f"weight {weight.dtype} vs input {x.dtype}"
    assert weight.device == x.device
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        assert residual.device == x.device
        new_residual = torch.empty_like(out)
    else:
        residual = new_residual = x  # placeholders: the kernel neither reads nor writes them
    if num_tokens == 0:
        return out, new_residual
    block_h = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        out,
        new_residual,
        x,
        residual,
        weight,
        x.stride(0),
        residual.stride(0),
        out.stride(0),
        new_residual.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=new_residual is not x,
        BLOCK_H=block_h,
        num_warps=4 if block_h <= 1024 else (8 if block_h <= 4096 else 16),
    )
    return out, new_residual


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H], same dtype as x
    eps: float,
) -> torch.Tensor:  # [T, H] contiguous
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out = rms_norm(x + residual) [T, H], new_residual [T, H]
    return _launch(x, residual, weight, eps)
