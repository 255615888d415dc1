"""The Triton linear kernel on GGUF block formats (engine/kernels/quant_matmul.py) against its torch
reference (engine/kernels/reference.py: the dequantized weight's float32 product) and float64, under the
interpreter on CPU: every format, row counts inside one and across two row tiles, out features that end
in a partial column tile, with and without a bias; bf16 inputs.

Tolerance, float32: one float32 sum of exact products (``input_precision="ieee"``) per output, so
|got - exact| <= 1e-6 * sum_k |x_k w_k| + 2^-23 |exact|. bf16: the dequantized values are rounded to
bf16 before the product (2^-8 each, 2^-7 where the interpreter truncates) and the output once more.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import reference
from engine.quant import FORMATS, random_quantized

quant_matmul = pytest.importorskip("engine.kernels.quant_matmul").quant_matmul

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _bound(x: torch.Tensor, weight: torch.Tensor, exact: torch.Tensor, bf16: bool) -> torch.Tensor:
    magnitude = x.double().abs() @ weight.double().abs().T
    if bf16:
        return 2.0**-7 * magnitude + 2.0**-8 * exact.abs()
    return 1e-6 * magnitude + 2.0**-23 * exact.abs()


@pytest.mark.parametrize("name", list(FORMATS))
def test_quant_matmul_matches_the_reference(name: str) -> None:
    gen = torch.Generator().manual_seed(sum(map(ord, name)) + 1)
    in_features = 256 if FORMATS[name].block_size == 256 else 64
    w = random_quantized(name, 37, in_features, gen)
    weight = w.dequantize()
    bias = torch.randn(37, generator=gen)
    for rows, b in ((1, bias), (17, None)):  # one row tile of 16, then two of 32 rows
        x = torch.randn(rows, in_features, generator=gen)
        got = quant_matmul(
            x.to(DEVICE), w.blocks.to(DEVICE), name, in_features, None if b is None else b.to(DEVICE)
        )
        assert got.shape == (rows, 37) and got.dtype == torch.float32
        exact = x.double() @ weight.double().T + (0 if b is None else b.double())
        assert ((got.cpu().double() - exact).abs() <= _bound(x, weight, exact, False)).all()
        ref = reference.quant_matmul(x, w.blocks, name, in_features, b)
        assert ((got.cpu().double() - ref.double()).abs() <= 2 * _bound(x, weight, exact, False)).all()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])
def test_bf16_inputs(name: str) -> None:
    gen = torch.Generator().manual_seed(21)
    in_features = FORMATS[name].block_size * (2 if name == "Q4_0" else 1)
    w = random_quantized(name, 20, in_features, gen)
    x = torch.randn(3, in_features, generator=gen).bfloat16()
    got = quant_matmul(x.to(DEVICE), w.blocks.to(DEVICE), name, in_features)
    assert got.dtype == torch.bfloat16
    weight = w.dequantize()
    exact = x.double() @ weight.double().T
    assert ((got.cpu().double() - exact).abs() <= _bound(x, weight, exact, True)).all()


def test_empty_input_and_bad_shapes() -> None:
    w = random_quantized("Q8_0", 8, 32, torch.Generator().manual_seed(0))
    blocks = w.blocks.to(DEVICE)
    assert quant_matmul(torch.empty(0, 32, device=DEVICE), blocks, "Q8_0", 32).shape == (0, 8)
    with pytest.raises(AssertionError):
        quant_matmul(torch.randn(2, 64, device=DEVICE), blocks, "Q8_0", 64)
    with pytest.raises(ValueError, match="unsupported block format"):
        quant_matmul(torch.randn(2, 32, device=DEVICE), blocks, "Q2_K", 32)


@pytest.mark.gpu
def test_quant_linear_takes_the_triton_kernel_on_cuda() -> None:
    from engine.quant.linear import path_for, quant_linear

    gen = torch.Generator().manual_seed(22)
    w = random_quantized("Q6_K", 96, 512, gen)
    x = torch.randn(64, 512, generator=gen)
    assert path_for(torch.device("cuda")) == "triton"
    got = quant_linear(x.cuda(), w.to("cuda")).cpu()
    weight = w.dequantize()
    exact = x.double() @ weight.double().T
    assert ((got.double() - exact).abs() <= _bound(x, weight, exact, False)).all()
