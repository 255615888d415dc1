"""``python -m bench host``: the summary's arithmetic on known samples, and a short real sampling."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from bench.cli import main
from bench.host_drift import correlation, summarize


def test_summary_is_relative_to_the_median_with_the_means_of_longer_spans() -> None:
    # 0.5 s windows: 20 at the median rate, then 20 at 1.5x (a neighbour went quiet for 10 s).
    rates = [100.0] * 20 + [150.0] * 20 + [100.0] * 80
    s = summarize(rates, 0.5)
    assert s["windows"] == 120 and s["lowest"] == 1.0 and s["highest"] == 1.5
    assert s["off_by_20pct_share"] == pytest.approx(20 / 120)
    # 10 s means: the second is the fast spell; 30 s: (20 * 1 + 20 * 1.5 + 20 * 1) / 60 and 1;
    # 60 s: all of it, 130 / 120.
    assert s["means"]["10s"][:3] == (1.0, 1.5, 6)
    assert s["means"]["30s"][:3] == (1.0, pytest.approx(7 / 6), 2)
    assert s["means"]["60s"][:3] == (pytest.approx(13 / 12), pytest.approx(13 / 12), 1)
    # How far two spans differ, one sigma in log: sqrt(2) x the sample deviation of their logs;
    # two 30 s means 1 and 7/6 deviate by ln(7/6) / sqrt(2), so two such spans differ by ln(7/6).
    assert s["means"]["30s"][3] == pytest.approx(math.log(7 / 6))
    ten = [0.0, math.log(1.5), 0.0, 0.0, 0.0, 0.0]
    assert s["means"]["10s"][3] == pytest.approx(math.sqrt(2) * statistics.stdev(ten))
    assert math.isnan(s["means"]["60s"][3])  # one span: nothing to compare
    assert correlation([1.0, 2.0, 3.0], [2.0, 4.0, 6.5]) > 0.99
    assert correlation([1.0, 2.0, 3.0], [1.0, 1.0, 1.0]) != correlation([1.0, 2.0, 3.0], [1.0, 1.0, 1.0])


def test_host_command_samples_every_core(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results" / "host.json"  # its folder is made
    assert main(["host", "--seconds", "1.5", "--window", "0.25", "--cores", "1", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    (rates,) = payload["rates"].values()
    # At least one window per core, each with a rate: how many fit in 1.5 s depends on how busy the
    # host is (a window ends with the GEMM that crosses it), so the count is not asserted.
    assert len(rates) >= 1 and all(r > 0 for r in rates)
    assert "windows of 0.25 s" in capsys.readouterr().out
