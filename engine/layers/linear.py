"""Linear layers: ``y = x W^T (+ b)`` on whatever layout the engine's kernel reads.

The weight kind decides the kernel, in ``matmul`` and nowhere else: a GGUF block format
(``QuantizedWeight``: engine/quant, multiplied as stored), per-channel int8 (``ChannelWeight``, W8A16),
column panels (3-D, the engine's own CPU
kernels: engine/models/cpu_gemm.py), oneDNN's packed weights (CPU; at decode sizes on an AMX CPU, the
engine's tile kernel over the same memory: engine/models/amx_gemm.py), or a plain [out, in] tensor
(torch's matmul; cuBLAS on a GPU).

Tensor parallelism (Megatron): the loader hands each layer its rank's shard
(engine/distributed/sharding.py). A column-parallel layer (q/k/v, gate/up: output features split)
needs no communication; a row-parallel one (o, down: input features split) returns partial sums that
``reduce=True`` all-reduces, and adds its bias once, after the sum.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.distributed.parallel_state import SINGLE, TensorParallel
from engine.layers.kernels import Kernels
from engine.models import amx_gemm, cpu_gemm, onednn
from engine.platform.cpu import cpu_flags, cpu_has_bf16_matmul
from engine.quant.channel import ChannelWeight, channel_linear
from engine.quant.linear import dequantize_for_step, quant_linear, round_activations, rounds_activations
from engine.quant.stacked import StackedWeight
from engine.quant.weight import QuantizedWeight

# One stored layout (an embedding table or LM head is one of these); a fused linear may also be a stack.
SingleWeight = torch.Tensor | QuantizedWeight | ChannelWeight
Weight = SingleWeight | StackedWeight
# Up to this many rows a block-format or int8 weight is multiplied as stored (engine/quant: a decode step
# reads each weight once, a quarter to a half of float32's bytes); past it, dequantised for the step and
# multiplied in float, where the float GEMM's register blocking beats re-expanding blocks per row tile.
# Where that happens depends on the float GEMM's width, so on the host and the model's dtype: on
# SmolLM2-135M's layer shapes, one thread, an AVX2 CPU's block kernels were even with the C++
# dequantisation plus a float linear at 64 rows (64 covers a full decode batch at the default
# max_num_seqs); on an AVX-512 one (oneDNN's float kernels twice as wide) even at 16 rows and 1.7-2.4x
# slower at 64 (docs/benchmarks.md, "Block kernels or the dequantised weight"); in bf16 on an AVX512_BF16
# CPU (the weight dequantised straight to bf16, and a product at bf16's rate) even at 6 to 8 rows. A
# GPU's Triton kernels keep 64.
QUANT_KERNEL_MAX_ROWS = 64
QUANT_KERNEL_MAX_ROWS_WIDE_CPU = 16
QUANT_KERNEL_MAX_ROWS_BF16_CPU = 6


@functools.cache
def quant_kernel_max_rows(device_type: str, dtype: torch.dtype = torch.float32) -> int:
    """The row bound above for rows of ``dtype`` on ``device_type`` ("cpu", "cuda"), on this host."""
    if device_type != "cpu":
        return QUANT_KERNEL_MAX_ROWS
    if dtype == torch.bfloat16 and cpu_has_bf16_matmul():
        return QUANT_KERNEL_MAX_ROWS_BF16_CPU
    return QUANT_KERNEL_MAX_ROWS_WIDE_CPU if "avx512f" in cpu_flags() else QUANT_KERNEL_MAX_ROWS


class Linear:
    def __init__(
        self,
        weight: Weight,  # [out, in] (this rank's shard)
        kernels: Kernels,
        bias: torch.Tensor | None = None,  # [out]
        *,
        reduce: bool = False,  # row-parallel: all-reduce the partial products over ``tp``
        tp: TensorParallel = SINGLE,
    ) -> None:
        if isinstance(weight, StackedWeight):
            self.out_features, self.in_features = weight.out_features, weight.in_features
            self.weight: Weight = weight.map(
                lambda part: kernels.pack(part) if isinstance(part, torch.Tensor) else part
            )
        elif isinstance(weight, QuantizedWeight | ChannelWeight):
            self.out_features, self.in_features = weight.out_features, weight.in_features
            self.weight = weight
        else:
            self.out_features, self.in_features = weight.shape
            self.weight = kernels.pack(weight)
        self.bias = bias
        self.kernels = kernels
        self.reduce = reduce and tp.enabled
        self.tp = tp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if not self.reduce:
            return matmul(x, self.weight, self.bias, self.kernels)
        out = self.tp.all_reduce(matmul(x, self.weight, None, self.kernels))
        return out if self.bias is None else out + self.bias


def matmul(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, kernels: Kernels) -> torch.Tensor:
    """One linear product on any weight layout ``Kernels.pack`` returns, or a GGUF block format."""
    if isinstance(weight, StackedWeight):  # parts in different formats: each on its own kernel
        biases = [None] * len(weight.parts) if bias is None else bias.split(list(weight.splits))
        outs = [matmul(x, part, b, kernels) for part, b in zip(weight.parts, biases, strict=True)]
        return torch.cat(outs, dim=1)
    if isinstance(weight, QuantizedWeight | ChannelWeight):
        if x.shape[0] <= quant_kernel_max_rows(x.device.type, x.dtype):
            if isinstance(weight, ChannelWeight):
                return channel_linear(x, weight, bias)
            return quant_linear(x, weight, bias)
        # A prefill's many rows are bound by the multiplies, not by reading the weight: dequantising it
        # once for the whole chunk and multiplying in float beats re-expanding blocks per row tile.
        if isinstance(weight, QuantizedWeight) and rounds_activations(weight, x.device):
            # The rows as the integer path rounds them (engine/quant/linear.py), multiplied in x's dtype:
            # in bf16 the product then runs at bf16's rate (twice float32's with AVX512_BF16), and a row's
            # result differs from its batch of one by bf16's rounding, as anything in a bf16 model does.
            rounded = round_activations(x)
            out = F.linear(rounded, dequantize_for_step(weight, x.dtype))
            return out if bias is None else out + bias
        return F.linear(x, dequantize_for_step(weight, x.dtype), bias)
    if weight.dim() == 3:  # column panels (cpu_gemm.pack)
        return cpu_gemm.linear(x, weight, bias)
    if kernels.prepack_rows:
        panels = amx_gemm.panels_for(weight, x.shape[0], kernels.amx_rows)
        if panels is not None:
            return amx_gemm.linear(x, panels, bias)
        return onednn.linear(x, weight, bias)
    return F.linear(x, weight, bias)
