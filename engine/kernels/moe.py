"""Mixture of experts: top-k routing and the expert computation, with its kernel chosen per device.

``route_topk`` turns router logits into each token's k experts and weights, as HF's Mixtral and
Qwen3-MoE routers do; ``fused_moe`` runs the chosen experts: the grouped Triton kernels on a GPU
(``engine.kernels.fused_moe``), the grouped torch path on a CPU (``engine.kernels.moe_cpu``), or the
per-token loop that defines them (``engine.kernels.moe_reference``) when asked for.
"""

from __future__ import annotations

import importlib
from typing import Literal

import torch

MoEImpl = Literal["auto", "triton", "cpu", "reference"]

_MODULES = {
    "triton": "engine.kernels.fused_moe",
    "cpu": "engine.kernels.moe_cpu",
    "reference": "engine.kernels.moe_reference",
}


def route_topk(
    router_logits: torch.Tensor,  # [T, E], the router's output in the model dtype
    k: int,
    renormalize: bool,
    scoring: Literal["softmax"] = "softmax",
    weights_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] float32, ids [T, k] int64
    """Each token's k experts by softmax probability, highest first, and their weights.

    The softmax is over all E experts in float32; ``renormalize`` divides the k chosen probabilities by
    their sum (Mixtral always; Qwen3-MoE when its config's ``norm_topk_prob`` is set). These are the
    torch ops of HF's routers, so weights and ids are bit-identical to theirs. ``weights_dtype`` rounds
    the weights through that dtype and back: Qwen3-MoE's HF router casts them to the model dtype,
    Mixtral's keeps float32.
    """
    if scoring != "softmax":
        raise ValueError(f"unsupported MoE scoring function {scoring!r}; supported: 'softmax'")
    num_experts = router_logits.shape[-1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"top-k must be in [1, {num_experts}], got {k}")
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)  # [T, k] each
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    if weights_dtype is not None:
        weights = weights.to(weights_dtype).float()
    return weights, ids


def default_impl(device: torch.device) -> Literal["triton", "cpu"]:
    """The Triton kernels on a GPU, the grouped torch path on a CPU."""
    return "triton" if device.type == "cuda" else "cpu"


def fused_moe(
    hidden: torch.Tensor,  # [T, H] float32 / bfloat16 / float16
    w13: torch.Tensor,  # [E, 2I, H]: per expert, the gate rows then the up rows
    w2: torch.Tensor,  # [E, H, I]: per expert, the down projection
    topk_weights: torch.Tensor,  # [T, k] float32, from route_topk
    topk_ids: torch.Tensor,  # [T, k] int32/int64, in [0, E), or -1: an expert another rank holds
    activation: str = "silu",  # "silu": SiLU(gate) * up; "gelu_tanh": GELU-tanh(gate) * up
    impl: MoEImpl = "auto",  # "auto": default_impl(hidden.device); the others force one path (tests)
) -> torch.Tensor:  # [T, H], hidden's dtype
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]) for every token t.

    An expert is down(act(gate(x)) * up(x)) with gate and up the two halves of ``w13[e]``. The grouped
    paths touch only the experts some token chose. A pair whose id is -1 contributes nothing: under
    expert parallelism each rank passes its own experts' weights and ids (shifted to its first expert,
    -1 for the others), and the ranks' outputs sum to the layer's. Under tensor parallelism each rank
    passes its slice of the intermediate size, ``w13[e]`` as [gate slice; up slice], and the outputs
    sum likewise.
    """
    chosen = default_impl(hidden.device) if impl == "auto" else impl
    if chosen not in _MODULES:
        raise ValueError(
            f"unknown MoE implementation {impl!r}; one of 'auto', {', '.join(map(repr, _MODULES))}"
        )
    module = importlib.import_module(_MODULES[chosen])  # lazy: the CPU engine may run without triton
    out: torch.Tensor = module.fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation)
    return out
