"""bf16 linear layers at decode sizes on AMX tiles over oneDNN's packed weights (engine/kernels/cpu/
amx_gemm.cpp, engine/models/amx_gemm.py): the layout proven before it is trusted, the products against
oneDNN's and float64's, and which rows take which path. Skipped where the CPU has no AMX (the kernel
cannot run there; nothing stands in for the tiles). A model served on it: tests/engine/
test_cpu_gemm_engine.py."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu as cpu_kernels
from engine.layers.kernels import Kernels
from engine.layers.linear import Linear
from engine.models import amx_gemm, onednn

pytestmark = pytest.mark.skipif(
    not (cpu_kernels.load() and amx_gemm.supported() and onednn.can_prepack(torch.bfloat16)),
    reason="this CPU has no AMX bf16 tiles (or the C++ kernels or oneDNN's packing are missing)",
)


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen).bfloat16()


def _shared(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(oneDNN's packed weight, its panels, a bias) of a random [n, k] bf16 weight; the panels are the
    packed weight's memory, so a test holds both."""
    w, bias = _weights(n, k, seed)
    packed = onednn.pack(w, 64)
    assert amx_gemm.attach(packed, w)
    panels = amx_gemm.panels_of(packed)
    assert panels is not None
    return packed, panels, bias


def count_tile_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every call that reaches the tile kernel from now on (the engine's tests use it too)."""
    rows: list[int] = []
    real = amx_gemm.linear

    def counted(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows.append(x.shape[0])
        return real(x, panels, bias)

    monkeypatch.setattr(amx_gemm, "linear", counted)
    return rows


@pytest.mark.parametrize(
    "n,k,hint",
    # SmolLM2-135M's qkv, o, gate_up, down and a slice of its LM head at the engine's packing hint;
    # a panel of 64 (what oneDNN picks for 960 at a hint of one row); one panel; small k.
    [
        (960, 576, 64),
        (576, 576, 64),
        (3072, 576, 64),
        (576, 1536, 64),
        (4096, 576, 64),
        (960, 576, 1),
        (32, 64, 16),
        (160, 32, 256),
    ],
)
def test_products_equal_onednn_on_its_own_weights(n: int, k: int, hint: int) -> None:
    w, bias = _weights(n, k, n + k + hint)
    packed = onednn.pack(w, hint)
    assert amx_gemm.attach(packed, w)
    panels = amx_gemm.panels_of(packed)
    assert panels is not None and panels.shape[0] * panels.shape[2] == n and panels.shape[1] * 2 == k
    gen = torch.Generator().manual_seed(k)
    for rows in (16, 32, 48, 64):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        for b in (None, bias):
            got = amx_gemm.linear(x, panels, b)
            theirs = onednn.linear(x, packed, b)
            exact = x.double() @ w.double().T + (0 if b is None else b.double())
            # float32 sums of the same products rounded once to bf16: within one bf16 step of the
            # exact result, and as a rule bit for bit oneDNN's (its order of the k-slices may differ).
            step = exact.abs() * 2.0**-8 + 1e-3 * (x.double().abs() @ w.double().abs().T)
            assert ((got.double() - exact).abs() <= step).all(), (rows, b is None)
            assert (got == theirs).double().mean() > 0.999, (rows, b is None)


def test_a_layout_that_does_not_read_back_is_refused() -> None:
    """attach proves the view equals the weight it was packed from: the same bytes offered as another
    weight's (or a dtype, shape, or k it does not serve) leave the weight with oneDNN."""
    w, _ = _weights(96, 64, 1)
    other, _ = _weights(96, 64, 2)
    packed = onednn.pack(w, 64)
    assert not amx_gemm.attach(packed, other)
    assert amx_gemm.panels_of(packed) is None
    assert not amx_gemm.attach(packed, w.float())  # not the weight's dtype
    odd_k, _ = _weights(64, 48, 3)  # k not a multiple of 32: AMX's rows of x are 32 bf16
    assert not amx_gemm.attach(onednn.pack(odd_k, 64), odd_k)
    assert not amx_gemm.attach(w, w)  # a plain tensor is not oneDNN's
    assert amx_gemm.attach(packed, w)


def test_rows_past_the_bound_or_off_the_tile_grain_take_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Linear on an engine with amx_rows=64: 16-64 rows (multiples of 16) on the tiles, 80 rows and 17
    rows (no row padding) on oneDNN; the outputs agree wherever each ran."""
    calls = count_tile_calls(monkeypatch)
    w, bias = _weights(256, 128, 4)
    kernels = Kernels(cpu=True, gemm="onednn", prepack_rows=64, amx_rows=amx_gemm.MAX_ROWS)
    layer = Linear(w, kernels, bias)
    plain = Linear(w, Kernels(cpu=True, gemm="onednn", prepack_rows=64), bias)
    assert amx_gemm.panels_of(plain.weight) is None
    for rows in (16, 17, 32, 64, 80):
        x = torch.randn(rows, 128).bfloat16()
        assert (layer(x) == plain(x)).double().mean() > 0.999, rows
    assert calls == [16, 32, 64]


def test_strided_rows() -> None:
    packed, panels, _ = _shared(64, 64, 5)
    wide = torch.randn(32, 128).bfloat16()
    x = wide[:, :64]  # rows 128 apart
    assert torch.equal(amx_gemm.linear(x, panels), amx_gemm.linear(x.contiguous(), panels))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        amx_gemm.linear(torch.randn(5, 64).bfloat16(), panels)
    assert amx_gemm.panels_of(packed) is panels  # held to here: the panels are its memory


def test_the_bench_times_the_tiles_at_whole_tiles_of_rows(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import cpu_gemm_bench

    argv = ["--rows", "16,9", "--repeats", "1", "--dtypes", "bfloat16", "--layers", "2", "--hidden", "64"]
    argv += ["--intermediate", "96", "--heads", "2", "--kv-heads", "1", "--head-dim", "32", "--vocab", "160"]
    assert cpu_gemm_bench.main(argv) == 0
    rows = {
        int(r[1]): r
        for r in (line.split() for line in capsys.readouterr().out.splitlines())
        if r[:1] == ["bfloat16"]
    }
    assert float(rows[16][7]) > 0 and float(rows[16][8]) > 0
    assert rows[9][7:] == ["-", "-"]


def test_threads_split_the_panels_and_agree_with_one() -> None:
    """Each thread configures its own tiles (the permission is the process's): two threads give the
    single thread's products bit for bit, between oneDNN calls on the same threads."""
    packed, panels, bias = _shared(3072, 576, 6)
    x = torch.randn(32, 576).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = amx_gemm.linear(x, panels, bias)
        torch.set_num_threads(2)
        onednn.linear(torch.randn(256, 576).bfloat16(), packed)  # oneDNN's own tile set-up in between
        two = amx_gemm.linear(x, panels, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
