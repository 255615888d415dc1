"""The model's Triton path (strided rotary in place, no copies before the KV store, no zero-fill of
the attention output) against its torch path, on a small random Llama, on the GPU or under the
interpreter: the model, its caches and the step's inputs all on the ``device`` fixture's device."""

from __future__ import annotations

import torch

from engine.attention.backend import get_attention_backend
from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM, ModelOps
from engine.models.loader import load_weights


def _model(ops: ModelOps, backend: str, device: torch.device) -> LlamaForCausalLM:
    config = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 96,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
        }
    )
    weights = load_weights("", config, torch.float32, device, "dummy", seed=3)
    return LlamaForCausalLM(config, weights, get_attention_backend(backend), ops, 256)


def test_triton_ops_match_torch_path(paged_batch, device) -> None:
    triton_model = _model(ModelOps(use_triton=True), "triton", device)
    torch_model = _model(ModelOps(), "torch", device)
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
