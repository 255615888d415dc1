"""Qwen3 and Qwen3-MoE: Qwen2's decoder with an RMSNorm over each q and k head before rotary, no
q/k/v biases; the MoE variant routes each token to ``num_experts_per_tok`` of ``num_experts``
experts (softmax, top-k, renormalised when ``norm_topk_prob``).

Reads: head_dim, rope_parameters, attention_bias, layer_types / sliding_window, tie_word_embeddings;
MoE: num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step,
mlp_only_layers. Refuses: shared experts, mlp_bias, activations other than SiLU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.models.family import Family, UnsupportedConfig, llama_like


def _qwen3(raw: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
    fields = llama_like(raw, "Qwen3")
    fields["qk_norm"] = "head"
    if not raw.get("use_sliding_window"):
        fields["layer_windows"] = ()
    return fields


def _qwen3_moe(raw: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
    fields = _qwen3(raw, common)
    if raw.get("shared_expert_intermediate_size"):
        raise UnsupportedConfig("Qwen3-MoE: shared experts are not supported")
    num_layers = int(raw["num_hidden_layers"])
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    fields.update(
        num_experts=experts,
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        moe_weights_in_model_dtype=True,
        # As HF: a layer is sparse unless listed dense, and only every `step`-th one (counting from 1).
        moe_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers)),
    )
    return fields


QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), _qwen3)
QWEN3_MOE = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), _qwen3_moe)
