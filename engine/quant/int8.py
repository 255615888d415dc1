"""Weight-only int8 with one scale per output channel (W8A16), and the linear layer on it.

``w[n, k] = scale[n] * qweight[n, k]``: int8 values, a float32 scale per row, activations in the model's
float dtype (compressed-tensors' W8A16 scheme: engine/quant/compressed_tensors.py reads it from HF
checkpoints). A decode step reads a quarter of float32's bytes (half of bf16's).

``int8_linear`` multiplies on the kernel the device has: the C++ CPU kernel
(``torch.ops.inflight_cpu.w8_linear``, engine/kernels/cpu/quant_gemm.cpp: int8 converted to float in
registers, AVX-512 or AVX2 chosen from the host), the Triton kernel on CUDA
(engine/kernels/w8_matmul.py), and elsewhere the reference: the float matmul of the dequantized weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.quant.linear import Path, cpu_kernels_loaded


@dataclass(frozen=True)
class Int8Weight:
    """``qweight`` int8 [out_features, in_features], contiguous rows; ``scale`` float32 [out_features].

    Rows are independent (each has its own scale), so a fused QKV or gate-up weight is a concatenation
    of rows (``cat_rows``) and a checkpoint's fused tensor splits by row ranges (``narrow_rows``)."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        q, s = self.qweight, self.scale
        if q.dtype != torch.int8 or q.dim() != 2 or not q.is_contiguous():
            raise ValueError(f"qweight must be contiguous int8 [out, in], got {q.dtype} {list(q.shape)}")
        if s.dtype != torch.float32 or tuple(s.shape) != (q.shape[0],) or not s.is_contiguous():
            raise ValueError(
                f"scale must be contiguous float32 [{q.shape[0]}], got {s.dtype} {list(s.shape)}"
            )
        if s.device != q.device:
            raise ValueError(f"scale is on {s.device}, qweight on {q.device}")

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def narrow_rows(self, start: int, stop: int) -> Int8Weight:
        if not 0 <= start < stop <= self.out_features:
            raise ValueError(f"rows [{start}, {stop}) outside [0, {self.out_features})")
        return Int8Weight(self.qweight[start:stop].contiguous(), self.scale[start:stop].contiguous())

    @staticmethod
    def cat_rows(weights: Sequence[Int8Weight]) -> Int8Weight:
        if not weights:
            raise ValueError("nothing to concatenate")
        widths = {w.in_features for w in weights}
        if len(widths) != 1:
            raise ValueError(f"cannot concatenate int8 rows of different widths {sorted(widths)}")
        return Int8Weight(torch.cat([w.qweight for w in weights]), torch.cat([w.scale for w in weights]))

    def to(self, device: torch.device | str) -> Int8Weight:
        return Int8Weight(self.qweight.to(device), self.scale.to(device))

    def dequantize(self) -> torch.Tensor:
        """[out_features, in_features] float32: round(scale * q) in float32, what every kernel meets."""
        return self.qweight.float() * self.scale[:, None]


def quantize_per_channel(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-row int8 of a float [out, in] weight: scale = max |w| / 127, q = round(w / scale).

    What compressed-tensors' W8A16 (minmax observer, symmetric, channel strategy) stores; benchmarks
    and tests make checkpoints with it."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


def path_for(w: Int8Weight) -> Path:
    """Which implementation ``int8_linear`` runs for this weight (inputs are on its device)."""
    if w.device.type == "cpu":
        # The C++ kernel reads 16 values a step; the tiny shapes tests make may not be whole steps.
        return "cpu" if w.in_features % 16 == 0 and cpu_kernels_loaded() else "reference"
    if w.device.type == "cuda":
        from engine.kernels import triton_available

        return "triton" if triton_available() else "reference"
    return "reference"


def reference_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: x times the dequantized weight (float32 accumulate), plus bias, in x's dtype."""
    out = F.linear(x.float(), w.dequantize(), None if bias is None else bias.float())
    return out.to(x.dtype)


def int8_linear(
    x: torch.Tensor,  # [T, in_features] float32 or bf16 (float16 too on CUDA)
    w: Int8Weight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [T, out_features] in x's dtype
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [T, {w.in_features}], got {list(x.shape)}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, the weight on {w.device}")
    path = path_for(w)
    if path == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        out: torch.Tensor = torch.ops.inflight_cpu.w8_linear(x, w.qweight, w.scale, bias)
        return out
    if path == "triton":
        from engine.kernels.w8_matmul import w8_matmul

        return w8_matmul(x if x.stride(1) == 1 else x.contiguous(), w.qweight, w.scale, bias)
    return reference_linear(x, w, bias)
