"""Mixtral: Mistral's decoder with a sparse MLP of ``num_local_experts`` SwiGLU experts, two per token
(softmax over every expert, top-k, the k weights renormalised).

Reads: num_local_experts, num_experts_per_tok, rope_parameters, sliding_window (every layer).
Refuses: activations other than SiLU. Its checkpoint names experts w1 (gate), w3 (up), w2 (down).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.models.family import LLAMA_NORMS, Family, llama_like


def _mixtral(raw: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
    fields = llama_like(raw, "Mixtral", default_sliding=True)
    num_layers = int(raw["num_hidden_layers"])
    fields.update(
        num_experts=int(raw["num_local_experts"]),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["intermediate_size"]),
        norm_topk_prob=True,
        moe_layers=(True,) * num_layers,
    )
    return fields


MIXTRAL = Family(
    "mixtral",
    ("MixtralForCausalLM",),
    _mixtral,
    renames=(
        *LLAMA_NORMS,
        (r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
    ),
)
