"""The model's Triton path (strided rotary in place, no copies before the KV store, no zero-fill of
the attention output) against its torch path, on a small random Llama, on the GPU or under the
interpreter: the model, its caches and the step's inputs all on the ``device`` fixture's device."""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import get_attention_backend
from engine.config import ModelConfig
from engine.layers.kernels import Kernels
from engine.models.decoder import DecoderModel
from engine.models.loader import load_weights

# Each family's layers on the Triton path: q/k norms per head (Qwen3), sandwich norms with 1 + w,
# GELU-tanh, soft caps and a sliding window on alternate layers (Gemma 2), post norms with q/k norms
# over the projection (OLMo 2), partial rotary (Phi-3), multipliers (Granite).
FAMILIES: dict[str, dict[str, object]] = {
    "llama": {"architectures": ["LlamaForCausalLM"]},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 16},
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"],
        "head_dim": 16,
        "sliding_window": 8,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "olmo2": {"architectures": ["Olmo2ForCausalLM"]},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.5},
    "granite": {
        "architectures": ["GraniteForCausalLM"],
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 1.5,
    },
}


def _model(kernels: Kernels, backend: str, device: torch.device, family: str = "llama") -> DecoderModel:
    config = ModelConfig.from_dict(
        {
            "vocab_size": 96,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            **FAMILIES[family],
        }
    )
    weights = load_weights("", config, torch.float32, device, "dummy", seed=3)
    return DecoderModel(config, weights, get_attention_backend(backend), kernels, 256)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_triton_ops_match_torch_path(paged_batch, device, family: str) -> None:
    triton_model = _model(Kernels(triton=True), "triton", device, family)
    torch_model = _model(Kernels(), "torch", device, family)
    # A mixed step: a decode over 20 cached positions and a 6-token first chunk (the batch's layout
    # only: its random K/V is overwritten for the step's own tokens, the earlier positions stay).
    batch = paged_batch([1, 6], [21, 6], 4, 2, 16, 16)
    meta = batch.metadata()
    positions = torch.tensor([20, 0, 1, 2, 3, 4, 5], device=device)
    input_ids = torch.tensor([5, 1, 9, 17, 33, 2, 70], device=device)
    caches = [batch.kv_cache.clone().nan_to_num_(0.0) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    got = triton_model.forward(input_ids, positions, caches, meta)
    want = torch_model.forward(input_ids, positions, ref_caches, meta)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for c, r in zip(caches, ref_caches, strict=True):  # the stored K/V (rotated keys) agree too
        torch.testing.assert_close(c, r, atol=1e-5, rtol=1e-5)
    hidden = got[[0, 6]]
    torch.testing.assert_close(
        triton_model.compute_logits(hidden), torch_model.compute_logits(hidden), atol=1e-4, rtol=1e-4
    )
