"""The real-engine policy benchmark (``python -m bench policies``) end to end on the tiny model: one
bursty cell, four policies, the table, JSON and plot. Structure and accounting only; how the policies
rank is the full run's finding, not a test's (a two-second run on a shared host)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.cli import main
from bench.policy_bench import POLICIES, steady_rate
from engine.cost_model import StepCostModel
from inflight.plan.policies import by_met_load, ceiling, paired_ratios


def one_cell(model: Path, tmp_path: Path, out: Path, duration: str) -> list[str]:
    """The benchmark on the tiny model, one bursty cell at 1.2x."""
    # A cost model of the right order for the tiny engine (1 ms a step, 20 us a token): the slo
    # policies' estimates only need to be plausible here, and calibrating would take longer than the run.
    cost = tmp_path / "cost.json"
    StepCostModel(0.001, 2e-5, 1e-5, 1e-8).save(cost)
    args = ["policies", "--model", str(model), "--cost", str(cost)]
    args += ["--cvs", "4", "--loads", "1.2", "--duration", duration, "--out", str(out)]
    # A tight TTFT bound, so that at 1.2x capacity in bursts some requests miss it.
    return [*args, "--slo", "ttft:150", "tpot:50", "--max-num-seqs", "8"]


def test_real_policy_benchmark_runs_and_accounts_for_every_request(
    tiny_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pol"
    args = [*one_cell(tiny_model_path, tmp_path, out, "1.5"), "--max-num-batched-tokens", "128"]
    assert main(args) == 0

    result = json.loads((out / "policies.json").read_text())
    assert result["source"] == "measured" and result["capacity_req_s"] > 0
    assert result["slo"] == {"ttft_s": 0.15, "tpot_s": 0.05}
    rows = result["rows"]
    assert [r["policy"] for r in rows] == list(POLICIES)
    # The same requests for every policy.
    assert len({r["num_requests"] for r in rows}) == 1 and rows[0]["num_requests"] >= 4
    for r in rows:
        assert 0 <= r["num_good"] <= r["num_completed"] <= r["num_requests"], r
        # Goodput is the SLO-meeting requests over the run, never more than completions over it.
        assert r["goodput_req_s"] == pytest.approx(r["num_good"] / r["duration_s"], rel=1e-9)
        assert r["goodput_req_s"] <= r["num_completed"] / r["duration_s"] + 1e-12
        assert r["duration_s"] > 0 and r["output_tok_s"] > 0
        if r["policy"] != "slo+reject":
            # Nothing is dropped: every request completes, late or not.
            assert r["num_rejected_slo"] == 0 and r["num_completed"] == r["num_requests"], r
            assert math.isfinite(r["ttft_p99_s"]) and math.isfinite(r["tpot_p99_s"])
    rejecting = rows[POLICIES.index("slo+reject")]
    # A rejected request is never also counted completed (or good).
    assert rejecting["num_completed"] + rejecting["num_rejected_slo"] == rejecting["num_requests"]

    assert (out / "policies.png").stat().st_size > 1000
    text = capsys.readouterr().out
    assert "measured burst" in text and all(p in text for p in POLICIES)


def test_repeats_pair_each_policy_with_the_fcfs_run_beside_it(
    tiny_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pol"
    args = [*one_cell(tiny_model_path, tmp_path, out, "1.0"), "--repeats", "2"]
    args += ["--policies", "slo+reject,fcfs"]
    assert main(args) == 0
    result = json.loads((out / "policies.json").read_text())
    assert result["repeats"] == 2
    assert [(r["repeat"], r["policy"]) for r in result["rows"]] == [
        (0, "fcfs"),
        (0, "slo+reject"),
        (1, "fcfs"),
        (1, "slo+reject"),
    ]
    text = capsys.readouterr().out
    assert "median [lowest, highest]" in text and "priority" not in text
    # Each run measured the host's level against the cost model, and the load it met from it.
    assert result["capacity_host_level"] > 0
    for r in result["rows"]:
        assert r["host_level"] > 0
        assert r["effective_load"] == pytest.approx(1.2 * r["host_level"] / result["capacity_host_level"])
    assert "pairs by the load they met" in text
    for policies, why in (("slo,priority", "include it"), ("fcfs,edf", "unknown policies")):
        bad = [*args[: args.index("--policies")], "--policies", policies]
        with pytest.raises((SystemExit, ValueError), match=why):
            main(bad)


def test_a_run_can_pin_an_earlier_runs_capacity(tiny_model_path: Path, tmp_path: Path, capsys: Any) -> None:
    # The second run takes the first's capacity and host level instead of timing its own burst, so
    # its 1.2x is the same arrival rate; a capacity measured on other settings is refused.
    def fcfs_cell(name: str, *extra: str) -> list[str]:
        return [*one_cell(tiny_model_path, tmp_path, tmp_path / name, "1.0"), "--policies", "fcfs", *extra]

    assert main(fcfs_cell("first")) == 0
    pinned = tmp_path / "first" / "policies.json"
    earlier = json.loads(pinned.read_text())
    assert earlier["capacity_pinned"] is False and earlier["cost_terms"]["fixed"] == pytest.approx(1e-3)
    capsys.readouterr()
    pin = ["--capacity-from", str(pinned)]
    assert main(fcfs_cell("second", *pin)) == 0
    result = json.loads((tmp_path / "second" / "policies.json").read_text())
    assert result["capacity_pinned"] is True
    assert result["capacity_req_s"] == earlier["capacity_req_s"]
    assert result["capacity_host_level"] == earlier["capacity_host_level"]
    [row] = result["rows"]
    assert row["rate"] == pytest.approx(1.2 * earlier["capacity_req_s"])
    assert row["effective_load"] == pytest.approx(1.2 * row["host_level"] / earlier["capacity_host_level"])
    text = capsys.readouterr().out
    assert "pinned: measured earlier" in text and "pinned: an earlier run's measured burst" in text
    assert "measured burst of" not in text and "(measured burst)" not in text
    other = fcfs_cell("third", *pin)
    other[other.index("--max-num-seqs") + 1] = "4"
    with pytest.raises(ValueError, match="engine settings"):
        main(other)
    # A run from before results recorded their cost model cannot be checked, so it is refused too.
    older = tmp_path / "older.json"
    older.write_text(json.dumps({k: v for k, v in earlier.items() if k != "cost_terms"}))
    with pytest.raises(ValueError, match="records no cost model"):
        main(fcfs_cell("fourth", "--capacity-from", str(older)))


def test_paired_ratios_divide_by_the_fcfs_run_of_the_same_repeat() -> None:
    rows = [
        {"cv": 2.0, "load": 1.0, "repeat": 0, "policy": "fcfs", "goodput_req_s": 2.0},
        {"cv": 2.0, "load": 1.0, "repeat": 0, "policy": "slo+reject", "goodput_req_s": 3.0},
        {"cv": 2.0, "load": 1.0, "repeat": 1, "policy": "fcfs", "goodput_req_s": 4.0},
        {"cv": 2.0, "load": 1.0, "repeat": 1, "policy": "slo+reject", "goodput_req_s": 5.0},
    ]
    ratios = paired_ratios(rows)
    assert ratios[(2.0, 1.0, "slo+reject")] == [1.5, 1.25]
    assert ratios[(2.0, 1.0, "fcfs")] == [1.0, 1.0]


def test_capacity_is_the_saturated_middle_of_the_burst() -> None:
    # 40 completions: the first ten trickle in over 3.6 s (the prefill wall), the middle ones at 10 a
    # second from 4 s to 6 s, the last nine over 4.5 s (the drain). Capacity is the middle's rate, not
    # 40 / 10.5 s.
    ends = [0.4 * (i + 1) for i in range(10)]
    ends += [4.0 + 0.1 * i for i in range(21)]
    ends += [6.0 + 0.5 * (i + 1) for i in range(9)]
    assert steady_rate(ends) == pytest.approx(10.0)
    with pytest.raises(RuntimeError):
        steady_rate([1.0, 2.0])


def test_pairs_are_regrouped_by_the_load_they_met() -> None:
    def run(rep: int, policy: str, goodput: float, met: float) -> dict[str, object]:
        return {
            "cv": 2.0,
            "load": 1.2,
            "repeat": rep,
            "policy": policy,
            "goodput_req_s": goodput,
            "effective_load": met,
        }

    rows = [
        run(0, "fcfs", 4.0, 0.8),
        run(0, "slo+reject", 4.4, 0.9),  # met 0.85: below saturation
        run(1, "fcfs", 2.0, 1.3),
        run(1, "slo+reject", 3.0, 1.1),  # met 1.2
        run(2, "fcfs", 0.0, 1.0),
        run(2, "slo+reject", 1.0, 1.0),  # met 1.0, fcfs met nothing
    ]
    grouped = by_met_load(rows)  # type: ignore[arg-type]
    assert [label for _, label, _ in grouped] == ["<0.9", "0.9-1.1", ">=1.1"]  # by load, not by name
    assert grouped == {
        (2.0, "<0.9", "slo+reject"): [pytest.approx(1.1)],
        (2.0, ">=1.1", "slo+reject"): [1.5],
        (2.0, "0.9-1.1", "slo+reject"): [math.inf],
    }
    # The ceiling of each pair: fcfs's requests over those it met (40 of 50, 20 of 50, none of 50).
    for rep, good in ((0, 40), (1, 20), (2, 0)):
        rows[2 * rep].update(num_requests=50, num_good=good)
    tops = by_met_load(rows, value=lambda base, _: ceiling(base))  # type: ignore[arg-type]
    assert tops == {
        (2.0, "<0.9", "slo+reject"): [1.25],
        (2.0, ">=1.1", "slo+reject"): [2.5],
        (2.0, "0.9-1.1", "slo+reject"): [math.inf],
    }
    assert math.isnan(ceiling({"goodput_req_s": 1.0}))  # rows kept before the counts were
