"""The commands end to end on the tiny model: files written, every target generating exact lengths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cli import main
from bench.targets import TargetConfig, make_target
from inflight.plan.workload import RequestSpec


def test_sweep_and_trace_commands(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    trace = tmp_path / "trace.json"
    argv = ["sweep", "--model", str(tiny_model), "--out", str(out), "--targets", "continuous,static"]
    argv += ["--rates", "40", "--num-requests", "6", "--max-num-seqs", "4", "--threads", "1"]
    argv += ["--prompt-short", "4,12", "--prompt-long", "20,40", "--output-len", "2,6"]
    argv += [
        "--slo",
        "ttft:5000",
        "tpot:1000",
        "--trace-out",
        str(trace),
        "--engine-arg",
        "max_num_batched_tokens=64",
    ]
    assert main(argv) == 0
    result = json.loads((out / "sweep.json").read_text())
    assert set(result["sweep"]) == {"continuous", "static"}
    for rows in result["sweep"].values():
        assert [r["offered_rate"] for r in rows] == [40.0]
        assert all(r["num_completed"] == 6 and "goodput" in r for r in rows)
    for name in (
        "sweep.png",
        "cdf_poisson-40.png",
        "engine_poisson-40.png",
        "batch_timeline_static_poisson-40.png",
    ):
        assert (out / name).stat().st_size > 1000
    runs = sorted((out / "runs").glob("*.json"))
    assert len(runs) == 2
    assert json.loads(runs[0].read_text())["config"]["max_num_batched_tokens"] == 64
    assert len(json.loads(trace.read_text())["traceEvents"]) > 50

    again = tmp_path / "again.json"
    timelines = tmp_path / "timelines.json"
    assert main(["trace", str(runs[0]), "--trace-out", str(again), "--timelines-out", str(timelines)]) == 0
    assert json.loads(again.read_text())["traceEvents"]
    assert len(next(iter(json.loads(timelines.read_text()).values()))) == 6


def test_bad_arguments_fail_loudly(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["nonsense"])
    with pytest.raises(ValueError, match="SLO"):
        main(["sweep", "--model", str(tiny_model), "--out", str(tmp_path), "--slo", "ttft=5"])


@pytest.mark.parametrize("name", ["hf-batch", "hf-generate"])
def test_hf_peers_generate_exact_lengths(tiny_model: Path, name: str) -> None:
    pytest.importorskip("transformers")
    specs = [
        RequestSpec("a", 0.0, tuple(range(5, 17)), 5),
        RequestSpec("b", 0.0, tuple(range(30, 34)), 3),
        RequestSpec("c", 0.05, tuple(range(40, 60)), 4),
    ]
    target = make_target(name, TargetConfig(model=str(tiny_model), max_num_seqs=4, max_model_len=64))
    try:
        target.warmup(specs[:1])
        run = target.run(specs, "t", 20.0)
    finally:
        target.close()
    by_id = {r.request_id: r for r in run.requests}
    for s in specs:
        r = by_id[s.request_id]
        assert r.num_output_tokens == s.max_tokens and r.error is None
        assert r.arrival == s.arrival and r.ttft is not None and r.ttft > 0
        assert r.token_times == sorted(r.token_times)
