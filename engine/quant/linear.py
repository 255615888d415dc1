"""x @ w.T (+ bias) on a weight kept in a GGUF block format, on the kernel the device has.

CPU: the C++ kernels (engine/kernels/cpu/quant_gemm.cpp: AVX-512, AVX2 or portable code, chosen from
the host) once ``torch.ops.inflight_cpu`` is loaded, on x's rows as they are. With
``INFLIGHT_QUANT_INT8_ACTIVATIONS=1``, on a CPU with AVX2 or AVX-512 VNNI, x's rows are rounded to int8
blocks of 32 (llama.cpp's way) at every row count (``rounds_activations``): up to
``INT8_ACTIVATION_MAX_ROWS`` rows (a decode step) multiplied on the integer path (``quant_linear_int8``:
integer dot products), more rows by the float kernels (the dequantized weight times the rounded rows,
in x's dtype), so the path a step's size picks does not change a row's result beyond that dtype's
rounding. CUDA: the
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
    from engine.quant.channel import ChannelWeight

Path = Literal["cpu", "triton", "reference"]

# ``torch.ops.inflight_cpu.quant_linear_isa()``'s answer, in words.
CPU_ISAS = ("portable", "avx2", "avx512", "avx512_vnni")

# Per format, the most rows the integer path multiplies: past it the float32 kernels were as fast or
# faster (bench/quant_gemm_bench.py, SmolLM2-135M's layer shapes, a 2-core AMD EPYC with AVX-512 VNNI).
# Q5_0 and Q5_1 were not measured: they take Q4_0's and Q4_1's bound, being those formats' integer path
# with one more byte shuffle per block for the fifth bit. A linear layer stops at its own row bound
# first (engine/layers/linear.py: in a bf16 model on an AVX512_BF16 CPU, 6 rows).
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


def rounds_activations(w: QuantizedWeight, device: torch.device) -> bool:
    """Whether every product of ``w`` with rows on ``device`` takes the rows rounded to int8 blocks of 32
    (the integer path's rounding), whatever their number: a CPU with the integer path, a format it serves,
    ``INFLIGHT_QUANT_INT8_ACTIVATIONS`` on. Past the integer path's row bound the float kernels (or the
    dequantised weight) multiply the rounded rows (``round_activations``), so that a row's result does not
    depend on how many rows share its step: a request's greedy tokens stay those of its batch of one, up to
    the rounding of the model's dtype (float32 or bf16) as on the float path."""
    return (
        device.type == "cpu"
        and w.format in INT8_ACTIVATION_MAX_ROWS
        and envs.quant_int8_activations()
        and cpu_int8_dot()
    )


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x's rows (float32 or bf16, CPU) as the integer path rounds them, in x's dtype: each block of 32
    values q * d, d = amax / 127 (the C++ kernels' own rounding: the same integers), rounded once to it."""
    out: torch.Tensor = torch.ops.inflight_cpu.round_rows_int8(x)
    return out


def path_for(device: torch.device) -> Path:
    """Which implementation ``quant_linear`` runs for inputs on ``device``."""
    if device.type == "cpu":
        return "cpu" if cpu_kernels_loaded() else "reference"
    if device.type == "cuda":
        from engine.kernels import triton_available

        return "triton" if triton_available() else "reference"
    return "reference"


def dequantize_for_step(
    w: QuantizedWeight | ChannelWeight, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weight in ``dtype`` for one many-row product: the C++ dequantizer where it is loaded (the same
    values as ``dequantize``, several times faster than its torch ops (for fp8 codes, 9x: torch converts
    e4m3 a value at a time); for bf16 each row rounded from float32 as it is made, so no float32 copy
    of the whole weight is written), else ``dequantize``."""
    if w.device.type == "cpu" and cpu_kernels_loaded():
        bf16 = dtype == torch.bfloat16
        ops = torch.ops.inflight_cpu
        if isinstance(w, QuantizedWeight):
            out: torch.Tensor = ops.quant_dequantize(w.blocks, w.fmt.ggml_type, w.in_features, -1, bf16)
            return out if bf16 else out.to(dtype)
        if w.in_features % 16 == 0:
            out = ops.w8_dequantize(w.qweight, w.scale, -1, bf16)
            return out if bf16 else out.to(dtype)
    return w.dequantize().to(dtype)


def check_input(x: torch.Tensor, in_features: int, device: torch.device) -> None:
    """Raises ValueError unless x is [T, in_features] on the weight's device."""
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [T, {in_features}], got {list(x.shape)}")
    if x.device != device:
        raise ValueError(f"x is on {x.device}, the weight on {device}")


def reference_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: float32 x times the dequantized float32 weight, plus bias, in x's dtype."""
    return reference.quant_matmul(x, w.blocks, w.format, w.in_features, bias)


def quant_linear(
    x: torch.Tensor,  # [T, in_features] float32 or bf16
    w: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [T, out_features] in x's dtype
    check_input(x, w.in_features, w.device)
    path = path_for(x.device)
    if path == "cpu":
        ops = torch.ops.inflight_cpu
        if not rounds_activations(w, x.device):
            out: torch.Tensor = ops.quant_linear(x, w.blocks, w.fmt.ggml_type, w.in_features, bias)
            return out
        if x.shape[0] <= INT8_ACTIVATION_MAX_ROWS[w.format]:
            out = ops.quant_linear_int8(x, w.blocks, w.fmt.ggml_type, w.in_features, bias)
            return out
        # More rows than the integer path is fast for: the float kernels, on the rows it would have rounded.
        out = ops.quant_linear(round_activations(x), w.blocks, w.fmt.ggml_type, w.in_features, bias)
        return out
    if path == "triton":
        from engine.kernels.quant_matmul import quant_matmul

        return quant_matmul(
            x if x.stride(1) == 1 else x.contiguous(), w.blocks, w.format, w.in_features, bias
        )
    return reference_linear(x, w, bias)
