"""SmolLM3: Llama's decoder where every ``no_rope_layer_interval``-th layer has no rotary at all
(``no_rope_layers``: 1 = rotary, 0 = none).

Reads: no_rope_layers, rope_parameters, use_sliding_window with layer_types, tie_word_embeddings.
Refuses: mlp_bias, activations other than SiLU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.models.family import Family, UnsupportedConfig, llama_like


def _smollm3(raw: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
    fields = llama_like(raw, "SmolLM3")
    if not raw.get("use_sliding_window"):
        fields["layer_windows"] = ()
    num_layers = int(raw["num_hidden_layers"])
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = int(raw.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) != num_layers:
        raise UnsupportedConfig(f"SmolLM3: no_rope_layers has {len(flags)} entries for {num_layers} layers")
    rope = (fields["rope_theta"], fields["rope_scaling"])
    fields["layer_rope"] = tuple(rope if flag else None for flag in flags)
    return fields


SMOLLM3 = Family("smollm3", ("SmolLM3ForCausalLM",), _smollm3)
