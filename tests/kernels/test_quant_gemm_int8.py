"""The integer path of the C++ block-format kernels (quant_gemm.cpp: quant_linear_int8; x's rows
quantized to int8 blocks of 32, integer dot products per 32 values), on every instruction set this host
has (portable, AVX2 maddubs, AVX-512 (which runs the AVX2 code), AVX-512 VNNI).

Against the same activation quantization done in torch (``quantize_rows``: d = amax / 127, q =
round-half-even(x * (1 / d)), float32 as the kernel does it, so the integers agree exactly): the exact
float64 product of the quantized rows and the dequantized weight, within float32 rounding of the
kernel's sums (2e-6 of sum |x_q w| + a float32 ulp of the result; the min formats' m * d * sum(q) terms
add |m| d sum|q| <= ... of the same order, covered by the factor 2).

Against the float kernel (quant_linear, x unrounded): within the activation rounding, each value of a
block off by at most d / 2, so |int - float| <= sum_blocks d / 2 * sum_block |w| (+ the float rounding
of both).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu as cpu_kernels
from engine.quant import FORMATS, QuantizedWeight, random_quantized

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels cannot be built here")

_ROWS = [1, 2, 3, 4, 5, 8, 11, 64]  # row pairs and an odd row past them, up to a burst step


def _isas() -> list[int]:
    return list(range(int(torch.ops.inflight_cpu.quant_linear_isa()) + 1))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch: int8-valued q [m, k] (float32) and scales d
    [m, k / 32]."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None])
    return q.reshape(m, k), d


def _run(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None, isa: int) -> torch.Tensor:
    out: torch.Tensor = torch.ops.inflight_cpu.quant_linear_int8(
        x, w.blocks, w.fmt.ggml_type, w.in_features, bias, isa
    )
    return out


@pytest.mark.parametrize("name", list(FORMATS))
def test_int8_path_is_the_product_of_the_quantized_rows(name: str) -> None:
    gen = torch.Generator().manual_seed(sum(map(ord, name)) + 11)
    in_features = 2 * FORMATS[name].block_size
    for out_features in (7, 12):
        w = random_quantized(name, out_features, in_features, gen)
        weight = w.dequantize().double()
        bias = torch.randn(out_features, generator=gen)
        x_all = torch.randn(max(_ROWS), in_features, generator=gen)
        x_all[0, :32] = 0.0  # an all-zero block: scale 0
        q, d = quantize_rows(x_all)
        x_hat = (q.reshape(len(x_all), -1, 32) * d[..., None].double()).reshape(len(x_all), -1).double()
        for rows in _ROWS:
            b = bias if rows % 2 else None
            exact = x_hat[:rows] @ weight.T + (b.double() if b is not None else 0.0)
            bound = 2e-6 * (x_hat[:rows].abs() @ weight.abs().T) + exact.abs() * 2.0**-23 + 1e-30
            for isa in _isas():
                got = _run(x_all[:rows], w, b, isa)
                assert got.dtype == torch.float32 and got.shape == exact.shape
                err = (got.double() - exact).abs()
                assert (err <= bound).all(), (isa, rows, float((err / bound).max()))


@pytest.mark.parametrize("name", list(FORMATS))
def test_int8_path_is_the_float_kernel_within_the_activation_rounding(name: str) -> None:
    gen = torch.Generator().manual_seed(sum(map(ord, name)) + 12)
    in_features = 2 * FORMATS[name].block_size
    w = random_quantized(name, 9, in_features, gen)
    weight = w.dequantize().double()
    x = torch.randn(4, in_features, generator=gen)
    _, d = quantize_rows(x)
    # |x - x_q d| <= d / 2 per value: per output, sum over blocks of d / 2 * sum_block |w|.
    w_abs = weight.abs().reshape(9, -1, 32).sum(-1)  # [n, k / 32]
    bound = (d.double() / 2) @ w_abs.T * (1 + 1e-5) + 1e-5 * (x.double().abs() @ weight.abs().T)
    want = torch.ops.inflight_cpu.quant_linear(x, w.blocks, w.fmt.ggml_type, in_features, None)
    for isa in _isas():
        got = _run(x, w, None, isa)
        assert ((got.double() - want.double()).abs() <= bound).all(), isa
        # and much closer than the bound on random data: a real check of the sums, not only of the bound
        rel = (got - want).norm() / want.norm()
        assert rel < 0.02, (isa, float(rel))


def test_int8_path_bf16_strided_empty_and_refused() -> None:
    gen = torch.Generator().manual_seed(5)
    w = random_quantized("Q4_K", 6, 256, gen)
    wide = torch.randn(3, 300, generator=gen)
    x = wide[:, 10:266]  # rows 300 apart: read in place
    for isa in _isas():
        assert torch.equal(_run(x, w, None, isa), _run(x.contiguous(), w, None, isa))
        got = _run(x.bfloat16(), w, None, isa)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, _run(x.bfloat16().float(), w, None, isa).bfloat16())
    assert _run(torch.empty(0, 256), w, None, -1).shape == (0, 6)
    with pytest.raises(RuntimeError, match="bias"):
        _run(torch.randn(2, 256), w, torch.zeros(5), -1)
    with pytest.raises(RuntimeError, match="lacks the instructions"):
        _run(torch.randn(1, 256), w, None, len(_isas()))


def test_int8_activations_are_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off unless asked: rounding the rows costs accuracy against the float reference."""
    from engine import envs

    monkeypatch.delenv("INFLIGHT_QUANT_INT8_ACTIVATIONS", raising=False)
    assert envs.quant_int8_activations() is False
    monkeypatch.setenv("INFLIGHT_QUANT_INT8_ACTIVATIONS", "1")
    assert envs.quant_int8_activations() is True
    monkeypatch.setenv("INFLIGHT_QUANT_INT8_ACTIVATIONS", "maybe")
    with pytest.raises(ValueError, match="true or false"):
        envs.quant_int8_activations()


