"""x @ w.T (+ bias) on a weight kept in a GGUF block format, on the kernel the device has.

CPU: the C++ kernels (engine/kernels/cpu/quant_gemm.cpp: AVX-512, AVX2 or portable code, chosen from
the host) once ``torch.ops.inflight_cpu`` is loaded. CUDA: the Triton kernel
(engine/kernels/quant_matmul.py). Anywhere else, or where those cannot run: the reference, the float32
matmul of the dequantized weight (every row of x at once, so a long prompt pays the dequantization
once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from engine.kernels import reference
from engine.quant.weight import QuantizedWeight

if TYPE_CHECKING:
    from engine.quant.int8 import Int8Weight

Path = Literal["cpu", "triton", "reference"]

# ``torch.ops.inflight_cpu.quant_linear_isa()``'s answer, in words.
CPU_ISAS = ("portable", "avx2", "avx512")


def cpu_kernels_loaded() -> bool:
    """The C++ kernels are built and registered (``engine.kernels.cpu.load``, which builds on first use)."""
    from engine.kernels import cpu

    return cpu.load() and hasattr(torch.ops.inflight_cpu, "quant_linear")


def cpu_isa() -> str | None:
    """The instruction set the C++ kernels use on this host, or None where they are not loaded."""
    if not cpu_kernels_loaded():
        return None
    return CPU_ISAS[int(torch.ops.inflight_cpu.quant_linear_isa())]


def path_for(device: torch.device) -> Path:
    """Which implementation ``quant_linear`` runs for inputs on ``device``."""
    if device.type == "cpu":
        return "cpu" if cpu_kernels_loaded() else "reference"
    if device.type == "cuda":
        from engine.kernels import triton_available

        return "triton" if triton_available() else "reference"
    return "reference"


def dequantize_for_step(w: QuantizedWeight | Int8Weight) -> torch.Tensor:
    """The float32 weight for one many-row product: the C++ dequantizer where it is loaded (the same
    values as ``dequantize``, several times faster than its torch ops), else ``dequantize``."""
    if isinstance(w, QuantizedWeight) and w.device.type == "cpu" and cpu_kernels_loaded():
        out: torch.Tensor = torch.ops.inflight_cpu.quant_dequantize(w.blocks, w.fmt.ggml_type, w.in_features)
        return out
    return w.dequantize()


def reference_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: float32 x times the dequantized float32 weight, plus bias, in x's dtype."""
    return reference.quant_matmul(x, w.blocks, w.format, w.in_features, bias)


def quant_linear(
    x: torch.Tensor,  # [T, in_features] float32 or bf16
    w: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [T, out_features] in x's dtype
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be [T, {w.in_features}], got {list(x.shape)}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, the weight on {w.device}")
    path = path_for(x.device)
    if path == "cpu":
        out: torch.Tensor = torch.ops.inflight_cpu.quant_linear(
            x, w.blocks, w.fmt.ggml_type, w.in_features, bias
        )
        return out
    if path == "triton":
        from engine.kernels.quant_matmul import quant_matmul

        return quant_matmul(
            x if x.stride(1) == 1 else x.contiguous(), w.blocks, w.format, w.in_features, bias
        )
    return reference_linear(x, w, bias)
