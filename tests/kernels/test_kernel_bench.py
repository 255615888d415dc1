"""The kernel benchmark's harness runs end to end on tiny cases (interpreter on CPU): the figures,
a two-configuration sweep, and the best configuration per shape."""

from __future__ import annotations

import json

from bench import kernel_bench


def test_smoke_writes_report(tmp_path, capsys):
    assert kernel_bench.main(["--smoke", "--sweep", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "kernel_bench.json").read_text())
    assert [r["num_splits"] for r in report["results"]] == [None, 1]
    assert all(r["time_us"] > 0 and r["bytes_moved"] > 0 for r in report["results"])
    # Two configurations at the heuristic's splits, then the best one with forced counts 1 and 2.
    sweep = report["sweep"]
    assert len(sweep) == 2 + 2 and report["sweep_complete"] is True
    assert {s["config"]["block_n"] for s in sweep[:2]} == {None, 32}
    (best,) = report["sweep_best"].values()
    assert best["time_us"] == min(s["time_us"] for s in sweep)
    out = capsys.readouterr().out
    assert "of copy" in out and "best decode configuration per shape" in out


def test_sweep_covers_the_issue_grid():
    configs = kernel_bench.sweep_configs()
    assert len(configs) == 3 * 2 * 3 and len(set(configs)) == len(configs)
    assert {c.block_n for c in configs} == {32, 64, 128}
    assert {c.num_warps for c in configs} == {4, 8} and {c.num_stages for c in configs} == {2, 3, 4}


def test_best_per_case_picks_the_fastest():
    case = kernel_bench.DecodeCase(64, 1024)
    slow = kernel_bench.DecodeResult(case, None, 90.0, 1, 1.0, 0.5, kernel_bench.LaunchConfig(32, 4, 2))
    fast = kernel_bench.DecodeResult(case, 2, 60.0, 1, 1.5, 0.75, kernel_bench.LaunchConfig(128, 8, 3))
    other = kernel_bench.DecodeResult(kernel_bench.DecodeCase(1, 1024), None, 5.0, 1, 1.0, 0.1)
    best = kernel_bench.best_per_case([slow, fast, other])
    assert best["batch 64 context 1024 heads 32/8"] is fast
    assert best["batch 1 context 1024 heads 32/8"].config.label() == "default"
