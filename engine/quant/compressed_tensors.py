"""HF checkpoints quantized by compressed-tensors (llm-compressor's format): 8-bit symmetric weights with
per-channel (or per-tensor) scales, int (W8A16) or fp8 e4m3 (W8A16-FP8, and the weights of FP8 /
FP8_DYNAMIC), read as :class:`ChannelWeight`; every other scheme refused by name.

What a W8A16 checkpoint holds. ``config.json``'s ``quantization_config``::

    {"quant_method": "compressed-tensors", "format": "pack-quantized",   # or int-/naive-quantized
     "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
         "weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel", ...}}},
     "ignore": ["lm_head"], ...}

and, for each quantized linear ``X`` (the layers in ``ignore`` stay float, under ``X.weight``):
  * ``int-quantized`` / ``naive-quantized``: ``X.weight`` int8 [out, in];
  * ``pack-quantized``: ``X.weight_packed`` int32 [out, ceil(in / 4)], four values a word, value
    ``4j + i`` in bits ``8i .. 8i + 7`` of word ``j``, stored plus 128 (unsigned); ``X.weight_shape``
    [out, in];
  * both: ``X.weight_scale`` [out, 1] (the checkpoint's float dtype), and optionally
    ``X.weight_zero_point`` [out, 1], all zeros (the scheme is symmetric).
The weight is ``scale * q``, one scale per output channel.

An fp8 checkpoint (``"format": "float-quantized"`` or ``naive-quantized``, weights ``"type": "float"``)
stores ``X.weight`` as float8_e4m3fn [out, in] and ``X.weight_scale`` [out, 1] (channel strategy) or
one value (tensor strategy: every row's scale the same, kept per row). Its schemes may also quantize
activations to fp8 (FP8: a static ``X.input_scale``; FP8_DYNAMIC: per token at run time); those are
served weight-only, activations in the model's dtype, as vLLM serves them on GPUs without fp8 units:
the same weights, activations one rounding finer than the checkpoint's authors measured.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from engine.quant.channel import CODES, ChannelWeight

METHOD = "compressed-tensors"
# Formats whose 8-bit weights this module reads; "pack-quantized" packs int8 into int32 words.
_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
_SUFFIXES = (
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "weight_g_idx",
    "input_scale",
    "input_zero_point",
)


def _scheme_name(group: Mapping[str, Any]) -> str:
    """A config group's scheme in the words people use: W8A16, W4A16 (group 128), W8A8-FP8, ..."""
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    kind = "FP" if weights.get("type") == "float" else ""
    name = f"W{weights.get('num_bits', '?')}A{acts.get('num_bits', '?') if acts else 16}"
    if kind or (acts and acts.get("type") == "float"):
        name += "-FP8" if weights.get("num_bits") == 8 else "-FP"
    details = [f"{weights.get('strategy', '?')} strategy"]
    if weights.get("strategy") == "group":
        details.append(f"group {weights.get('group_size')}")
    if weights.get("symmetric") is False:
        details.append("asymmetric")
    if acts and acts.get("dynamic"):
        details.append("dynamic activations")
    return f"{name} ({', '.join(details)})"


def quantization_method(raw_config: Mapping[str, Any]) -> str | None:
    """The checkpoint's ``quantization_config.quant_method``, or None for a float checkpoint."""
    qc = raw_config.get("quantization_config")
    if not qc:
        return None
    return str(qc.get("quant_method", "unknown"))


