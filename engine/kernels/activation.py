"""SiLU-gated MLP activation (Triton): silu(gate) * up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # elements of one output row per program


@triton.jit
def _silu_and_mul_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [T, I] contiguous
    x_ptr,  # [T, 2I]: gate in [:, :I], up in [:, I:]
    stride_x,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    # Rounded to the model dtype before the product, as HF's act_fn(gate) * up is.
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inter + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [T, 2 * I]
) -> torch.Tensor:  # [T, I] contiguous
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2I], got {tuple(x.shape)}"
    assert x.stride(1) == 1, "rows of x must be contiguous"
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](out, x, x.stride(0), inter, BLOCK=block)
    return out
