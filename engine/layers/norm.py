"""RMSNorm, with the residual add fused in (``add``), as HF's Llama and Gemma compute it.

HF's Llama normalises in float32, casts back, then scales; Gemma scales by ``1 + w`` in float32 before
the cast. ``offset=1.0`` folds the 1 into the weight once at load (in float32, then the model's
dtype): float32 models are bit-identical to HF's Gemma, bf16 ones round the scale once more.
"""

from __future__ import annotations

import torch

from engine.layers.kernels import CustomOp, Kernels


class RMSNorm(CustomOp):
    def __init__(self, weight: torch.Tensor, eps: float, kernels: Kernels, offset: float = 0.0) -> None:
        super().__init__(kernels)
        self.weight = (weight.float() + offset).to(weight.dtype) if offset else weight
        self.eps = eps

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.stride(-1) != 1:  # q/k norms over heads: [T, H, D] views
            return self.forward_native(x)
        out = torch.empty_like(x)
        torch.ops.inflight_cpu.rms_norm(out, x, None, self.weight, self.eps)
        return out

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward_native(x)
        from engine.kernels import rms_norm

        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual). On the C++ path in place: x becomes the norm and
        residual the sum (both are the step's temporaries)."""
        if self.kernels.cpu:
            torch.ops.inflight_cpu.rms_norm(x, x, residual, self.weight, self.eps)
            return x, residual
        if self.kernels.triton:
            from engine.kernels import fused_add_rms_norm

            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self.forward_native(residual), residual
