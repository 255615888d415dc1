"""The CPU attention benchmark's harness on a tiny case: caches hold the same values in every layout,
and a run prints a row per dtype."""

from __future__ import annotations

import pytest
import torch

from bench import cpu_attention_bench as bench
from engine.attention.backend import KVLayout
from engine.kernels import cpu as cpu_kernels
from engine.platform import memory


def test_caches_hold_the_same_values_in_each_layout():
    shape = bench.Shape(seqs=3, context=20, block_size=8)
    layouts = [KVLayout.TOKEN_MAJOR, KVLayout.HEAD_MAJOR, KVLayout.HEAD_MAJOR_KT]
    (token, head, kt), tables = bench.make_caches(shape, torch.float32, 2, layouts)
    assert len(token) == len(head) == len(kt) == 2
    assert head[0].shape == kt[0].shape == (2, 3 * 3 + 1, 3, 8, 64) and head[0].is_contiguous()
    assert torch.equal(KVLayout.HEAD_MAJOR.token_major_view(head[1]), token[1])
    assert torch.equal(KVLayout.HEAD_MAJOR_KT.to_token_major(kt[1]), token[1])
    assert torch.equal(kt[1][1], head[1][1])  # V pages alike; K pages key-interleaved
    assert not torch.equal(kt[1][0], head[1][0])
    assert not torch.equal(token[0], token[1])  # a cache per layer, not one repeated
    assert tables.shape == (3, 3) and len(set(tables.flatten().tolist())) == 9


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels could not be built here")
def test_smoke_prints_a_row_per_dtype(capsys):
    assert bench.main(["--seqs", "2", "--context", "40", "--layers", "2", "--sweeps", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("float32", "bfloat16"))]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("float32", "current", "head-major-kt"),
        ("bfloat16", "current", "head-major-kt"),
    ]
    assert all(float(r[3]) > 0 for r in rows)


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels could not be built here")
def test_small_pages_row_times_the_same_kernel_on_4k_pages(capsys):
    args = ["--seqs", "2", "--context", "40", "--layers", "2", "--sweeps", "2", "--dtypes", "float32"]
    assert bench.main([*args, "--small-pages"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("float32")]
    assert [r[1] for r in rows] == ["4k-pages", "current"]
    assert float(rows[0][5].rstrip("x")) == 1.0  # the first row is the reference


def test_caches_on_huge_pages_unless_asked():
    shape = bench.Shape(seqs=8, context=512)  # 3 MiB a cache: past one huge page
    (huge, small), _ = bench.make_caches(
        shape, torch.float32, 1, [KVLayout.HEAD_MAJOR_KT] * 2, small_pages=[False, True]
    )
    assert torch.equal(huge[0], small[0])
    if memory.thp_available():
        assert huge[0].data_ptr() % (2 << 20) == 0
