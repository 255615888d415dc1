"""The under-load measurement of ``python -m bench service``: its figures from stream times and job
records, and one tiny run through a real loopback stack (broker, Redis, worker, gateway) beside the
engine alone. No timing is asserted: the run only has to complete and report every figure."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import process_cpu, service_bench, service_load, service_stages
from bench.service_replay import Streamed
from inflight.plan.workload import RequestSpec


def _spec(request_id: str, arrival: float, max_tokens: int) -> RequestSpec:
    return RequestSpec(request_id, arrival, (5, 6, 7), max_tokens)


def test_trace_figures_count_only_completed_requests() -> None:
    # a: arrives at 0, first text at 0.1 s, last at 0.4 s over 4 tokens (TPOT 0.1 s); b: arrives at 0.5,
    # first at 0.7 (TTFT 0.2 s); c: cut off before its last token (no "length"), left out.
    specs = [_spec("a", 0.0, 4), _spec("b", 0.5, 2), _spec("c", 0.6, 3)]
    streamed = [
        Streamed("a", first=0.1, last=0.4, finish_reason="length", lag=0.001),
        Streamed("b", first=0.7, last=0.8, finish_reason="length", lag=0.003),
        Streamed("c", first=0.9, last=1.5, finish_reason=None),
    ]
    f = service_load.trace_figures(specs, streamed)
    assert f["send_lag"]["p50_ms"] == pytest.approx(2.0)  # over the requests that recorded one
    assert f["num_completed"] == 2 and f["num_requests"] == 3
    assert f["ttft"]["p50_ms"] == pytest.approx(150.0) and f["ttft"]["p99_ms"] == pytest.approx(199.0)
    assert f["tpot"]["p50_ms"] == pytest.approx(100.0)
    assert f["output_tok_s"] == pytest.approx(6 / 0.8)


def test_saturation_counts_completions_until_a_full_batch_is_no_longer_possible() -> None:
    # 5 requests, batch bound 2: the window ends at the 3rd completion (2 s), when 2 are left.
    specs = [_spec(str(i), 0.0, 10) for i in range(5)]
    streamed = [
        Streamed(str(i), first=0.1, last=end, finish_reason="length")
        for i, end in enumerate([1, 2, 1.5, 4, 6])
    ]
    f = service_load.saturation_figures(specs, streamed, max_num_seqs=2)
    assert f["window_s"] == 2 and f["requests_per_s"] == pytest.approx(1.5)
    assert f["window_output_tok_s"] == pytest.approx(15.0) and f["run_output_tok_s"] == pytest.approx(50 / 6)
    # Fewer requests than the batch bound: never saturated, no figure.
    assert math.isnan(
        service_load.saturation_figures(specs[:2], streamed[:2], max_num_seqs=2)["requests_per_s"]
    )


def test_targets_allow_the_bursty_trace_twice_the_poisson_ones_added_ttft() -> None:
    def result(poisson_added: float, gamma_added: float) -> dict:
        trace = lambda added: {"ttft": {"p99_ms": 100.0 + added}}  # noqa: E731
        engine = {"ttft": {"p99_ms": 100.0}}
        return {
            "stack": {"poisson": trace(poisson_added), "gamma": trace(gamma_added)},
            "engine": {"poisson": engine, "gamma": engine},
            "throughput_ratio": 0.96,
        }

    verdicts = {k: v["passed"] for k, v in service_load.judge(result(24.0, 49.0)).items()}
    assert verdicts == {
        "poisson: TTFT p99 stack - engine (ms)": True,
        "gamma: TTFT p99 stack - engine (ms)": True,
        "saturation: throughput stack / engine": True,
    }
    missed = service_load.judge(result(26.0, 51.0))
    assert not missed["poisson: TTFT p99 stack - engine (ms)"]["passed"]
    assert not missed["gamma: TTFT p99 stack - engine (ms)"]["passed"]
    assert missed["gamma: TTFT p99 stack - engine (ms)"]["bound"] == "<= 50"


def test_stages_add_up_to_the_clients_ttft() -> None:
    # Sent at 100.000; the gateway enqueued at .004, the worker claimed at .012 and had its first token
    # 0.030 s after its fetch; the client read it at .050.
    s = Streamed("cmpl-1", sent_wall=100.0, first_wall=100.05, first=0.05, last=0.1, finish_reason="length")
    records = {"cmpl-1": {"created": "100.004", "started": "100.012", "ttft_worker_s": "0.030"}}
    got = service_stages.stages([s, Streamed("cmpl-2", sent_wall=100.0)], records)
    values = [got[name]["p50_ms"] for name in service_stages.STAGES]
    assert values == pytest.approx([4.0, 8.0, 30.0, 8.0])
    assert sum(values) == pytest.approx(50.0)
    assert {v["count"] for v in got.values()} == {1}  # the request without a record is left out
    assert not set(service_stages.WORKER_PARTS) & set(got)  # no engine core stamps, no split


def test_the_worker_stage_splits_at_the_engine_core_and_the_slowest_come_first() -> None:
    # As above, and the engine core took the request 0.002 s after the worker's fetch and sampled its first
    # token 0.020 s later: 0.008 s went back to the worker's stream.
    slow = Streamed(
        "cmpl-1", sent_wall=100.0, first_wall=100.05, first=0.05, last=0.1, finish_reason="length"
    )
    fast = Streamed(
        "cmpl-2", sent_wall=100.0, first_wall=100.02, first=0.02, last=0.1, finish_reason="length"
    )
    stamps = {"created": "100.004", "started": "100.012", "ttft_worker_s": "0.030"}
    records = {
        "cmpl-1": {**stamps, "engine_arrival_s": "0.002", "ttft_engine_s": "0.020"},
        "cmpl-2": {"created": "100.004", "started": "100.008", "ttft_worker_s": "0.006"},
    }
    got = service_stages.stages([slow], records)
    parts = [got[name]["p50_ms"] for name in service_stages.WORKER_PARTS]
    assert parts == pytest.approx([2.0, 20.0, 8.0])
    assert sum(parts) == pytest.approx(got["worker fetch -> first token"]["p50_ms"])
    top = service_stages.slowest([fast, slow], records, k=1)
    assert len(top) == 1 and top[0]["ttft ms"] == pytest.approx(50.0)
    assert top[0]["engine core -> first token ms"] == pytest.approx(20.0)


def test_under_load_through_a_real_stack(tiny_model: Path, tmp_path: Path) -> None:
    argv = [
        "--load-only",
        "--out", str(tmp_path / "out"),
        "--torch-threads", "0",  # leave this process's torch threads alone
        "--load-model", str(tiny_model),
        "--load-requests", "8",
        "--load-burst", "8",
        "--load-max-num-seqs", "4",
        "--load-prompt-short", "8,16",
        "--load-prompt-long", "32,48",
        "--load-output-len", "4,8",
    ]  # fmt: skip
    assert service_bench.main(argv) == 0
    result = json.loads((tmp_path / "out" / "service.json").read_text())
    assert "low_load" not in result and (tmp_path / "out" / "service.png").is_file()
    load = result["under_load"]
    assert load["capacity_req_s"] > 0 and load["rate_req_s"] == pytest.approx(0.8 * load["capacity_req_s"])
    for path in ("engine", "stack"):
        for name in service_load.TRACES:
            figures = load[path][name]
            assert figures["num_completed"] == figures["num_requests"] == 8, (path, name)
            for metric in ("ttft", "tpot"):
                assert all(math.isfinite(figures[metric][q]) for q in ("p50_ms", "p90_ms", "p99_ms"))
        assert load[path]["burst"]["num_completed"] == load[path]["burst"]["num_requests"] == 8
    for run in (*service_load.TRACES, "burst"):
        # Every stack request's record had the gateway's and the worker's stamps.
        assert {v["count"] for v in load["stack"][run]["stages"].values()} == {8}, run
    assert load["throughput_ratio"] > 0
    roles = {
        "gateway",
        "worker",
        "engine core",
        "broker",
        "redis",
        process_cpu.THIS_PROCESS,
        process_cpu.REST,
    }
    runs = [load["stack"][run]["cpu_cores"] for run in (*service_load.TRACES, "burst")]
    assert all(set(cores) == roles for cores in runs)
    assert sum(cores["engine core"] for cores in runs) > 0  # the worker's child process was found
    assert set(load["added_ttft_p99_ms"]) == set(service_load.TRACES)
    assert len(load["targets"]) == 3 and all(isinstance(t["passed"], bool) for t in load["targets"].values())
    assert load["workloads"]["poisson"]["num_requests"] == 8


def test_load_rate_fixes_the_trace_rate() -> None:
    import argparse

    from bench import service_load_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--torch-threads", type=int, default=1)
    service_load_args.add_arguments(parser)
    with_rate = service_load_args.config_from_args(
        parser.parse_args(["--load-model", "tiny", "--load-rate", "12.5"])
    )
    assert with_rate.rate == 12.5 and with_rate.load == 0.8
    default = service_load_args.config_from_args(parser.parse_args(["--load-model", "tiny"]))
    assert default.rate == 0.0  # then load x capacity
