"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's decoder with q/k/v and gate/up fused in the checkpoint, LongRoPE
(short factors within the original context, long ones past it) and partial rotary.

Reads: rope_parameters / rope_scaling (default, longrope, ...), original_max_position_embeddings,
partial_rotary_factor, sliding_window (every layer), tie_word_embeddings.
Refuses: activations other than SiLU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.models.family import Family, llama_like


def _phi3(raw: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
    fields = llama_like(raw, "Phi-3", default_sliding=True)
    scaling = fields["rope_scaling"]
    if scaling is not None and "original_max_position_embeddings" not in scaling:
        fields["rope_scaling"] = {
            **scaling,
            "original_max_position_embeddings": raw["original_max_position_embeddings"],
        }
    return fields


def _fused(name: str, raw: Mapping[str, Any]) -> list[tuple[str, int]] | None:
    heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    kv = int(raw.get("num_key_value_heads") or heads) * head_dim
    inter = int(raw["intermediate_size"])
    if name.endswith("self_attn.qkv_proj.weight"):
        base = name[: -len("qkv_proj.weight")]
        return [
            (base + "q_proj.weight", heads * head_dim),
            (base + "k_proj.weight", kv),
            (base + "v_proj.weight", kv),
        ]
    if name.endswith("mlp.gate_up_proj.weight"):
        base = name[: -len("gate_up_proj.weight")]
        return [(base + "gate_proj.weight", inter), (base + "up_proj.weight", inter)]
    return None


PHI3 = Family("phi3", ("Phi3ForCausalLM",), _phi3, fused=_fused)
