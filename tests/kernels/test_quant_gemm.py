"""The C++ linear kernels on GGUF block formats (engine/kernels/cpu/quant_gemm.cpp) against the float64
product of the dequantized weight, on every instruction set this host has (portable, AVX2, AVX-512):
each format x rows 1..33 and 64 (both sides of the two-row step) x two in features (whole blocks of 32,
or of 256 for K-quants) x odd and even out features (a partial last tile of four rows).

Tolerance, float32 x: each output is one float32 sum of k products of exact float32 values, so
|got - exact| <= 1e-6 * sum_k |x_k w_k| (k <= 512: about 16 units of float32 roundoff, at a loose
bound) + 2^-23 |exact| (the bias added, rounded once). bf16 x: the same sum rounded once to bf16, so
within 2^-8 of |exact| more.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu as cpu_kernels
from engine.quant import FORMATS, QuantizedWeight, random_quantized
from engine.quant.linear import CPU_ISAS, cpu_isa, path_for, quant_linear

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels cannot be built here")

_ROWS = [*range(1, 34), 64]


def _isas() -> list[int]:
    return list(range(int(torch.ops.inflight_cpu.quant_linear_isa()) + 1))


def _in_features(name: str) -> list[int]:
    return [256, 512] if FORMATS[name].block_size == 256 else [32, 96]


def _run(
    x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None, isa: int = -1
) -> torch.Tensor:
    out: torch.Tensor = torch.ops.inflight_cpu.quant_linear(
        x, w.blocks, w.fmt.ggml_type, w.in_features, bias, isa
    )
    return out


def _check(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    exact = x.double() @ weight.double().T
    if bias is not None:
        exact = exact + bias.double()
    bound = 1e-6 * (x.double().abs() @ weight.double().abs().T) + exact.abs() * 2.0**-23
    if got.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0**-8
    assert got.shape == exact.shape
    assert ((got.double() - exact).abs() <= bound).all(), float(((got.double() - exact).abs() / bound).max())


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_path_dequantizes_like_gguf(name: str) -> None:
    gen = torch.Generator().manual_seed(1)
    w = random_quantized(name, 9, 2 * FORMATS[name].block_size, gen)
    expected = w.dequantize()  # equals gguf's own dequantize: tests/engine/test_quant_formats.py
    for isa in _isas():
        got = torch.ops.inflight_cpu.quant_dequantize(w.blocks, w.fmt.ggml_type, w.in_features, isa)
        assert torch.equal(got, expected), CPU_ISAS[isa]
        # Straight to bf16: torch's rounding of the float32 values, with no float32 copy in between.
        got = torch.ops.inflight_cpu.quant_dequantize(w.blocks, w.fmt.ggml_type, w.in_features, isa, True)
        assert got.dtype == torch.bfloat16 and torch.equal(got, expected.bfloat16()), CPU_ISAS[isa]


@pytest.mark.parametrize("name", list(FORMATS))
def test_quant_linear_matches_float64_over_the_grid(name: str) -> None:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    for in_features in _in_features(name):
        for out_features in (7, 10):
            w = random_quantized(name, out_features, in_features, gen)
            weight = w.dequantize()
            bias = torch.randn(out_features, generator=gen)
            x_all = torch.randn(max(_ROWS), in_features, generator=gen)
            for isa in _isas():
                for rows in _ROWS:
                    x = x_all[:rows]
                    b = bias if rows % 2 else None
                    _check(_run(x, w, b, isa), x, weight, b)
                    assert _run(x, w, b, isa).dtype == torch.float32


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K"])
def test_bf16_inputs_give_bf16_within_one_rounding(name: str) -> None:
    gen = torch.Generator().manual_seed(7)
    w = random_quantized(name, 20, 256, gen)
    bias = torch.randn(20, generator=gen).bfloat16()
    for isa in _isas():
        for rows in (1, 2, 5, 16):
            x = torch.randn(rows, 256, generator=gen).bfloat16()
            got = _run(x, w, bias, isa)
            assert got.dtype == torch.bfloat16
            _check(got, x, w.dequantize(), bias)


def test_the_host_path_is_the_best_the_cpu_has() -> None:
    from engine.platform.cpu import cpu_flags

    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags:
        assert cpu_isa() == "avx512_vnni"
    elif {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        assert cpu_isa() == "avx512"
    elif {"avx2", "fma"} <= flags:
        assert cpu_isa() == "avx2"
    assert path_for(torch.device("cpu")) == "cpu"
    with pytest.raises(RuntimeError, match="lacks the instructions"):
        _run(torch.randn(1, 32), random_quantized("Q8_0", 4, 32, torch.Generator()), isa=len(_isas()))


def test_shards_and_fusions_are_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = (random_quantized("Q4_K", n, 256, gen) for n in (12, 4, 4))
    fused = QuantizedWeight.cat_rows([q, k, v])
    x = torch.randn(3, 256, generator=gen)
    whole = quant_linear(x, fused)
    assert torch.equal(whole, torch.cat([quant_linear(x, part) for part in (q, k, v)], dim=1))
    shard = fused.narrow_rows(4, 14)
    assert shard.out_features == 10 and torch.equal(shard.dequantize(), fused.dequantize()[4:14])
    assert torch.equal(quant_linear(x, shard.to("cpu")), quant_linear(x, QuantizedWeight.cat_rows([shard])))


def test_strided_empty_and_refused_inputs() -> None:
    gen = torch.Generator().manual_seed(5)
    w = random_quantized("Q4_0", 6, 64, gen)
    wide = torch.randn(4, 100, generator=gen)
    x = wide[:, 10:74]  # rows 100 apart: read in place
    assert torch.equal(quant_linear(x, w), quant_linear(x.contiguous(), w))
    columns = torch.randn(64, 4, generator=gen).T  # copied first
    assert torch.equal(quant_linear(columns, w), quant_linear(columns.contiguous(), w))
    assert quant_linear(torch.empty(0, 64), w).shape == (0, 6)
    with pytest.raises(ValueError, match=r"x must be \[T, 64\]"):
        quant_linear(torch.randn(2, 32), w)
    with pytest.raises(RuntimeError, match="bytes a row"):
        torch.ops.inflight_cpu.quant_linear(torch.randn(2, 32), w.blocks, w.fmt.ggml_type, 32, None)
    with pytest.raises(RuntimeError, match="unsupported block format"):
        torch.ops.inflight_cpu.quant_linear(torch.randn(2, 64), w.blocks, 10, 64, None)  # Q2_K: not served
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.inflight_cpu.quant_linear(torch.randn(2, 64), w.blocks, w.fmt.ggml_type, 64, torch.zeros(5))


def test_the_bench_prints_each_format_per_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import quant_gemm_bench

    argv = ["--formats", "Q8_0", "Q4_K", "--rows", "1,3", "--repeats", "1", "--dtypes", "float32"]
    argv += ["--layers", "1", "--hidden", "64", "--intermediate", "96", "--heads", "2", "--kv-heads", "1"]
    assert quant_gemm_bench.main([*argv, "--head-dim", "32"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("Q")]
    assert [(r[0], int(r[2])) for r in rows] == [("Q8_0", 1), ("Q8_0", 3), ("Q4_K", 1), ("Q4_K", 3)]
    assert all(float(value) >= 0 for row in rows for value in row[3:])  # tiny shapes may print 0.00
