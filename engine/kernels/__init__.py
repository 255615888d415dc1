"""Triton kernels, each paired with a torch reference in ``engine.kernels.reference``.

Launchers are imported lazily: the CPU engine never touches them and may run without triton.
``from engine.kernels import rms_norm`` imports triton on first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.kernels.activation import silu_and_mul
    from engine.kernels.cache import store_kvcache
    from engine.kernels.norm import fused_add_rms_norm, rms_norm
    from engine.kernels.paged_attention import paged_attention
    from engine.kernels.quant_matmul import quant_matmul
    from engine.kernels.rotary import rotary_embedding

_EXPORTS = {
    "store_kvcache": "engine.kernels.cache",
    "paged_attention": "engine.kernels.paged_attention",
    "rms_norm": "engine.kernels.norm",
    "fused_add_rms_norm": "engine.kernels.norm",
    "rotary_embedding": "engine.kernels.rotary",
    "silu_and_mul": "engine.kernels.activation",
    "quant_matmul": "engine.kernels.quant_matmul",
}

__all__ = [
    "fused_add_rms_norm",
    "paged_attention",
    "quant_matmul",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kvcache",
    "triton_available",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def triton_available() -> bool:
    """Whether the Triton launchers can be imported here (the package is installed)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or deliberately blocked install
        return False
