"""Rotary frequencies: the inverse frequencies of each RoPE variant HF checkpoints name, and the
cos/sin cache the kernels read.

Variants (``rope_scaling["rope_type"]``): default, linear, llama3, dynamic (NTK), yarn and longrope.
The two whose HF frequencies change with the sequence's length are fixed per position here, as a
paged engine must (a cached key is never rotated again):

  * dynamic: positions below ``max_position_embeddings`` rotate as plain RoPE (HF's own choice for
    every sequence that fits), positions past it with the base HF computes at ``max_model_len``;
  * longrope: positions below ``original_max_position_embeddings`` use the short factors, positions
    past it the long ones (HF switches the whole sequence once it grows past that length; keys it
    cached before the switch keep their short-factor rotation, as here).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


def rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, for the variants that do not depend on position
    ranges (default, linear, llama3, yarn's blend); ``head_dim`` is the rotated width."""
    inv_freq = _base_inv_freq(head_dim, theta)
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq
    assert scaling is not None
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope scaling {kind!r}; inflight serves {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept, and the band
    # in between is interpolated smoothly, so short-range attention is unchanged.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling["original_max_position_embeddings"])
    low_wavelen = original / low
    high_wavelen = original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    # Dimensions that turn many times over the original context keep their frequency (extrapolate),
    # slow ones are divided by `factor` (interpolate), with a linear ramp between the two bounds.
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def attention_factor(scaling: dict[str, Any] | None, max_position_embeddings: int) -> float:
    """The factor HF multiplies cos and sin by (yarn, longrope; 1 elsewhere)."""
    kind = rope_type(scaling)
    if scaling is None or kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original
    if kind == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_get_mscale(factor, float(mscale)) / _yarn_get_mscale(factor, float(mscale_all_dim))
    return _yarn_get_mscale(factor)


def _position_freqs(
    dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int, max_position_embeddings: int
) -> torch.Tensor:
    """[max_positions, dim // 2] angle of every position (rows may use different frequencies)."""
    t = torch.arange(max_positions, dtype=torch.int64).float()
    kind = rope_type(scaling)
    if kind not in ("dynamic", "longrope"):
        return torch.outer(t, rope_inv_freq(dim, theta, scaling))
    assert scaling is not None
    if kind == "dynamic":
        # Up to max_position_embeddings: plain RoPE; past it HF's base at the longest sequence served.
        boundary = max_position_embeddings
        factor = float(scaling["factor"])
        seq_len = max(max_positions, boundary)
        long_base = theta * ((factor * seq_len / boundary) - (factor - 1)) ** (dim / (dim - 2))
        short, long = _base_inv_freq(dim, theta), _base_inv_freq(dim, long_base)
    else:
        boundary = int(scaling["original_max_position_embeddings"])
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta**shape)
        long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * theta**shape)
    inv = torch.where((t < boundary)[:, None], short[None, :], long[None, :])
    return t[:, None] * inv


def cos_sin_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict[str, Any] | None,
    max_position_embeddings: int | None = None,
) -> torch.Tensor:
    """[max_positions, head_dim]: cos in the first half of each row, sin in the second (float32);
    ``head_dim`` is the rotated width (partial rotary: a fraction of the head)."""
    limit = max_position_embeddings if max_position_embeddings is not None else max_positions
    freqs = _position_freqs(head_dim, theta, scaling, max_positions, limit)  # [P, D/2]
    factor = attention_factor(scaling, limit)
    return torch.cat([freqs.cos() * factor, freqs.sin() * factor], dim=-1)


def apply_rotary(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cache: torch.Tensor,  # [P, D] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's rotate_half convention: pairs (i, i + D/2) rotate together (the torch reference)."""
    half = cache.shape[-1] // 2
    cs = cache.index_select(0, positions)  # [T, D]
    cos = torch.cat([cs[:, :half], cs[:, :half]], dim=-1).unsqueeze(1)  # [T, 1, D]
    sin = torch.cat([cs[:, half:], cs[:, half:]], dim=-1).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    return rotate(query), rotate(key)
