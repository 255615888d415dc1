"""Top-k routing and the experts against HF's own MoE blocks (Mixtral, Qwen3-MoE), built from tiny
configs with random weights: the same weights and ids bit for bit, the same block output to 1e-5."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from engine.kernels import moe

# float32 throughout: HF adds each expert's contribution in expert order, the paths in their own order.
F32_TOL: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5}
NUM_TOKENS = 11


def _randomize(block: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)


def _mixtral_block(seed: int = 0) -> MixtralSparseMoeBlock:
    config = MixtralConfig(hidden_size=64, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    config._experts_implementation = "eager"  # HF's per-expert loop, the definition
    block = MixtralSparseMoeBlock(config).eval()
    _randomize(block, seed)
    return block


def _qwen3_moe_block(norm_topk_prob: bool, seed: int = 0) -> Qwen3MoeSparseMoeBlock:
    config = Qwen3MoeConfig(
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
    )
    config._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(config).eval()
    _randomize(block, seed)
    return block


def _hidden(seed: int = 1) -> torch.Tensor:
    return torch.randn(NUM_TOKENS, 64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_topk_is_mixtrals_router(dtype):
    block = _mixtral_block().to(dtype)
    hidden = _hidden().to(dtype)
    with torch.no_grad():
        hf_logits, hf_weights, hf_ids = block.gate(hidden)
        weights, ids = moe.route_topk(F.linear(hidden, block.gate.weight), 2, renormalize=True)
    assert torch.equal(hf_logits, F.linear(hidden, block.gate.weight))
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights)  # Mixtral keeps float32 weights in every dtype


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_topk_is_qwen3_moes_router(norm_topk_prob, dtype):
    block = _qwen3_moe_block(norm_topk_prob).to(dtype)
    hidden = _hidden().to(dtype)
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(hidden)
        weights, ids = moe.route_topk(
            F.linear(hidden, block.gate.weight), 2, renormalize=norm_topk_prob, weights_dtype=dtype
        )
    assert torch.equal(ids, hf_ids)
    # Qwen3-MoE's router rounds the weights to the model dtype; weights_dtype does the same.
    assert hf_weights.dtype == dtype and torch.equal(weights, hf_weights.float())
    if not norm_topk_prob:
        assert bool((weights.sum(-1) < 1).all())  # the k probabilities as they are, not renormalised


@pytest.mark.parametrize("impl", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen3_moe_unnormalized"])
def test_fused_moe_equals_hf_block(device, family, impl):
    if family == "mixtral":
        block: Any = _mixtral_block(seed=2)
        renormalize = True
    else:
        renormalize = family == "qwen3_moe"
        block = _qwen3_moe_block(norm_topk_prob=renormalize, seed=2)
    hidden = _hidden(seed=3)
    with torch.no_grad():
        want = block(hidden[None])[0]  # HF's block takes [batch, seq, H]
        weights, ids = moe.route_topk(F.linear(hidden, block.gate.weight), 2, renormalize=renormalize)
        experts = block.experts
        got = moe.fused_moe(
            hidden.to(device),
            experts.gate_up_proj.to(device),
            experts.down_proj.to(device),
            weights.to(device),
            ids.to(device),
            impl=impl,
        )
    torch.testing.assert_close(got.cpu(), want, **F32_TOL)


def test_route_topk_refuses_what_it_does_not_do():
    logits = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="unsupported MoE scoring"):
        moe.route_topk(logits, 2, renormalize=True, scoring="sigmoid")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"top-k must be in \[1, 4\]"):
        moe.route_topk(logits, 5, renormalize=True)
