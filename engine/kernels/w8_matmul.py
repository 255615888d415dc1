"""Linear layers on per-channel 8-bit weights (Triton): out = x @ (scale[:, None] * q).T (+ bias), q int8
(W8A16) or fp8 e4m3 (W8A16-FP8).

A program computes a [BLOCK_M, BLOCK_N] tile of the output. Each BLOCK_K slice loads the codes of
BLOCK_N rows, converts them in registers to x's dtype (every int8 value is exact in bf16 and fp16, and
so is every e4m3 value times 2^-8, so the tensor cores multiply the stored values themselves) and
accumulates x @ q.T in float32; each row's scale multiplies its column once, after the sum. The weight
is read once per BLOCK_M rows of x: a quarter of float32's bytes, half of bf16's.

e4m3 codes are read as bytes and their bits moved under an fp16's (engine/quant/channel.py,
``decode_e4m3``) rather than converted as fp8: that conversion needs compute capability 8.9, this runs
on any GPU Triton does (and under the interpreter, which cannot load fp8 with a masked fill).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._common import is_interpreted


@triton.jit
def _w8_matmul_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [M, N], x's dtype, contiguous
    x_ptr,  # [M, K], rows stride_xm apart
    q_ptr,  # [N, K] int8 (or e4m3 bytes as uint8), contiguous
    scale_ptr,  # [N] float32
    bias_ptr,  # [N] or a dummy when not HAS_BIAS
    M,
    N,
    K,
    stride_xm,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FP8: tl.constexpr,  # q holds e4m3 bytes (uint8): values decoded times 2^-8, the scale takes 2^8
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        # [BLOCK_K, BLOCK_N]: value kk of row n; past K (or N) zeros, which add nothing.
        q = tl.load(
            q_ptr + offs_n[None, :].to(tl.int64) * K + kk[:, None],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0,
        )
        if FP8:
            b = q.to(tl.uint16)
            q = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True)
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + kk[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        if x.dtype == tl.float32 or DOT_FP32:  # the interpreter cannot multiply bf16: upcast, same products
            acc += tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, q.to(x.dtype))
    scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    acc *= (scale * 256.0 if FP8 else scale)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def w8_matmul(
    x: torch.Tensor,  # [M, K] float32, bf16 or fp16, rows contiguous
    qweight: torch.Tensor,  # [N, K] int8 or float8_e4m3fn, contiguous
    scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] == qweight.shape[1], (
        tuple(x.shape),
        qweight.shape,
    )
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), x.dtype
    assert qweight.dtype in (torch.int8, torch.float8_e4m3fn) and qweight.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (qweight.shape[0],) and scale.is_contiguous()
    assert qweight.device == x.device == scale.device
    fp8 = qweight.dtype == torch.float8_e4m3fn
    num_tokens, (out_features, in_features) = x.shape[0], qweight.shape
    if bias is not None:
        assert bias.shape == (out_features,) and bias.is_contiguous(), tuple(bias.shape)
    out = torch.empty((num_tokens, out_features), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block_m = 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64  # tl.dot needs >= 16
    block_n = 32 if out_features <= 32 else 64
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(out_features, block_n))
    _w8_matmul_kernel[grid](
        out,
        x,
        qweight.view(torch.uint8) if fp8 else qweight,
        scale,
        bias if bias is not None else out,
        num_tokens,
        out_features,
        in_features,
        x.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=64,
        DOT_FP32=is_interpreted(x),
        FP8=fp8,
    )
    return out
