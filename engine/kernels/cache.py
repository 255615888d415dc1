"""Scatter of the step's K/V into the paged cache (Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._common import check_kv_cache


@triton.jit
def _store_kvcache_kernel(  # type: ignore[no-untyped-def]
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks * block_size, Hkv, D], the K half of the layer's cache
    v_cache_ptr,  # [num_blocks * block_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_head,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
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
    dst = slot * stride_cache_slot + head * stride_cache_head + offs_d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1: skip
) -> None:
    num_tokens, num_kv_heads, head_size = key.shape
    check_kv_cache(kv_cache, num_kv_heads, head_size)
    assert value.shape == key.shape, (value.shape, key.shape)
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    # Token and head strides are free (K/V are often views into a fused QKV output); a head's D
    # elements must be contiguous.
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_size dimension must be contiguous"
    assert key.device == kv_cache.device == slot_mapping.device
    if num_tokens == 0:
        return
    k_cache = kv_cache[0].view(-1, num_kv_heads, head_size)
    v_cache = kv_cache[1].view(-1, num_kv_heads, head_size)
    _store_kvcache_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        HEAD_SIZE=head_size,
        BLOCK_D=triton.next_power_of_2(head_size),
    )
