"""Scatter of the step's K/V into the paged cache (Triton); an 8-bit cache is quantized on the way
(one float32 scale per token and kv head after the row's codes: engine/kernels/kv_quant.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import kv_quant
from engine.kernels._common import check_kv_cache


@triton.jit
def _store_kvcache_kernel(  # type: ignore[no-untyped-def]
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks * block_size, Hkv, D], the K half of the layer's cache
    v_cache_ptr,  # [num_blocks * block_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64
    k_scale_ptr,  # the K half as float32 (a view of the same bytes), read when QUANT
    v_scale_ptr,  # the V half as float32
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_head,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr = False,  # an 8-bit cache: rows of HEAD_SIZE codes, then a float32 scale
    QMAX: tl.constexpr = 127.0,  # the format's largest code: int8 127, fp8 e4m3 448
    ROUND: tl.constexpr = False,  # int8 codes round to nearest; else fp8 codes round to e4m3
):
    # One program per (token, kv head): a head is D contiguous elements on both sides.
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding token of a CUDA-graph bucket
        return
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < HEAD_SIZE
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + offs_d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + offs_d, mask=mask)
    row = slot * stride_cache_slot + head * stride_cache_head
    if QUANT:
        _store_quantized(k_cache_ptr, k_scale_ptr, row, k, offs_d, mask, HEAD_SIZE, QMAX, ROUND)
        _store_quantized(v_cache_ptr, v_scale_ptr, row, v, offs_d, mask, HEAD_SIZE, QMAX, ROUND)
    else:
        tl.store(k_cache_ptr + row + offs_d, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + row + offs_d, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_e4m3(x):  # type: ignore[no-untyped-def]
    """x rounded to the nearest e4m3 value (ties to even), as torch's conversion rounds; the cast that
    follows is then exact. Done here because the interpreter's own cast loses the carry of a rounding
    that crosses a power of two (127.5 became 64). Normal range (|x| >= 2^-6): 3 mantissa bits kept by
    integer rounding of the float32 bits; below it, multiples of 2^-9, rounded by adding and
    subtracting 1.5 * 2^23 (whose float32 spacing is 1)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    tiny = ((x * 512.0 + 12582912.0) - 12582912.0) / 512.0
    return tl.where(tl.abs(x) < 0.015625, tiny, normal)


@triton.jit
def _store_quantized(cache_ptr, scale_ptr, row, x, offs_d, mask, HEAD_SIZE, QMAX, ROUND):  # type: ignore[no-untyped-def]
    """One row as codes x / s plus its scale s = max |x| / QMAX, at element offset ``row`` (the
    scale at float32 offset (row + HEAD_SIZE) / 4: rows are multiples of 4 bytes)."""
    xf = tl.where(mask, x.to(tl.float32), 0.0)
    scale = tl.max(tl.abs(xf), axis=0) / QMAX
    codes = xf / tl.where(scale == 0.0, 1.0, scale)
    codes = tl.minimum(tl.maximum(codes, -QMAX), QMAX)
    if ROUND:
        codes = tl.where(codes >= 0, tl.floor(codes + 0.5), tl.ceil(codes - 0.5))
    else:
        codes = _round_to_e4m3(codes)
    tl.store(cache_ptr + row + offs_d, codes.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + (row + HEAD_SIZE) // 4, scale)


def store_kvcache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1: skip
) -> None:
    num_tokens, num_kv_heads, head_size = key.shape
    check_kv_cache(kv_cache, num_kv_heads, head_size)
    quant = kv_quant.is_quantized(kv_cache.dtype)
    assert value.shape == key.shape, (value.shape, key.shape)
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    # Token and head strides are free (K/V are often views into a fused QKV output); a head's D
    # elements must be contiguous.
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_size dimension must be contiguous"
    assert key.device == kv_cache.device == slot_mapping.device
    if num_tokens == 0:
        return
    row = kv_cache.shape[-1]
    k_cache = kv_cache[0].view(-1, num_kv_heads, row)
    v_cache = kv_cache[1].view(-1, num_kv_heads, row)
    _store_kvcache_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_cache.view(torch.float32) if quant else k_cache,
        v_cache.view(torch.float32) if quant else v_cache,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        HEAD_SIZE=head_size,
        BLOCK_D=triton.next_power_of_2(head_size),
        QUANT=quant,
        QMAX=kv_quant.qmax(kv_cache.dtype) if quant else 1.0,
        ROUND=kv_cache.dtype == torch.int8,
    )
