"""Per-channel 8-bit linear layers, int8 (W8A16) and fp8 e4m3 (W8A16-FP8): the C++ kernel
(engine/kernels/cpu/quant_gemm.cpp, ``w8_linear``) on every instruction set this host has, and the
Triton kernel (engine/kernels/w8_matmul.py, under the interpreter without a GPU), against the float64
product of the dequantized weight; ``channel_linear``'s dispatch and its torch fallback.

Rows 1 and 2 take the C++ kernel's in-register path, 3 and more its dequantized tiles; out features 37
end in a partial tile of four rows. Tolerance, float32 x: one float32 sum of k products per output
(the C++ tiles multiply the dequantized float32 values, the in-register path and Triton the integers,
scaled after the sum: a few more roundings of the same size), so |got - exact| <= 1e-6 * sum_k |x_k w_k|
+ 2^-22 |exact|. bf16 x: rounded to bf16 once more (2^-8 |exact|; 2^-7 where Triton's interpreter
truncates).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu as cpu_kernels
from engine.quant.channel import (
    E4M3_UNBIAS,
    ChannelWeight,
    channel_linear,
    decode_e4m3,
    path_for,
    quantize_per_channel,
    reference_linear,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CODES = pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])


def _weight(out_features: int, in_features: int, seed: int, code: torch.dtype = torch.int8) -> ChannelWeight:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    if code == torch.float8_e4m3fn:
        # Rows spanning e4m3's whole range: a few tiny values land on its subnormal codes.
        weight[:, ::7] *= 1e-4
    return quantize_per_channel(weight, code)


def _check(got: torch.Tensor, x: torch.Tensor, w: ChannelWeight, bias: torch.Tensor | None) -> None:
    weight = w.dequantize().double()
    exact = x.double() @ weight.T + (0 if bias is None else bias.double())
    bound = 1e-6 * (x.double().abs() @ weight.abs().T) + 2.0**-22 * exact.abs()
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0**-7 * exact.abs()
    assert got.shape == exact.shape
    assert ((got.cpu().double() - exact).abs() <= bound).all(), (got.cpu().double() - exact).abs().max()


def test_quantize_per_channel_round_trips_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(9, 48, generator=gen)
    w = quantize_per_channel(weight)
    assert w.qweight.dtype == torch.int8 and w.scale.shape == (9,)
    assert (w.qweight.abs().amax(dim=1) == 127).all(), "each row's largest value uses the full range"
    assert ((w.dequantize() - weight).abs() <= w.scale[:, None] / 2 + 1e-7).all()
    fused = ChannelWeight.cat_rows([w, w.narrow_rows(2, 5)])
    assert fused.out_features == 12 and torch.equal(fused.dequantize()[9:], w.dequantize()[2:5])
    f8 = quantize_per_channel(weight, torch.float8_e4m3fn)
    assert f8.is_fp8 and (f8.qweight.float().abs().amax(dim=1) == 448).all()
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value (relative), or half its smallest step.
    err = (f8.dequantize() - weight).abs()
    assert (err <= weight.abs() * 2.0**-4 + f8.scale[:, None] * 2.0**-10).all()
    with pytest.raises(ValueError, match="different widths or codes"):
        ChannelWeight.cat_rows([w, f8])


def test_e4m3_decoding_is_exact_for_every_code() -> None:
    """The kernels' decoding (bits under an fp16's, times 2^8) gives each of the 254 non-NaN e4m3 codes'
    values exactly, subnormals and both zeros included."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    finite = ~values.isnan()
    decoded = decode_e4m3(codes).float() * E4M3_UNBIAS
    assert int(finite.sum()) == 254
    assert torch.equal(decoded[finite], values[finite])
    assert torch.equal(decoded[finite].signbit(), values[finite].signbit())


