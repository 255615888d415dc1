"""Tiny random checkpoints of every served family, written by HF transformers' own config and model
classes (``save_pretrained``), with weights scaled so that greedy decoding is decisive.

HF's default init (std 0.02) gives nearly flat logits, so a token-exact comparison would hit near-ties.
Here every linear weight has std 1 / sqrt(in features) (unit-scale activations), the embedding std 1,
norms 1 plus a little noise (for Gemma's 1 + w form: the noise alone), the router std 3 / sqrt(hidden)
(experts chosen by clear margins) and the LM head std 6 / sqrt(hidden) (logits of std ~6).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# The shape every tiny family shares: 4 layers, GQA 4/2, head 16, vocab 512.
_BASE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=1024,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

WINDOW = 24  # the sliding window of the windowed families' tiny checkpoints (prompts go past it)


def _config(family: str, **overrides: Any) -> Any:
    import transformers as T

    base = dict(_BASE)
    if family == "llama3":
        base.update(
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls: Any = T.LlamaConfig
    elif family == "mistral":
        base.update(sliding_window=WINDOW)
        cls = T.MistralConfig
    elif family == "qwen2":
        base.update(tie_word_embeddings=True)
        cls = T.Qwen2Config
    elif family == "qwen3":
        base.update(head_dim=16)
        cls = T.Qwen3Config
    elif family == "qwen3_moe":
        base.update(
            head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True
        )
        cls = T.Qwen3MoeConfig
    elif family == "mixtral":
        base.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)
        cls = T.MixtralConfig
    elif family == "gemma2":
        base.update(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16)
        cls = T.Gemma2Config
    elif family == "gemma3":
        base.update(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16)
        base["layer_types"] = ["sliding_attention", "full_attention"] * 2
        cls = T.Gemma3TextConfig
    elif family == "phi3":
        base.update(
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(6)],
                "long_factor": [2.0 + 0.5 * i for i in range(6)],
                # Past it HF re-rotates a whole long prompt with the long factors, the engine only the
                # positions past it (engine/layers/rope_scaling.py): prompts here stay within it.
                "original_max_position_embeddings": 128,
            },
            partial_rotary_factor=0.75,
            original_max_position_embeddings=128,
        )
        cls = T.Phi3Config
    elif family == "olmo2":
        cls = T.Olmo2Config
    elif family == "granite":
        base.update(
            embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=1.5
        )
        cls = T.GraniteConfig
    elif family == "smollm3":
        base.update(tie_word_embeddings=True, no_rope_layer_interval=2)
        cls = T.SmolLM3Config
    else:
        raise ValueError(family)
    base.update(overrides)
    return cls(**base)


FAMILIES = (
    "llama3",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
    "granite",
    "smollm3",
)


def write_hf_checkpoint(directory: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    from transformers import AutoModelForCausalLM

    config = _config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gemma = family.startswith("gemma")
    hidden = config.hidden_size
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                noise = torch.randn_like(param) * 0.1
                param.copy_(noise if gemma else 1.0 + noise)
            elif "embed_tokens" in name:
                param.normal_(0.0, 1.0)
            elif name.startswith("lm_head"):
                param.normal_(0.0, 6.0 / hidden**0.5)
            elif name.endswith("gate.weight") and param.shape[0] != param.shape[1] and "proj" not in name:
                param.normal_(0.0, 3.0 / hidden**0.5)  # a MoE router [E, hidden]
            elif param.dim() >= 2:  # [out, in], or stacked experts [E, out, in]
                param.normal_(0.0, 1.0 / param.shape[-1] ** 0.5)
            else:
                param.normal_(0.0, 0.1)  # biases
    model.save_pretrained(directory)
    return directory
