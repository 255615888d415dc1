"""Granite 3.x: Llama's decoder with four multipliers: embeddings (embedding_multiplier), each
sublayer's output before its residual add (residual_multiplier), the attention scale
(attention_multiplier, instead of 1 / sqrt(head_dim)) and the logits (divided by logits_scaling).

Refuses: mlp_bias, activations other than SiLU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.models.family import Family, llama_like


def _granite(raw: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
    fields = llama_like(raw, "Granite")
    fields.update(
        embedding_scale=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        attention_scale=float(raw.get("attention_multiplier", 1.0)),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
    )
    return fields


GRANITE = Family("granite", ("GraniteForCausalLM",), _granite)