@CODES
@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels cannot be built here")
def test_cpu_kernel_on_every_instruction_set(code: torch.dtype) -> None:
    w = _weight(37, 96, seed=1, code=code)
    gen = torch.Generator().manual_seed(2)
    bias = torch.randn(37, generator=gen)
    for isa in range(int(torch.ops.inflight_cpu.quant_linear_isa()) + 1):
        for rows in (1, 2, 3, 5, 33):
            x = torch.randn(rows, 96, generator=gen)
            for b in (None, bias):
                _check(torch.ops.inflight_cpu.w8_linear(x, w.qweight, w.scale, b, isa), x, w, b)
        x16 = torch.randn(2, 96, generator=gen).bfloat16()
        got = torch.ops.inflight_cpu.w8_linear(x16, w.qweight, w.scale, None, isa)
        assert got.dtype == torch.bfloat16
        _check(got, x16, w, None)
    with pytest.raises(RuntimeError, match="multiples of 16"):
        torch.ops.inflight_cpu.w8_linear(
            torch.zeros(1, 40), torch.zeros(3, 40, dtype=torch.int8), torch.ones(3), None
        )


@CODES
def test_dequantize_for_step_is_the_dequantized_weight(code: torch.dtype) -> None:
    """The C++ dequantizer (a prefill's many-row step) gives ``dequantize``'s float32 values exactly, and
    those rounded to bf16 (ties to even) for a bf16 model; widths it cannot step through fall back."""
    from engine.quant.linear import dequantize_for_step

    for in_features in (96, 40):
        w = _weight(37, in_features, seed=9, code=code)
        want = w.dequantize()
        assert torch.equal(dequantize_for_step(w, torch.float32), want)
        got = dequantize_for_step(w, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())


@CODES
def test_channel_linear_dispatch_and_fallback(code: torch.dtype) -> None:
    """Widths the C++ kernel cannot step through (not a multiple of 16) take the torch reference;
    the rest the kernel, where it is built. Both give the dequantized weight's product."""
    gen = torch.Generator().manual_seed(3)
    for in_features in (40, 64):
        w = _weight(11, in_features, seed=in_features, code=code)
        x = torch.randn(3, in_features, generator=gen)
        expected = "cpu" if in_features % 16 == 0 and cpu_kernels.load() else "reference"
        assert path_for(w) == expected
        _check(channel_linear(x, w), x, w, None)
        _check(reference_linear(x, w), x, w, None)
    with pytest.raises(ValueError, match=r"x must be \[T, 64\]"):
        channel_linear(torch.zeros(2, 63), w)


@CODES
def test_triton_kernel(code: torch.dtype) -> None:
    w8_matmul = pytest.importorskip("engine.kernels.w8_matmul").w8_matmul
    gen = torch.Generator().manual_seed(4)
    w = _weight(37, 80, seed=6, code=code)  # 80: a partial last slice of 64 in features
    bias = torch.randn(37, generator=gen)
    q, s = w.qweight.to(DEVICE), w.scale.to(DEVICE)
    for rows, b in ((1, bias), (17, None)):
        x = torch.randn(rows, 80, generator=gen)
        _check(w8_matmul(x.to(DEVICE), q, s, None if b is None else b.to(DEVICE)), x, w, b)
    x16 = torch.randn(3, 80, generator=gen).bfloat16()
    got = w8_matmul(x16.to(DEVICE), q, s)
    assert got.dtype == torch.bfloat16
    _check(got, x16, w, None)


def test_int8_and_fp8_rows_of_one_fused_weight_stay_side_by_side() -> None:
    """q/k/v whose checkpoint quantized them in different codes: fused as a stack of parts (each on its
    own kernel), whose product is the parts' products side by side."""
    from engine.layers.kernels import Kernels
    from engine.layers.linear import Linear
    from engine.models.loader import _cat
    from engine.quant.stacked import StackedWeight

    q, k = _weight(32, 64, seed=11), _weight(16, 64, seed=12, code=torch.float8_e4m3fn)
    fused = _cat([q, k])
    assert isinstance(fused, StackedWeight) and fused.out_features == 48
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(13))
    want = torch.cat([channel_linear(x, q), channel_linear(x, k)], dim=1)
    assert torch.allclose(Linear(fused, Kernels())(x), want, rtol=1e-5, atol=1e-6)
