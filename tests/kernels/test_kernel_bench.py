"""The kernel benchmark's harness runs end to end on a tiny case (interpreter on CPU)."""

from __future__ import annotations

import json

from bench import kernel_bench


def test_smoke_writes_report(tmp_path, capsys):
    assert kernel_bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "kernel_bench.json").read_text())
    assert [r["num_splits"] for r in report["results"]] == [None, 1]
    assert all(r["time_us"] > 0 and r["bytes_moved"] > 0 for r in report["results"])
    assert "of copy" in capsys.readouterr().out
