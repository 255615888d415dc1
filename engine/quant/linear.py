"""x @ w.T (+ bias) on a weight kept in a GGUF block format, on the kernel the device has.

CPU: the C++ kernels (engine/kernels/cpu/quant_gemm.cpp: AVX-512, AVX2 or portable code, chosen from
the host) once ``torch.ops.inflight_cpu`` is loaded. Up to ``INT8_ACTIVATION_MAX_ROWS`` rows (a decode
step) on a CPU with AVX2 or AVX-512 VNNI, the integer path (``quant_linear_int8``: x's rows quantized to
int8 blocks of 32, integer dot products, llama.cpp's way; ``INFLIGHT_QUANT_INT8_ACTIVATIONS=0`` turns it
off); more rows, the float32 kernels (the dequantized weight times the unrounded rows). CUDA: the
Triton kernel (engine/kernels/quant_matmul.py). Anywhere else, or where those cannot run: the
reference, the float32 matmul of the dequantized weight (every row of x at once, so a long prompt pays
the dequantization once).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Literal

import torch

from engine import envs
from engine.kernels import reference
from engine.quant.weight import QuantizedWeight

if TYPE_CHECKING:
    from engine.quant.int8 import Int8Weight

Path = Literal["cpu", "triton", "reference"]

# ``torch.ops.inflight_cpu.quant_linear_isa()``'s answer, in words.
CPU_ISAS = ("portable", "avx2", "avx512", "avx512_vnni")

# Per format, the most rows the integer path multiplies: past it the float32 kernels were as fast or
# faster (bench/quant_gemm_bench.py, SmolLM2-135M's layer shapes, a 2-core AMD EPYC with AVX-512 VNNI).
# Q5_0 and Q5_1 were not measured: they take Q4_0's and Q4_1's bound, being those formats' integer path
# with one more byte shuffle per block for the fifth bit.
INT8_ACTIVATION_MAX_ROWS = {
    "Q8_0": 16,
    "Q4_0": 16,
    "Q4_1": 16,
    "Q5_0": 16,
    "Q5_1": 16,
    "Q4_K": 4,
    "Q5_K": 4,
    "Q6_K": 2,
}


def cpu_kernels_loaded() -> bool:
    """The C++ kernels are built and registered (``engine.kernels.cpu.load``, which builds on first use)."""
    from engine.kernels import cpu

    return cpu.load() and hasattr(torch.ops.inflight_cpu, "quant_linear")


def cpu_isa() -> str | None:
    """The instruction set the C++ kernels use on this host, or None where they are not loaded."""
    if not cpu_kernels_loaded():
        return None
    return CPU_ISAS[int(torch.ops.inflight_cpu.quant_linear_isa())]


@functools.cache
def cpu_int8_dot() -> bool:
    """The C++ kernels are loaded and the CPU has integer dot products worth using (AVX2 or better)."""
    return cpu_kernels_loaded() and int(torch.ops.inflight_cpu.quant_linear_isa()) >= 1


def int8_activations(rows: int, w: QuantizedWeight) -> bool:
    """Whether ``quant_linear`` multiplies ``rows`` rows of a CPU x by ``w`` on the integer path."""
    return (
        rows <= INT8_ACTIVATION_MAX_ROWS.get(w.format, 0) and envs.quant_int8_activations() and cpu_int8_dot()
    )


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
        op = (
            torch.ops.inflight_cpu.quant_linear_int8
            if int8_activations(x.shape[0], w)
            else torch.ops.inflight_cpu.quant_linear
        )
        out: torch.Tensor = op(x, w.blocks, w.fmt.ggml_type, w.in_features, bias)
        return out
    if path == "triton":
        from engine.kernels.quant_matmul import quant_matmul

        return quant_matmul(
            x if x.stride(1) == 1 else x.contiguous(), w.blocks, w.format, w.in_features, bias
        )
    return reference_linear(x, w, bias)
