"""A mixture-of-experts MLP: a router picks ``top_k`` experts per token, the chosen experts run grouped.

The router is a replicated linear layer; routing (softmax over every expert, top-k, renormalised
where the family asks: Mixtral always, Qwen3-MoE by ``norm_topk_prob``) and the experts' two GEMMs go
to ``engine.kernels.moe``: one grouped Triton launch per GEMM for all of a layer's experts on a GPU, on
a CPU one GEMM per expert that was chosen, over only its tokens' rows. Tensor parallel, every rank
holds each expert's slice of the intermediate size and the down projection's partial sums are
all-reduced, as a dense MLP's.
"""

from __future__ import annotations

import torch

from engine.distributed.parallel_state import TensorParallel
from engine.kernels.moe import fused_moe, route_topk
from engine.layers.kernels import Kernels
from engine.layers.linear import Linear


class FusedMoE:
    def __init__(
        self,
        router: torch.Tensor,  # [E, hidden]
        w13: torch.Tensor,  # [E, 2 * I, hidden]: gate rows then up rows (this rank's I)
        w2: torch.Tensor,  # [E, hidden, I]
        top_k: int,
        renormalize: bool,
        activation: str,
        kernels: Kernels,
        tp: TensorParallel,
        round_weights: bool = False,  # the chosen weights rounded to the router's dtype (Qwen3-MoE)
    ) -> None:
        self.router = Linear(router, kernels)
        self.w13 = w13
        self.w2 = w2
        self.top_k = top_k
        self.renormalize = renormalize
        # engine/kernels/moe.py's names for the gated activations.
        self.activation = {"gelu_pytorch_tanh": "gelu_tanh"}.get(activation, activation)
        self.tp = tp
        self.round_weights = round_weights

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        logits = self.router(x)  # [T, E]
        rounding = logits.dtype if self.round_weights else None
        weights, ids = route_topk(logits, self.top_k, self.renormalize, weights_dtype=rounding)
        out = fused_moe(x, self.w13, self.w2, weights, ids, activation=self.activation)
        return self.tp.all_reduce(out)
