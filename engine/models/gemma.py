"""Gemma 2 and Gemma 3 (text): sandwich norms (each sublayer's input and output normed) with Gemma's
``1 + w`` RMSNorm, GELU-tanh MLP, embeddings scaled by sqrt(hidden), local (sliding-window) and global
layers interleaved. Gemma 2 soft-caps attention scores and the final logits; Gemma 3 norms q and k per
head instead, and its local layers rotate with their own base (``rope_local_base_freq``).

Reads: query_pre_attn_scalar (the attention scale), attn_logit_softcapping, final_logit_softcapping,
sliding_window with layer_types (or, in older configs, Gemma 2's alternation / Gemma 3's
sliding_window_pattern), rope_parameters per layer type, hidden_activation.
Refuses: bidirectional attention, activations other than GELU-tanh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from engine.models.family import Family, activation_of, partial_rotary, refuse_unless, rope_of

_NORMS = (
    (r"\.input_layernorm\.", ".input_norm."),
    (r"\.post_attention_layernorm\.", ".attn_out_norm."),
    (r"\.pre_feedforward_layernorm\.", ".mlp_norm."),
    (r"\.post_feedforward_layernorm\.", ".mlp_out_norm."),
)


def _layer_types(raw: Mapping[str, Any], num_layers: int, pattern: int) -> list[str]:
    types = raw.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        return [str(t) for t in types]
    # Older configs: every `pattern`-th layer (counting from 1) is global.
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]


def _common(raw: Mapping[str, Any], family: str, pattern: int) -> tuple[dict[str, Any], list[str]]:
    refuse_unless(raw, family, "use_bidirectional_attention", (None, False), None)
    num_layers = int(raw["num_hidden_layers"])
    types = _layer_types(raw, num_layers, pattern)
    window = raw.get("sliding_window")
    windows = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    scalar = raw.get("query_pre_attn_scalar")
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
    fields = dict(
        hidden_act=activation_of(raw, family, default="gelu_pytorch_tanh"),
        norm_placement="sandwich",
        norm_offset=1.0,
        embedding_scale=math.sqrt(int(raw["hidden_size"])),
        attention_scale=float(scalar if scalar is not None else head_dim) ** -0.5,
        attn_logit_softcap=raw.get("attn_logit_softcapping"),
        final_logit_softcap=raw.get("final_logit_softcapping"),
        layer_windows=windows if any(w is not None for w in windows) else (),
        partial_rotary_factor=partial_rotary(raw),
    )
    return fields, types


def _gemma2(raw: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
    fields, _ = _common(raw, "Gemma 2", pattern=2)
    fields["rope_theta"], fields["rope_scaling"] = rope_of(raw, "Gemma 2")
    return fields


def _gemma3(raw: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
    fields, types = _common(raw, "Gemma 3", pattern=int(raw.get("sliding_window_pattern", 6)))
    fields["qk_norm"] = "head"
    global_rope = rope_of(raw, "Gemma 3", "full_attention", default_theta=1_000_000.0)
    local_rope = rope_of(raw, "Gemma 3", "sliding_attention")
    if "rope_local_base_freq" in raw:  # older configs: the local base beside rope_theta / rope_scaling
        local_rope = (float(raw["rope_local_base_freq"]), None)
    fields["rope_theta"], fields["rope_scaling"] = global_rope
    fields["layer_rope"] = tuple(local_rope if t == "sliding_attention" else global_rope for t in types)
    return fields


GEMMA2 = Family("gemma2", ("Gemma2ForCausalLM",), _gemma2, renames=_NORMS)
GEMMA3 = Family("gemma3", ("Gemma3ForCausalLM",), _gemma3, renames=_NORMS)
