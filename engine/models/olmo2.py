"""OLMo 2: post-norm layers (each sublayer's output normed, then added; no input norm) and an RMSNorm
over the whole q and k projections before rotary.

Reads: rope_parameters, attention_bias, tie_word_embeddings. Refuses: activations other than SiLU,
and tensor parallelism (the q/k norms span every head, so a rank's shard cannot norm its heads alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.models.family import Family, llama_like


def _olmo2(raw: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
    fields = llama_like(raw, "OLMo 2")
    fields.update(norm_placement="post", qk_norm="full", layer_windows=())
    return fields


OLMO2 = Family(
    "olmo2",
    ("Olmo2ForCausalLM",),
    _olmo2,
    renames=(
        (r"\.post_attention_layernorm\.", ".attn_out_norm."),
        (r"\.post_feedforward_layernorm\.", ".mlp_out_norm."),
    ),
    tensor_parallel=False,
    tp_refusal="OLMo 2's q/k norms span every head of the projection",
)
