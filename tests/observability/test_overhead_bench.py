"""The tracing-overhead benchmark runs end to end on a tiny workload (its figures are for the report)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.tracing_overhead import COMPARED, main


@pytest.mark.serial  # compares the timed cost of the span listener on and off
def test_benchmark_runs_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    assert main(["--rounds", "1", "--requests", "2", "--step-sample-every", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["overhead_pct_wall"]) == set(COMPARED)
    assert result["steps_per_round"] > 0 and result["spans_exported"] > 0
    assert 0 < result["listener_us_per_step"]["off"] < result["listener_us_per_step"]["on"]
    assert all(len(rounds) == 1 for rounds in result["round_wall_s"].values())
