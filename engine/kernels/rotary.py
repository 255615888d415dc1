"""Rotary position embedding, NeoX / HF ``rotate_half`` layout (Triton), out of place or in place.

In place, the model rotates q and k where the fused QKV projection wrote them (strided views), so
no copy precedes rotary or the KV store. Each program reads a head's two halves before it writes
them, so reading and writing the same memory is safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(  # type: ignore[no-untyped-def]
    out_ptr,  # [T, H, D]; may be x_ptr itself (in place)
    x_ptr,  # [T, H, D]
    token,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    cos,  # [1, BLOCK_HALF] float32
    sin,  # [1, BLOCK_HALF] float32
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # Dimension i < D/2 rotates with i + D/2: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    HALF: tl.constexpr = HEAD_SIZE // 2
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    src = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(  # type: ignore[no-untyped-def]
    q_out_ptr,  # [T, Hq, D]; query_ptr itself when in place
    k_out_ptr,  # [T, Hkv, D]; key_ptr itself when in place
    positions_ptr,  # [T] int64
    query_ptr,  # [T, Hq, D]
    key_ptr,  # [T, Hkv, D]
    cos_sin_ptr,  # [max_pos, D] float32
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cache,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HEAD_SIZE // 2
    cos = tl.load(cos_sin_ptr + pos * stride_cache + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cache + HEAD_SIZE // 2 + offs_d, mask=d_mask, other=0.0)[None, :]
    _rotate_heads(
        q_out_ptr,
        query_ptr,
        token,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        cos,
        sin,
        NUM_HEADS,
        HEAD_SIZE,
        BLOCK_HQ,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_out_ptr,
        key_ptr,
        token,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        cos,
        sin,
        NUM_KV_HEADS,
        HEAD_SIZE,
        BLOCK_HKV,
        BLOCK_HALF,
    )


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32: cos in [:, :D/2], sin in [:, D/2:]
    *,
    inplace: bool = False,  # rotate query and key where they are (returned as they came)
) -> tuple[
    torch.Tensor, torch.Tensor
]:  # query [T, Hq, D], key [T, Hkv, D]: new contiguous ones, or the inputs
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    assert key.shape == (num_tokens, num_kv_heads, head_size), (tuple(key.shape), tuple(query.shape))
    assert head_size % 2 == 0, f"head_size {head_size} must be even"
    # Token and head strides are free (views into a fused QKV output); a head must be contiguous.
    assert query.stride(2) == 1 and key.stride(2) == 1, "head_size dimension must be contiguous"
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_size, tuple(cos_sin_cache.shape)
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(1) == 1
    assert query.device == key.device == positions.device == cos_sin_cache.device
    if inplace:
        q_out, k_out = query, key
    else:
        q_out = torch.empty((num_tokens, num_heads, head_size), dtype=query.dtype, device=query.device)
        k_out = torch.empty((num_tokens, num_kv_heads, head_size), dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    _rotary_kernel[(num_tokens,)](
        q_out,
        k_out,
        positions,
        query,
        key,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_size // 2),
    )
    return q_out, k_out
