"""What a model family is: the HF config fields it reads, and how its checkpoint's tensor names map
onto the engine's (engine/models/decoder.py composes every family from the same layers).

Canonical tensor names, per layer ``model.layers.{i}.``: ``input_norm``, ``attn_out_norm``,
``mlp_norm``, ``mlp_out_norm`` (the norms by where they sit: engine/models/decoder.py),
``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``, ``mlp.{gate,up,down}_proj`` (dense),
``mlp.gate`` (the router) and ``mlp.experts.{e}.{gate,up,down}_proj`` (mixture of experts). The
loader merges q/k/v and gate/up, and stacks the experts (engine/models/loader.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.layers.activation import SUPPORTED_ACTIVATIONS
from engine.layers.rope_scaling import SUPPORTED_ROPE_TYPES, rope_type

Parse = Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]

# HF's Llama names for the two norms of a pre-norm layer.
LLAMA_NORMS = (
    (r"\.input_layernorm\.", ".input_norm."),
    (r"\.post_attention_layernorm\.", ".mlp_norm."),
)


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    parse: Parse  # (raw config.json, the fields every family shares) -> this family's ModelConfig fields
    renames: tuple[tuple[str, str], ...] = LLAMA_NORMS  # (regex, replacement) on checkpoint names
    # Checkpoint tensors that hold several of the engine's (Phi-3's qkv_proj, gate_up_proj): name ->
    # the parts' names and their sizes along dim 0, from the config's fields.
    fused: Callable[[str, Mapping[str, Any]], list[tuple[str, int]] | None] | None = None
    tensor_parallel: bool = True  # False: refused with tensor_parallel_size > 1 (and why)
    tp_refusal: str = ""
    _compiled: list[tuple[re.Pattern[str], str]] = field(default_factory=list, compare=False, repr=False)

    def canonical(self, name: str) -> str:
        if not self._compiled:
            self._compiled.extend((re.compile(a), b) for a, b in self.renames)
        for pattern, replacement in self._compiled:
            name = pattern.sub(replacement, name)
        return name


class UnsupportedConfig(ValueError):
    """A config field whose value this engine does not implement for the family."""


def refuse_unless(
    raw: Mapping[str, Any], family: str, key: str, allowed: tuple[Any, ...], default: Any = None
) -> Any:
    value = raw.get(key, default)
    if value not in allowed:
        raise UnsupportedConfig(
            f"{family}: config field {key}={value!r} is not supported (inflight serves {list(allowed)!r})"
        )
    return value


def activation_of(raw: Mapping[str, Any], family: str, default: str = "silu") -> str:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or default
    if act == "gelu_tanh":
        act = "gelu_pytorch_tanh"
    if act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedConfig(
            f"{family}: activation {act!r} is not supported ({', '.join(SUPPORTED_ACTIVATIONS)})"
        )
    return str(act)


def rope_parameters(raw: Mapping[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """One dict of rotary settings, whichever way the config spells them (transformers 5's
    ``rope_parameters``, optionally per layer type, or the older ``rope_theta`` + ``rope_scaling``)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    merged: dict[str, Any] = {}
    if isinstance(params, dict) and ("rope_theta" in params or "rope_type" in params):
        merged.update(params)
    else:
        scaling = raw.get("rope_scaling")
        if isinstance(scaling, dict):
            merged.update(scaling)
        if raw.get("rope_theta") is not None:
            merged["rope_theta"] = raw["rope_theta"]
    return merged


def rope_of(
    raw: Mapping[str, Any], family: str, layer_type: str | None = None, default_theta: float = 10000.0
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) checked against the variants engine/layers serves."""
    params = rope_parameters(raw, layer_type)
    theta = float(params.get("rope_theta", raw.get("rope_theta") or default_theta))
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind = rope_type(scaling or None)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedConfig(
            f"{family}: rope scaling {kind!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return theta, (scaling if kind != "default" else None)


def partial_rotary(raw: Mapping[str, Any]) -> float:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    return float(raw.get("partial_rotary_factor") or 1.0)


def layer_windows(
    raw: Mapping[str, Any], num_layers: int, default_sliding: bool = False
) -> tuple[int | None, ...]:
    """Per layer, the sliding window or None, from ``layer_types`` (transformers >= 4.56 writes it)
    or, without it, every layer windowed when ``default_sliding`` and a window is set."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if window is None:
        return ()
    if isinstance(types, list) and len(types) == num_layers:
        for t in types:
            if t not in ("sliding_attention", "full_attention"):
                raise UnsupportedConfig(
                    f"layer type {t!r} is not supported (sliding_attention, full_attention)"
                )
        windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
        return windows if any(w is not None for w in windows) else ()
    return tuple(int(window) for _ in range(num_layers)) if default_sliding else ()


def llama_like(raw: Mapping[str, Any], family: str, default_sliding: bool = False) -> dict[str, Any]:
    """The fields every Llama-shaped family reads the same way."""
    refuse_unless(raw, family, "mlp_bias", (False, None), False)
    theta, scaling = rope_of(raw, family)
    num_layers = int(raw["num_hidden_layers"])
    return dict(
        hidden_act=activation_of(raw, family),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial_rotary(raw),
        layer_windows=layer_windows(raw, num_layers, default_sliding),
    )