def test_round_rows_is_the_integer_paths_rounding() -> None:
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(37, 96, generator=gen) * 3
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, zeros back
    q, d = quantize_rows(x)
    want = (q.reshape(37, 3, 32) * d[..., None]).reshape(37, 96)
    from engine.quant.linear import round_activations

    assert torch.equal(round_activations(x), want)
    assert torch.equal(round_activations(x.bfloat16()), round_activations(x.bfloat16().float()).bfloat16())


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With int8 activations on, one row multiplied alone (the integer path) and among 64 (past every
    row bound: the dequantised weight times the rounded rows) agree to float32 rounding; with them off the
    64-row product of unrounded rows differs from the integer path by the activation rounding, 100x more."""
    from engine.layers.kernels import Kernels
    from engine.layers.linear import Linear
    from engine.quant.linear import cpu_int8_dot

    if not cpu_int8_dot():
        pytest.skip("no integer path on this host")
    gen = torch.Generator().manual_seed(sum(map(ord, name)) + 31)
    w = random_quantized(name, 48, 2 * FORMATS[name].block_size, gen)
    layer = Linear(w, Kernels(cpu=True))
    x = torch.randn(64, w.in_features, generator=gen)
    monkeypatch.setenv("INFLIGHT_QUANT_INT8_ACTIVATIONS", "1")
    alone = layer(x[:1])
    mid = layer(x[:6])[:1]  # between the integer path's bound and the block kernels'
    among = layer(x)[:1]
    scale = alone.abs().max()
    assert float((among - alone).abs().max() / scale) < 1e-5
    assert float((mid - alone).abs().max() / scale) < 1e-5
    # bf16 rows: the many-row product runs in bf16 on the rounded rows, within bf16's rounding of the
    # integer path's result for the row alone.
    alone_bf16 = layer(x[:1].bfloat16())
    among_bf16 = layer(x.bfloat16())[:1]
    assert among_bf16.dtype == torch.bfloat16
    assert float((among_bf16.float() - alone_bf16.float()).abs().max() / scale) < 3e-2
    monkeypatch.setenv("INFLIGHT_QUANT_INT8_ACTIVATIONS", "0")
    unrounded = layer(x)[:1]
    assert float((unrounded - alone).abs().max() / scale) > 1e-3
