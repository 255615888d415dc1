"""The 8-bit KV cache format (``kv_cache_dtype`` int8 and fp8_e4m3) and its torch reference.

A quantized cache keeps each (token, kv head) row of K (or V) as D one-byte codes followed by the
row's float32 scale, so a row is D + 4 bytes and a cache tensor's last dimension is D + 4 in the
cache's element type (``torch.int8`` or ``torch.float8_e4m3fn``, which also names the format):

    byte    0 .. D-1                  D .. D+3
            codes q[0] .. q[D-1]      scale s (float32, little-endian)
    value   x[i] = q[i] * s           s = max |x| / QMAX  (int8: QMAX 127, fp8_e4m3: 448)

One scale per row keeps a key's outlier dims from flattening every other head's values (vLLM's fp8
cache takes one scale per layer; a row scale costs 4 bytes per D, 6% at D 64) and makes a write touch
nothing but its own rows. The scale lives with its codes, so every layout that moves rows moves
scales with them and the cache stays one tensor per layer. int8 rounds to nearest; fp8 keeps 3
mantissa bits with a range that follows the row, so small values keep their relative precision.
D must be a multiple of 4 (the scale stays 4-byte aligned, which the kernels' float32 views need).

Example, D 4, int8, x = [0.5, -1.27, 0.0, 0.254]: s = 1.27 / 127 = 0.01, q = [50, -127, 0, 25],
the row is 50 -127 0 25 followed by the 4 bytes of 0.01.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # a float32 scale after each row's codes
# kv_cache_dtype names and the storage dtype that stands for each format.
KV_CACHE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
QUANT_DTYPES = tuple(KV_CACHE_DTYPES.values())
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANT_DTYPES


def qmax(dtype: torch.dtype) -> float:
    """The largest code of an 8-bit format: a row's max |x| maps to it."""
    return _QMAX[dtype]


def row_elements(dtype: torch.dtype, head_size: int) -> int:
    """Elements in one (token, kv head) row of a cache of ``dtype``: the cache tensor's last dimension."""
    if not is_quantized(dtype):
        return head_size
    if head_size % 4:
        raise ValueError(f"an 8-bit KV cache needs a head size that is a multiple of 4, got {head_size}")
    return head_size + SCALE_BYTES


def bytes_per_token_head(dtype: torch.dtype, head_size: int) -> int:
    """Bytes one token's K (or V) of one kv head takes in a cache of ``dtype``."""
    return row_elements(dtype, head_size) * torch.empty((), dtype=dtype).element_size()


def head_size_of(kv_cache: torch.Tensor) -> int:
    """D of a cache of any format: its last dimension, less the scale's bytes when it is quantized."""
    return kv_cache.shape[-1] - (SCALE_BYTES if is_quantized(kv_cache.dtype) else 0)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [..., D] -> [..., D + 4] of dtype
    """Rows of ``x`` as codes plus their scale (the format above)."""
    xf = x.float()
    qmax = _QMAX[dtype]
    scale = xf.abs().amax(dim=-1, keepdim=True) / qmax  # [..., 1]
    # An all-zero row keeps scale 0 and codes 0 (dividing by 1 instead of 0).
    scaled = xf / torch.where(scale == 0, torch.ones_like(scale), scale)
    if dtype == torch.int8:
        codes = scaled.round().clamp_(-qmax, qmax).to(torch.int8).view(torch.uint8)
    else:
        codes = scaled.clamp_(-qmax, qmax).to(dtype).view(torch.uint8)
    scale_bytes = scale.contiguous().view(torch.uint8)  # [..., 4]
    return torch.cat((codes, scale_bytes), dim=-1).view(dtype)


def dequantize(rows: torch.Tensor) -> torch.Tensor:  # [..., D + 4] of a quant dtype -> [..., D] float32
    """The values a quantized cache's rows hold; any other tensor as float32."""
    if not is_quantized(rows.dtype):
        return rows.float()
    head_size = rows.shape[-1] - SCALE_BYTES
    raw = rows.contiguous().view(torch.uint8)
    scale = raw[..., head_size:].contiguous().view(torch.float32)  # [..., 1]
    return raw[..., :head_size].view(rows.dtype).float() * scale


def round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` gives it back (float32 for the 8-bit formats, else ``dtype``)."""
    if is_quantized(dtype):
        return dequantize(quantize(x, dtype))
    return x.to(dtype)
