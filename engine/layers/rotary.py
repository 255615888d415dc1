"""Rotary position embeddings applied in place to the q and k heads of the fused QKV rows.

``rotary_dim`` < head size is partial rotary: only each head's first ``rotary_dim`` dims turn (HF's
``partial_rotary_factor``); the C++ and Triton kernels take those strided views as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.layers.kernels import CustomOp, Kernels
from engine.layers.rope_scaling import apply_rotary, cos_sin_cache


class RotaryEmbedding(CustomOp):
    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        max_position_embeddings: int,
        kernels: Kernels,
        device: torch.device,
    ) -> None:
        super().__init__(kernels)
        self.rotary_dim = rotary_dim
        # [max_positions, rotary_dim] float32: cos in the first half of a row, sin in the second.
        self.cache = cos_sin_cache(rotary_dim, max_positions, theta, scaling, max_position_embeddings).to(
            device
        )

    def forward_native(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, Hq, D] (a view of the QKV rows)
        k: torch.Tensor,  # [T, Hkv, D]
    ) -> None:
        q_rot, k_rot = q[..., : self.rotary_dim], k[..., : self.rotary_dim]
        q_new, k_new = apply_rotary(positions, q_rot, k_rot, self.cache)
        q_rot.copy_(q_new)
        k_rot.copy_(k_new)

    def forward_cpu(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        # In place, on the strided views of the fused qkv projection: no copies.
        torch.ops.inflight_cpu.rotary(
            q[..., : self.rotary_dim], k[..., : self.rotary_dim], positions, self.cache
        )

    def forward_cuda(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        from engine.kernels import rotary_embedding

        rotary_embedding(
            positions, q[..., : self.rotary_dim], k[..., : self.rotary_dim], self.cache, inplace=True
        )
