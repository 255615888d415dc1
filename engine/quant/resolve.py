"""The weight and KV-cache formats an engine's arguments ask for, resolved against the checkpoint and the
device: what EngineConfig keeps, or a ValueError saying why this model, backend or device cannot have
it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.config import EngineArgs


def resolve_kv_cache_dtype(
    name: str, dtype: torch.dtype, head_size: int, backend: str, device: torch.device
) -> torch.dtype:
    """``EngineArgs.kv_cache_dtype`` resolved: the cache's storage dtype, or a ValueError saying why
    this model, backend or device cannot keep it."""
    from engine.kernels import kv_quant

    if name == "auto":
        return dtype
    cache_dtype = kv_quant.KV_CACHE_DTYPES[name]
    if head_size % 4:
        raise ValueError(
            f"kv_cache_dtype={name!r} needs a head size that is a multiple of 4, not {head_size}"
        )
    if cache_dtype == torch.float8_e4m3fn and backend == "triton" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(
                f"kv_cache_dtype='fp8_e4m3' needs a GPU with fp8 conversions (compute capability 8.9+, "
                f"e.g. L4, H100); this one is {capability[0]}.{capability[1]}: use kv_cache_dtype='int8'"
            )
    return cache_dtype


def resolve_quantization(args: EngineArgs) -> str | None:
    """``EngineArgs.quantization`` resolved against the checkpoint: "gguf", "compressed-tensors", "fp8"
    or None (float weights, a quantized checkpoint's dequantised)."""
    from engine.models.gguf import is_gguf

    gguf_file = args.load_format == "auto" and is_gguf(args.model)
    if args.quantization == "gguf" and not gguf_file:
        raise ValueError(f"quantization='gguf' needs a .gguf checkpoint; {args.model!r} is not one")
    if args.quantization == "fp8" and gguf_file:
        raise ValueError(
            "quantization='fp8' quantizes a float checkpoint; a GGUF file is served in its own block "
            "formats (quantization='auto') or as its float copy (quantization='none')"
        )
    if not gguf_file:
        return _hf_quantization(args)
    if args.quantization == "none":
        return None
    if args.tensor_parallel_size > 1:
        raise ValueError(
            "a GGUF's block formats do not split over tensor-parallel ranks here; "
            "use quantization='none' (its float copy) with tensor_parallel_size > 1"
        )
    return "gguf"


def _hf_quantization(args: EngineArgs) -> str | None:
    """An HF checkpoint's ``quantization_config``: compressed-tensors W8A16 kept as int8 (or dequantised
    with ``quantization='none'``), anything else refused by name (engine/quant/compressed_tensors.py)."""
    from engine.quant import compressed_tensors

    cfg = Path(args.model) / "config.json"
    raw = json.loads(cfg.read_text()) if args.load_format == "auto" and cfg.is_file() else {}
    method = compressed_tensors.quantization_method(raw)
    if method is None:
        if args.quantization == "compressed-tensors":
            raise ValueError(
                "quantization='compressed-tensors' needs a compressed-tensors checkpoint; "
                f"{args.model!r} is not one"
            )
        if args.quantization == "fp8":
            _check_tensor_parallel(args, "fp8 weights")
            return "fp8"
        return None
    compressed_tensors.check_supported(raw)
    if args.quantization == "none":
        return None
    if args.quantization == "fp8" and not compressed_tensors.holds_fp8(raw):
        raise ValueError(
            "quantization='fp8' quantizes a float checkpoint; this one is already quantized to int8 "
            "(serve it with quantization='auto', or dequantised with quantization='none')"
        )
    _check_tensor_parallel(args, "8-bit per-channel weights")
    return compressed_tensors.METHOD


def _check_tensor_parallel(args: EngineArgs, what: str) -> None:
    if args.tensor_parallel_size > 1:
        raise ValueError(
            f"{what} do not split over tensor-parallel ranks here (a row-parallel shard would need the "
            "whole row's scale); use quantization='none' (float weights) with tensor_parallel_size > 1"
        )
