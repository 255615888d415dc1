"""Torch reference of the mixture-of-experts block: one token and one chosen expert at a time.

The definition the grouped CPU path and the Triton kernels are tested against; written to be obviously
correct, not fast. Shapes: T = tokens, H = hidden size, I = one expert's intermediate size, E = experts,
k = experts per token. Expert e's weights follow HF's merged layout (``MixtralExperts.gate_up_proj``):
``w13[e]`` is ``[2I, H]`` with the gate rows first, then the up rows; ``w2[e]`` is ``[H, I]``.

Rounding mirrors HF's experts: each projection's output and the activation are in the model dtype, the
routing weight multiplies in float32; the k contributions are summed in float32 and rounded once.

An id of -1 contributes nothing: with expert parallelism a rank holds experts [first, first + E) and
passes ``w13``/``w2`` of those only, the ids shifted by ``first`` and -1 for every other expert; the
ranks' outputs then sum to the whole layer's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def check_moe_args(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
) -> None:
    """The shapes and dtypes every MoE path assumes (a mismatch would otherwise surface as a bad read)."""
    assert hidden.dim() == 2, f"hidden must be [T, H], got {tuple(hidden.shape)}"
    num_tokens, hidden_size = hidden.shape
    assert w13.dim() == 3 and w13.shape[2] == hidden_size and w13.shape[1] % 2 == 0, (
        f"w13 must be [E, 2I, {hidden_size}], got {tuple(w13.shape)}"
    )
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    assert w2.shape == (num_experts, hidden_size, inter), (
        f"w2 must be [{num_experts}, {hidden_size}, {inter}], got {tuple(w2.shape)}"
    )
    assert hidden.dtype == w13.dtype == w2.dtype, (hidden.dtype, w13.dtype, w2.dtype)
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == num_tokens, tuple(topk_ids.shape)
    assert topk_weights.shape == topk_ids.shape, (tuple(topk_weights.shape), tuple(topk_ids.shape))
    assert topk_weights.dtype == torch.float32, f"topk_weights must be float32, got {topk_weights.dtype}"
    assert topk_ids.dtype in (torch.int32, torch.int64), f"topk_ids must be int32/int64, got {topk_ids.dtype}"
    assert activation in ACTIVATIONS, f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}"


def expert_mlp(
    x: torch.Tensor,  # [N, H], rows routed to this expert
    w13: torch.Tensor,  # [2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [H, I]
    activation: str,
) -> torch.Tensor:  # [N, H], x's dtype
    """One expert: down(act(gate(x)) * up(x)), as HF's experts compute it."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(ACTIVATIONS[activation](gate) * up, w2)


def fused_moe(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int32/int64, in [0, E) or -1: not this rank's expert
    activation: str = "silu",
) -> torch.Tensor:  # [T, H], hidden's dtype
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]) for every token t."""
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids, activation)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.tolist()
    for t, row in enumerate(ids):
        for j, expert in enumerate(row):
            if expert < 0:  # an expert another rank holds (expert parallelism)
                continue
            y = expert_mlp(hidden[t : t + 1], w13[expert], w2[expert], activation)  # [1, H]
            out[t] += y[0].float() * topk_weights[t, j]
    return out.to(hidden.dtype)
