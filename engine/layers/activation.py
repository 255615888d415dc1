"""Gated activations over the merged gate/up projection: ``act(x[:, :I]) * x[:, I:]``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.kernels import CustomOp, Kernels

SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class SiluAndMul(CustomOp):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
        torch.ops.inflight_cpu.silu_and_mul(out, x)
        return out

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        from engine.kernels import silu_and_mul

        return silu_and_mul(x)


class GeluTanhAndMul(CustomOp):
    """Gemma's ``gelu_pytorch_tanh``: torch's own op on every device (one fused pointwise op)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def activation(name: str, kernels: Kernels) -> CustomOp:
    if name == "silu":
        return SiluAndMul(kernels)
    if name == "gelu_pytorch_tanh":
        return GeluTanhAndMul(kernels)
    raise ValueError(f"unsupported activation {name!r}; inflight serves {', '.join(SUPPORTED_ACTIVATIONS)}")
