"""Mixture of experts on the CPU, grouped: the work grows with tokens x top-k, not with the expert count.

The T * k (token, expert) pairs are sorted by expert, so each expert's rows form one contiguous run;
each expert that received a row runs its two projections once, over its rows only, and the weighted
results are added back to their tokens. An expert no token chose is never read.

Worked example, T = 3 tokens, k = 2, E = 8::

    topk_ids   = [[5, 1], [1, 7], [5, 1]]     pair p = t * k + j
    flat ids   = [5, 1, 1, 7, 5, 1]           pairs 0..5
    order      = [1, 2, 5, 0, 4, 3]           pairs sorted by expert (stable: token order within one)
    tokens     = order // k = [0, 1, 2, 0, 2, 1]
    sorted ids = [1, 1, 1, 5, 5, 7]           runs [0, 3) -> expert 1, [3, 5) -> 5, [5, 6) -> 7

Experts 0, 2, 3, 4 and 6 are skipped; three GEMM pairs run, over 3, 2 and 1 rows.
"""

from __future__ import annotations

import torch

from engine.kernels.moe_reference import ACTIVATIONS, check_moe_args


def fused_moe(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int32/int64, in [0, E) or -1 (see moe_reference)
    activation: str = "silu",
) -> torch.Tensor:  # [T, H], hidden's dtype
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]), one GEMM pair per chosen expert."""
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids, activation)
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    if num_tokens == 0:
        return out.to(hidden.dtype)

    # [T * k] each: the pairs' experts in sorted order, and which pair sits at each sorted position.
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    tokens = order // top_k  # [T * k] the token of each sorted pair
    weights = topk_weights.reshape(-1)[order]  # [T * k] float32
    # The runs of equal ids: only experts that received a row appear, so nothing here is O(E).
    experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    assert int(experts[0]) >= -1 and int(experts[-1]) < num_experts, f"expert ids outside [-1, {num_experts})"
    if int(experts[0]) == -1:  # pairs of experts another rank holds sort first: dropped
        skip = int(counts[0])
        experts, counts, tokens, weights = experts[1:], counts[1:], tokens[skip:], weights[skip:]
    rows = hidden.index_select(0, tokens)  # [pairs kept, H], sorted by expert
    act_fn = ACTIVATIONS[activation]
    y = torch.empty(rows.shape, dtype=hidden.dtype, device=hidden.device)  # [pairs kept, H]
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
        end = start + count
        gate_up = torch.nn.functional.linear(rows[start:end], w13[expert])  # [count, 2I]
        act = act_fn(gate_up[:, :inter]) * gate_up[:, inter:]  # [count, I]
        y[start:end] = torch.nn.functional.linear(act, w2[expert])
        start = end
    # Rounded to the model dtype by the projection, then weighted in float32, as HF's experts do.
    out.index_add_(0, tokens, y.float() * weights[:, None])
    return out.to(hidden.dtype)
