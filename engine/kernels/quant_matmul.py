"""Linear layers on weights in GGUF block formats (Triton): out = x @ dequantize(w).T (+ bias).

The weight stays as stored, a row of blocks per output feature (engine/quant/formats.py gives each
block's struct). A program computes a [BLOCK_M, BLOCK_N] tile of the output; for each BLOCK_K slice of
the in features it gathers the bytes of BLOCK_N rows x BLOCK_K values, dequantizes them in registers
and multiplies them with ``tl.dot``. Every format is read value by value from its block: the value's
block is ``k // block_size``, and the offsets inside it follow the struct (worked example in
``_dequant``), so one kernel serves every format, the format a compile-time constant.

float32 x multiplies the dequantized float32 values exactly (``input_precision="ieee"``); bf16 x
multiplies them rounded to bf16 on the tensor cores, summed in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._common import is_interpreted
from engine.quant.formats import get_format

_BLOCK_K = 32  # values per slice: one block of the 32-value formats, an eighth of a K-quant's


@triton.jit
def _u8(ptr):  # type: ignore[no-untyped-def]
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _f16(ptr):  # type: ignore[no-untyped-def]
    """The little-endian half at ``ptr`` (fp16 fields sit at even offsets of 2-byte-aligned blocks)."""
    bits = (_u8(ptr) | (_u8(ptr + 1) << 8)).to(tl.uint16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant(blk, w, FMT: tl.constexpr):  # type: ignore[no-untyped-def]
    """Values at offsets ``w`` inside the blocks starting at ``blk`` (both [BLOCK_K, BLOCK_N]), float32.

    FMT is ggml's type id. Worked example, Q6_K, w = 200: h = 1, p = (200 % 128) // 32 = 2, l = 8, so
    low bits ql[64 + 0 + 8] >> 4, high bits qh[32 + 8] >> 4 (at byte 128 + 40), scale scales[8 + 4 + 0].
    """
    if FMT == 8:  # Q8_0: half d; int8 qs[32]
        q = _u8(blk + 2 + w).to(tl.uint8).to(tl.int8, bitcast=True).to(tl.float32)
        return _f16(blk) * q
    elif FMT == 2 or FMT == 3:  # Q4_0: half d; qs[16] / Q4_1: half d, m; qs[16]
        qs = 2 if FMT == 2 else 4
        q = ((_u8(blk + qs + w % 16) >> (w // 16 * 4)) & 15).to(tl.float32)
        if FMT == 2:
            return _f16(blk) * (q - 8.0)
        return _f16(blk) * q + _f16(blk + 2)
    elif FMT == 6 or FMT == 7:  # Q5_0: half d; qh[4]; qs[16] / Q5_1: half d, m; qh[4]; qs[16]
        qh = 2 if FMT == 6 else 4
        nibble = (_u8(blk + qh + 4 + w % 16) >> (w // 16 * 4)) & 15
        # Bit w of qh as a little-endian word: byte w // 8, bit w % 8 (qh is only 2-byte aligned).
        q = (nibble | (((_u8(blk + qh + w // 8) >> (w % 8)) & 1) << 4)).to(tl.float32)
        if FMT == 6:
            return _f16(blk) * (q - 16.0)
        return _f16(blk) * q + _f16(blk + 2)
    elif FMT == 12 or FMT == 13:  # Q4_K / Q5_K: half d, dmin; scales[12]; (Q5_K: qh[32]); qs[128]
        sub = w // 32  # sub-block: the low (even) or high (odd) nibbles of chunk w // 64
        lane = w % 32
        qs = 16 if FMT == 12 else 48
        q = (_u8(blk + qs + 32 * (w // 64) + lane) >> (4 * (sub % 2))) & 15
        if FMT == 13:
            q = q | (((_u8(blk + 16 + lane) >> sub) & 1) << 4)
        # get_scale_min_k4 on three bytes: scales[sub % 4], scales[4 + sub % 4], scales[8 + sub % 4].
        first = _u8(blk + 4 + sub % 4)
        second = _u8(blk + 8 + sub % 4)
        mixed = _u8(blk + 12 + sub % 4)
        sc = tl.where(sub < 4, first & 63, (mixed & 15) | ((first >> 6) << 4)).to(tl.float32)
        m = tl.where(sub < 4, second & 63, (mixed >> 4) | ((second >> 6) << 4)).to(tl.float32)
        return (_f16(blk) * sc) * q.to(tl.float32) - _f16(blk + 2) * m
    else:  # Q6_K: ql[128]; qh[64]; int8 scales[16]; half d
        h = w // 128
        p = (w % 128) // 32
        lane = w % 32
        low = (_u8(blk + 64 * h + 32 * (p % 2) + lane) >> (4 * (p // 2))) & 15
        high = (_u8(blk + 128 + 32 * h + lane) >> (2 * p)) & 3
        sc = _u8(blk + 192 + 8 * h + 2 * p + lane // 16).to(tl.uint8).to(tl.int8, bitcast=True).to(tl.float32)
        return (_f16(blk + 208) * sc) * ((low | (high << 4)).to(tl.float32) - 32.0)


@triton.jit
def _quant_matmul_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [M, N], x's dtype, contiguous
    x_ptr,  # [M, K], rows stride_xm apart
    w_ptr,  # [N, row_bytes] uint8: each row's blocks
    bias_ptr,  # [N] or a dummy when not HAS_BIAS
    M,
    N,
    K,
    stride_xm,
    row_bytes,
    FMT: tl.constexpr,
    BLOCK_VALUES: tl.constexpr,  # values per block: 32 or 256
    BLOCK_BYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    # Rows past N read row N - 1 (valid bytes); their columns are never stored.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k  # [BLOCK_K]
        # [BLOCK_K, BLOCK_N]: the block holding value kk of row n, and kk's offset in it.
        blk = w_ptr + rows[None, :] * row_bytes + (kk // BLOCK_VALUES * BLOCK_BYTES)[:, None]
        w = _dequant(blk, (kk % BLOCK_VALUES)[:, None], FMT)
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + kk[None, :], mask=mask_m[:, None], other=0.0
        )
        if x.dtype == tl.float32:
            acc += tl.dot(x, w, input_precision="ieee")
        elif DOT_FP32:  # the same products, upcast: the interpreter cannot multiply bf16
            acc += tl.dot(x.to(tl.float32), w.to(x.dtype).to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_n < N)[None, :])


def quant_matmul(
    x: torch.Tensor,  # [M, K] float32 or bf16, rows contiguous
    blocks: torch.Tensor,  # [N, row_bytes] uint8, contiguous
    format: str,  # a name in engine/quant/formats.py's FORMATS
    in_features: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    fmt = get_format(format)
    assert x.dim() == 2 and x.shape[1] == in_features and x.stride(1) == 1, (tuple(x.shape), in_features)
    assert x.dtype in (torch.float32, torch.bfloat16), x.dtype
    assert blocks.dtype == torch.uint8 and blocks.is_contiguous(), (blocks.dtype, blocks.stride())
    assert blocks.shape[1] == fmt.row_bytes(in_features), (tuple(blocks.shape), format, in_features)
    assert blocks.device == x.device
    num_tokens, out_features = x.shape[0], blocks.shape[0]
    if bias is not None:
        assert bias.shape == (out_features,) and bias.is_contiguous(), tuple(bias.shape)
    out = torch.empty((num_tokens, out_features), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block_m = 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64  # tl.dot needs >= 16
    block_n = 32 if out_features <= 32 else 64
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(out_features, block_n))
    _quant_matmul_kernel[grid](
        out,
        x,
        blocks,
        bias if bias is not None else out,
        num_tokens,
        out_features,
        in_features,
        x.stride(0),
        blocks.shape[1],
        FMT=fmt.ggml_type,
        BLOCK_VALUES=fmt.block_size,
        BLOCK_BYTES=fmt.block_bytes,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=_BLOCK_K,
        DOT_FP32=is_interpreted(x),
    )
    return out