def check_supported(raw_config: Mapping[str, Any]) -> list[str]:
    """Raises ValueError, naming what the checkpoint holds, unless it is compressed-tensors with 8-bit
    symmetric weights (int with per-channel scales, or fp8 with per-channel or per-tensor scales) in a
    format read here. Returns the schemes whose fp8 activations are served in the model's dtype."""
    qc = raw_config.get("quantization_config") or {}
    method = qc.get("quant_method")
    served = (
        "inflight serves compressed-tensors W8A16 (int8 weights, per-channel scales), fp8 weights "
        "(W8A16-FP8, FP8, FP8_DYNAMIC: per-channel or per-tensor scales) and GGUF files"
    )
    if method != METHOD:
        raise ValueError(f"quantization method {method!r} is not served; {served}")
    fmt = qc.get("format")
    if fmt not in _FORMATS:
        raise ValueError(
            f"compressed-tensors format {fmt!r} is not served (only {', '.join(_FORMATS)}); {served}"
        )
    if qc.get("kv_cache_scheme"):
        raise ValueError(f"a compressed-tensors kv_cache_scheme is not served; {served}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError(f"compressed-tensors config has no config_groups; {served}")
    weight_only: list[str] = []
    for group_name, group in groups.items():
        w = group.get("weights") or {}
        acts = group.get("input_activations")
        fp8 = w.get("type") == "float"
        ok = (
            w.get("num_bits") == 8
            and w.get("symmetric", True) is True
            and not w.get("dynamic", False)
            and not group.get("output_activations")
            and (
                (fp8 and w.get("strategy") in ("channel", "tensor"))
                or (w.get("type", "int") == "int" and w.get("strategy") == "channel")
            )
            and (not acts or (fp8 and acts.get("type") == "float" and acts.get("num_bits") == 8))
        )
        if not ok:
            raise ValueError(
                f"compressed-tensors scheme {_scheme_name(group)} in {group_name} is not served; {served}"
            )
        if acts:
            weight_only.append(_scheme_name(group))
    return weight_only


def holds_fp8(raw_config: Mapping[str, Any]) -> bool:
    """Whether the checkpoint's weights are fp8 (``"type": "float"``) rather than int8."""
    groups = (raw_config.get("quantization_config") or {}).get("config_groups") or {}
    return any((g.get("weights") or {}).get("type") == "float" for g in groups.values())


def _unpack_int8(packed: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """``weight_packed`` int32 [out, words] -> int8 [out, in] (the layout in the module's notes)."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"weight_packed must be int32 [out, words], got {packed.dtype} {list(packed.shape)}")
    out_features, in_features = (int(v) for v in shape.tolist())
    shifts = torch.arange(0, 32, 8, dtype=torch.int32)
    values = (packed[:, :, None] >> shifts) & 0xFF  # [out, words, 4]: word j's value 4j + i at i
    values = values.reshape(packed.shape[0], -1)[:, :in_features] - 128
    if values.shape[0] != out_features:
        raise ValueError(f"weight_shape {[out_features, in_features]} disagrees with weight_packed's rows")
    return values.to(torch.int8).contiguous()


def combine(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | ChannelWeight]:
    """A checkpoint's tensors by stored name -> each quantized linear as one ``ChannelWeight`` under
    ``X.weight`` (its activation scales dropped: activations stay in the model's dtype); every other
    tensor as it was."""
    out: dict[str, torch.Tensor | ChannelWeight] = {}
    bases = {name[: -len(".weight_scale")] for name in tensors if name.endswith(".weight_scale")}
    for name, tensor in tensors.items():
        base, _, suffix = name.rpartition(".")
        if base in bases and (suffix in _SUFFIXES or suffix == "weight"):
            continue
        out[name] = tensor
    for base in sorted(bases):
        if f"{base}.weight_g_idx" in tensors:
            raise ValueError(f"{base}: activation-ordered weights (weight_g_idx) are not served")
        zero = tensors.get(f"{base}.weight_zero_point")
        if zero is not None and bool(zero.ne(0).any()):
            raise ValueError(f"{base}: a non-zero weight_zero_point (asymmetric weights) is not served")
        packed = tensors.get(f"{base}.weight_packed")
        if packed is not None:
            q = _unpack_int8(packed, tensors[f"{base}.weight_shape"])
        elif (stored := tensors.get(f"{base}.weight")) is not None and stored.dtype in CODES:
            q = stored.contiguous()
        else:
            raise ValueError(f"{base}: a weight_scale without int8 or fp8 weights (weight or weight_packed)")
        scale = tensors[f"{base}.weight_scale"].float()
        if scale.numel() == 1 and q.dtype == torch.float8_e4m3fn:  # tensor strategy: one scale, every row
            scale = scale.reshape(1).expand(q.shape[0])
        if scale.numel() != q.shape[0]:
            raise ValueError(
                f"{base}: {scale.numel()} scales for {q.shape[0]} output channels "
                "(per-channel scales, or one per tensor for fp8, are served)"
            )
        out[f"{base}.weight"] = ChannelWeight(q, scale.reshape(-1).contiguous())
    return out
