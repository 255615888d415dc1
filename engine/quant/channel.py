"""Weight-only 8-bit weights with one scale per output channel, and the linear layer on them.

``w[n, k] = scale[n] * qweight[n, k]``, activations in the model's float dtype, in one of two codes:
  * int8 (W8A16): compressed-tensors' W8A16 scheme (engine/quant/compressed_tensors.py reads it);
  * fp8 e4m3 (W8A16-FP8): compressed-tensors' float-quantized checkpoints, and a float checkpoint's
    linears quantized at load (``quantization="fp8"``, ``quantize_per_channel(w, torch.float8_e4m3fn)``).
Either way a decode step reads a quarter of float32's bytes (half of bf16's).

``channel_linear`` multiplies on the kernel the device has: the C++ CPU kernel
(``torch.ops.inflight_cpu.w8_linear``, engine/kernels/cpu/quant_gemm.cpp: the codes converted to float in
registers, AVX-512 or AVX2 chosen from the host), the Triton kernel on CUDA
(engine/kernels/w8_matmul.py), and elsewhere the reference: the float matmul of the dequantized weight.
Neither kernel needs fp8 hardware: an e4m3 byte's bits are moved into an fp16's, which every CPU with
F16C and every GPU converts (``decode_e4m3``), so fp8 weights run wherever int8 ones do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.quant.linear import Path, check_input, cpu_kernels_loaded

# The codes a ChannelWeight holds, and each one's largest magnitude (what a row's largest |w| maps to).
CODES: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@dataclass(frozen=True)
class ChannelWeight:
    """``qweight`` int8 or float8_e4m3fn [out_features, in_features], contiguous rows; ``scale`` float32
    [out_features].

    Rows are independent (each has its own scale), so a fused QKV or gate-up weight is a concatenation
    of rows (``cat_rows``) and a checkpoint's fused tensor splits by row ranges (``narrow_rows``)."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        q, s = self.qweight, self.scale
        if q.dtype not in CODES or q.dim() != 2 or not q.is_contiguous():
            raise ValueError(
                f"qweight must be contiguous int8 or float8_e4m3fn [out, in], got {q.dtype} {list(q.shape)}"
            )
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

    @property
    def is_fp8(self) -> bool:
        return self.qweight.dtype == torch.float8_e4m3fn

    def narrow_rows(self, start: int, stop: int) -> ChannelWeight:
        if not 0 <= start < stop <= self.out_features:
            raise ValueError(f"rows [{start}, {stop}) outside [0, {self.out_features})")
        return ChannelWeight(self.qweight[start:stop].contiguous(), self.scale[start:stop].contiguous())

    @staticmethod
    def cat_rows(weights: Sequence[ChannelWeight]) -> ChannelWeight:
        if not weights:
            raise ValueError("nothing to concatenate")
        kinds = {(w.in_features, w.qweight.dtype) for w in weights}
        if len(kinds) != 1:
            raise ValueError(
                f"cannot concatenate rows of different widths or codes {sorted(map(str, kinds))}"
            )
        return ChannelWeight(torch.cat([w.qweight for w in weights]), torch.cat([w.scale for w in weights]))

    def to(self, device: torch.device | str) -> ChannelWeight:
        return ChannelWeight(self.qweight.to(device), self.scale.to(device))

    def dequantize(self) -> torch.Tensor:
        """[out_features, in_features] float32: round(scale * q) in float32, what every kernel meets."""
        return self.qweight.float() * self.scale[:, None]


def quantize_per_channel(weight: torch.Tensor, dtype: torch.dtype = torch.int8) -> ChannelWeight:
    """Symmetric per-row codes of a float [out, in] weight: scale = max |w| / (127 or 448), q = w / scale
    rounded to the nearest int8 or e4m3 value (ties to even, torch's conversion).

    What compressed-tensors' W8A16 and W8A16-FP8 (minmax observer, symmetric, channel strategy) store,
    and what ``quantization="fp8"`` makes of a float checkpoint's linears at load."""
    if dtype not in CODES:
        raise ValueError(f"per-channel codes are int8 or float8_e4m3fn, not {dtype}")
    w = weight.detach().float()
    top = CODES[dtype]
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / top
    scaled = w / scale[:, None]
    q = torch.round(scaled).clamp(-128, 127) if dtype == torch.int8 else scaled.clamp(-top, top)
    return ChannelWeight(q.to(dtype).contiguous(), scale.contiguous())


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 bytes -> float16 values times 2^-8, the kernels' decoding written in torch (tests check
    the kernels' arithmetic with it): sign to the fp16 sign, the 4 exponent and 3 mantissa bits under
    fp16's exponent and mantissa. e4m3's exponent bias is 7 and fp16's 15, so every value, subnormals
    included, comes out exactly 2^-8 of itself; the kernels fold 2^8 into the row's scale. (e4m3fn's
    NaN codes, 0x7f and 0xff, decode to +-480: a quantized weight never holds them.)"""
    b = codes.to(torch.int32)
    bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return bits.to(torch.int16).view(torch.float16)


# 2^8: what decode_e4m3's values lack (e4m3's exponent bias 7 read under fp16's 15).
E4M3_UNBIAS = 256.0


def path_for(w: ChannelWeight) -> Path:
    """Which implementation ``channel_linear`` runs for this weight (inputs are on its device)."""
    if w.device.type == "cpu":
        # The C++ kernel reads 16 values a step; the tiny shapes tests make may not be whole steps.
        return "cpu" if w.in_features % 16 == 0 and cpu_kernels_loaded() else "reference"
    if w.device.type == "cuda":
        from engine.kernels import triton_available

        return "triton" if triton_available() else "reference"
    return "reference"


def reference_linear(x: torch.Tensor, w: ChannelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: x times the dequantized weight (float32 accumulate), plus bias, in x's dtype."""
    out = F.linear(x.float(), w.dequantize(), None if bias is None else bias.float())
    return out.to(x.dtype)


def channel_linear(
    x: torch.Tensor,  # [T, in_features] float32 or bf16 (float16 too on CUDA)
    w: ChannelWeight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [T, out_features] in x's dtype
    check_input(x, w.in_features, w.device)
    path = path_for(w)
    if path == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        out: torch.Tensor = torch.ops.inflight_cpu.w8_linear(x, w.qweight, w.scale, bias)
        return out
    if path == "triton":
        from engine.kernels.w8_matmul import w8_matmul

        return w8_matmul(x if x.stride(1) == 1 else x.contiguous(), w.qweight, w.scale, bias)
    return reference_linear(x, w, bias)
