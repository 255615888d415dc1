"""Llama 2 / 3.x, Mistral and Qwen2 / 2.5: the pre-norm decoder with SwiGLU, GQA and rotary.

Reads: rope_theta / rope_scaling (default, linear, llama3, dynamic, yarn, longrope), partial rotary,
attention_bias (Llama: q/k/v/o biases; Qwen2 always biases q/k/v), tie_word_embeddings, sliding_window
(Mistral: every layer; Qwen2: with use_sliding_window, the layers from max_window_layers on).
Refuses: mlp_bias, activations other than SiLU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.models.family import Family, UnsupportedConfig, llama_like


def _llama(raw: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
    return llama_like(raw, "Llama")


def _mistral(raw: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
    return llama_like(raw, "Mistral", default_sliding=True)


def _qwen2(raw: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
    fields = llama_like(raw, "Qwen2")
    fields["attention_bias"] = True
    if raw.get("use_sliding_window") and raw.get("sliding_window") and "layer_types" not in raw:
        first = 28 if raw.get("max_window_layers") is None else int(raw["max_window_layers"])  # HF's default
        window = int(raw["sliding_window"])
        fields["layer_windows"] = tuple(
            window if i >= first else None for i in range(int(raw["num_hidden_layers"]))
        )
    elif not raw.get("use_sliding_window"):
        fields["layer_windows"] = ()
    if raw.get("use_mrope"):
        raise UnsupportedConfig("Qwen2: use_mrope (multimodal rotary) is not supported")
    return fields


LLAMA = Family("llama", ("LlamaForCausalLM",), _llama)
MISTRAL = Family("mistral", ("MistralForCausalLM",), _mistral)
QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), _qwen2)
