"""Rotary position embeddings, including Llama 3's frequency-dependent scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    raise ValueError(f"unsupported rope scaling {kind!r}")


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


def cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """[max_positions, head_dim]: cos in the first half of each row, sin in the second (float32)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cache: torch.Tensor,  # [P, D] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's rotate_half convention: pairs (i, i + D/2) rotate together."""
    half = cache.shape[-1] // 2
    cs = cache.index_select(0, positions)  # [T, D]
    cos = torch.cat([cs[:, :half], cs[:, :half]], dim=-1).unsqueeze(1)  # [T, 1, D]
    sin = torch.cat([cs[:, half:], cs[:, half:]], dim=-1).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    return rotate(query), rotate(key)
