"""The CPU engine's own packed linear kernels (engine/kernels/cpu/gemm.cpp) against torch in float64,
over row counts on both sides of the 8-row register block, out features that end in a 16-, 32- or
48-wide column group, odd and even in features, with and without a bias; which path a CPU engine
takes (engine/models/cpu_gemm.py). A model served on them: tests/engine/test_cpu_gemm_engine.py."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu as cpu_kernels
from engine.models import cpu_gemm, onednn

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels cannot be built here")

_ROWS = [1, 2, 7, 8, 9, 16, 17, 33]


def _needs(dtype: torch.dtype) -> None:
    if not cpu_gemm.supported(dtype):
        pytest.skip(f"this CPU lacks the instructions of the {dtype} kernel")


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "out_features,in_features", [(16, 1), (32, 7), (48, 64), (80, 33), (96, 576), (112, 130)]
)
def test_packed_linear_matches_torch(dtype: torch.dtype, out_features: int, in_features: int) -> None:
    _needs(dtype)
    gen = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    packed = cpu_gemm.pack(w)
    assert packed.dim() == 3 and cpu_gemm.features(packed)[0] == out_features
    for rows in _ROWS:
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        for b in (None, bias):
            got = cpu_gemm.linear(x, packed, b)
            assert got.shape == (rows, out_features) and got.dtype == dtype
            ref = _reference(x, w, b)
            if dtype == torch.float32:
                # One float32 sum per output: off by rounding alone.
                scale = x.double().abs() @ w.double().abs().T + 1
                assert ((got.double() - ref).abs() / scale).max() < 1e-6, (rows, b is None)
            else:
                # float32 sums rounded once to bf16: within one bf16 step of the exact result.
                step = ref.abs() * 2.0**-8 + 1e-3 * (x.double().abs() @ w.double().abs().T)
                assert ((got.double() - ref).abs() <= step).all(), (rows, b is None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_and_empty_input(dtype: torch.dtype) -> None:
    _needs(dtype)
    w = torch.randn(64, 40).to(dtype)
    packed = cpu_gemm.pack(w)
    wide = torch.randn(5, 100).to(dtype)
    x = wide[:, 10:50]  # rows 100 apart: read in place
    assert torch.equal(cpu_gemm.linear(x, packed), cpu_gemm.linear(x.contiguous(), packed))
    columns = torch.randn(40, 5).to(dtype).T  # not contiguous within a row: copied first
    assert torch.equal(cpu_gemm.linear(columns, packed), cpu_gemm.linear(columns.contiguous(), packed))
    assert cpu_gemm.linear(torch.empty(0, 40, dtype=dtype), packed).shape == (0, 64)


def test_bad_shapes_are_refused() -> None:
    _needs(torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_gemm.pack(torch.randn(20, 8))
    packed = cpu_gemm.pack(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="k does not match"):
        cpu_gemm.linear(torch.randn(3, 9), packed)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_gemm.linear(torch.randn(3, 8).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_gemm.linear(torch.randn(3, 8), packed, torch.randn(31))
    assert not cpu_gemm.packable(torch.randn(20, 8))
    assert not cpu_gemm.packable(torch.randn(32, 7).bfloat16())  # odd pairs: features() could not tell
    assert cpu_gemm.packable(torch.randn(32, 7))


@pytest.mark.parametrize(
    "env,flags,dtype,expected",
    [
        ("auto", {"avx512f", "avx512_bf16"}, torch.bfloat16, "inflight"),
        ("auto", {"avx512f", "avx512_bf16", "amx_bf16"}, torch.bfloat16, "onednn"),  # AMX tiles win
        ("auto", {"avx512f", "avx512_bf16", "amx_bf16"}, torch.float32, "inflight"),  # AMX has no float32
        ("auto", {"avx2", "fma"}, torch.float32, "onednn"),
        ("inflight", {"avx2", "fma"}, torch.float32, "onednn"),  # asked for, cannot run: the next best
        ("inflight", {"avx512f", "avx512_bf16", "amx_bf16"}, torch.bfloat16, "inflight"),
        ("onednn", {"avx512f", "avx512_bf16"}, torch.bfloat16, "onednn"),
        ("torch", {"avx512f", "avx512_bf16"}, torch.float32, "torch"),
    ],
)
def test_the_path_follows_the_host(
    monkeypatch: pytest.MonkeyPatch, env: str, flags: set[str], dtype: torch.dtype, expected: str
) -> None:
    monkeypatch.setenv("INFLIGHT_CPU_GEMM", env)
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(onednn, "cpu_flags", lambda: frozenset(flags | {"avx512bw", "avx512vl", "avx512dq"}))
    # Whether the compiled code itself can run here is the real CPU's answer: taken as yes.
    monkeypatch.setattr(torch.ops.inflight_cpu, "packed_linear_supported", lambda _dtype: True, raising=False)
    if not torch.backends.mkldnn.is_available() and expected == "onednn":
        expected = "torch"
    assert cpu_gemm.choose(dtype, cpu_kernels=True) == expected
    assert cpu_gemm.choose(dtype, cpu_kernels=False) in ("onednn", "torch")


def test_the_gemm_bench_prints_every_path_per_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    _needs(torch.float32)
    from bench import cpu_gemm_bench

    argv = ["--rows", "1,9", "--repeats", "1", "--dtypes", "float32", "--layers", "2", "--hidden", "64"]
    argv += ["--intermediate", "96", "--heads", "2", "--kv-heads", "1", "--head-dim", "32", "--vocab", "160"]
    assert cpu_gemm_bench.main([*argv, "--torch"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("float32")]
    assert [int(r[1]) for r in rows] == [1, 9]
    for row in rows:
        own_ms, rate, torch_ms = float(row[2]), float(row[3]), float(row[6])
        assert own_ms > 0 and rate > 0 and torch_ms > 0
        if onednn.can_prepack(torch.float32):  # times print to 0.01 ms: the ratio, from the unrounded
            assert float(row[4]) > 0 and float(row[5]) > 0
