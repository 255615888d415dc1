"""A fused weight held as parts in different formats (engine/quant/stacked.py) multiplies as the fused
float weight does: on a decode step's few rows (each part on its block kernel) and on a prefill's many
(each part dequantized for the step), with a bias split over the parts, and beside a float part packed
for the engine's own CPU kernel."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu as cpu_kernels
from engine.layers.kernels import Kernels
from engine.layers.linear import QUANT_KERNEL_MAX_ROWS, Linear
from engine.models.loader import _cat
from engine.quant.stacked import StackedWeight
from engine.quant.weight import QuantizedWeight, random_quantized

KERNELS = [Kernels()] + ([Kernels(cpu=True, gemm="inflight")] if cpu_kernels.load() else [])


def _parts(gen: torch.Generator) -> list[QuantizedWeight | torch.Tensor]:
    # q and k in Q5_0, v in Q8_0 (llama.cpp's Q4_K_M where rows are not whole 256s), and a float part.
    return [
        random_quantized("Q5_0", 64, 96, gen),
        random_quantized("Q5_0", 32, 96, gen),
        random_quantized("Q8_0", 32, 96, gen),
        torch.randn(16, 96, generator=gen) * 0.01,
    ]


def test_mixed_parts_are_stacked_and_one_format_is_concatenated() -> None:
    gen = torch.Generator().manual_seed(0)
    parts = _parts(gen)
    stacked = _cat(parts)
    assert isinstance(stacked, StackedWeight)
    assert (stacked.out_features, stacked.in_features, stacked.splits) == (144, 96, (64, 32, 32, 16))
    assert stacked.nbytes == sum(p.nbytes for p in parts)
    same = _cat(parts[:2])
    assert isinstance(same, QuantizedWeight) and same.out_features == 96
    assert isinstance(_cat([parts[3], parts[3]]), torch.Tensor)
    with pytest.raises(ValueError, match="share in_features"):
        StackedWeight.of([parts[0], random_quantized("Q8_0", 32, 64, gen)])


@pytest.mark.parametrize("kernels", KERNELS, ids=lambda k: "cpu" if k.cpu else "torch")
@pytest.mark.parametrize("rows", [1, 5, QUANT_KERNEL_MAX_ROWS + 7])
def test_a_stacked_linear_is_the_fused_float_product(kernels: Kernels, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    stacked = StackedWeight.of(_parts(gen))
    bias = torch.randn(stacked.out_features, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    expected = x @ stacked.dequantize().T + bias
    layer = Linear(stacked, kernels, bias)
    assert (layer.out_features, layer.in_features) == (144, 96)
    out = layer(x)
    assert out.shape == (rows, 144)
    # The integer path rounds x to int8 blocks on a few rows: within a percent of the float product.
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-3)
    # Each part's columns are its own: a part's product alone lands where the stack puts it.
    start = 64 + 32
    v_only = x @ stacked.parts[2].dequantize().T + bias[start : start + 32]  # type: ignore[union-attr]
    torch.testing.assert_close(out[:, start : start + 32], v_only, rtol=2e-2, atol=2e-3)
