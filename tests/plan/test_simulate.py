"""The fleet simulator: exact step arithmetic on a hand-built case, the fast path equal to stepping,
the gateway's bound and the partition assignment, and the plan CLI end to end."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine.cost_model import StepCostModel
from inflight.cli import main
from inflight.plan.policies import ceiling
from inflight.plan.simulate import FleetConfig, ServicePath, SimRequest, simulate
from inflight.plan.traffic import sampled_partitions, synthetic

# 10 ms a step, 0.1 ms a token, 0.2 ms a row, 1 us a context token.
COST = StepCostModel(
    0.010,
    1e-4,
    2e-4,
    1e-6,
    engine={"max_num_seqs": 8, "max_num_batched_tokens": 256, "block_size": 16, "num_blocks": 512},
)


def test_one_request_takes_exactly_the_cost_models_steps() -> None:
    r = simulate([SimRequest(1.0, 100, 5, 0)], COST, FleetConfig(workers=1))
    prefill = COST.step_time(100, 1, 100)  # samples the first token
    decodes = [COST.step_time(1, 1, 101 + k) for k in range(4)]
    assert r["ttft_p50_s"] == pytest.approx(prefill, rel=1e-12)
    assert r["tpot_p50_s"] == pytest.approx(sum(decodes) / 4, rel=1e-12)
    assert r["duration_s"] == pytest.approx(1.0 + prefill + sum(decodes), rel=1e-12)
    assert r["steps"] == 5 and r["fast_forwarded_steps"] == 4  # four decodes applied at once


def test_service_path_and_new_shapes_add_exactly_their_cost() -> None:
    # 4 ms to reach the worker, 2 ms to reach the client, 1 ms of loop a step; a cold worker that has
    # run 100-token steps (its warm-up) pays 5 ms for its first 1-token step only.
    cost = replace(COST, first_shape=0.005)
    svc = ServicePath(intake_s=0.004, delivery_s=0.002, step_overhead_s=0.001)
    fleet = FleetConfig(workers=1, service=svc, cold_shapes=True, warm_shapes=frozenset({100}))
    r = simulate([SimRequest(1.0, 100, 5, 0)], cost, fleet)
    prefill = COST.step_time(100, 1, 100) + 0.001
    decodes = [COST.step_time(1, 1, 101 + k) + 0.001 for k in range(4)]
    assert r["ttft_p50_s"] == pytest.approx(0.004 + prefill + 0.002, rel=1e-12)
    assert r["tpot_p50_s"] == pytest.approx((sum(decodes) + 0.005) / 4, rel=1e-12)
    assert r["duration_s"] == pytest.approx(1.0 + 0.004 + prefill + sum(decodes) + 0.005 + 0.002, rel=1e-12)
    # Warm (the default): no first-shape cost, and the decode run is applied at once again.
    warm = simulate([SimRequest(1.0, 100, 5, 0)], cost, FleetConfig(workers=1, service=svc))
    assert warm["tpot_p50_s"] == pytest.approx(sum(decodes) / 4, rel=1e-12)
    assert warm["fast_forwarded_steps"] == 4 and r["fast_forwarded_steps"] == 3


def test_a_shape_cache_evicts_the_least_recently_run_token_count() -> None:
    # Prompts of 100, 50, 100 tokens, one token each, far apart: the third step runs 100 tokens again,
    # warm with room for two counts, cold again with room for one (50 evicted 100).
    cost = replace(COST, first_shape=0.005)
    reqs = [SimRequest(float(t), n, 1, 0) for t, n in ((0, 100), (10, 50), (20, 100))]
    ends = {
        cache: simulate(reqs, cost, FleetConfig(workers=1, cold_shapes=True, shape_cache=cache))["duration_s"]
        for cache in (1, 2)
    }
    assert ends[2] == pytest.approx(20 + COST.step_time(100, 1, 100), rel=1e-12)
    assert ends[1] == pytest.approx(ends[2] + 0.005, rel=1e-12)


@pytest.mark.parametrize("cold", [False, True])
def test_fast_path_equals_step_by_step(cold: bool) -> None:
    # Cold: workers pay 5 ms for a token count not among the 8 they ran last (the fast path touches a
    # run's shape once, stepping touches it every step: the same LRU order, as no other count runs).
    cost = replace(COST, first_shape=0.005)
    reqs = synthetic(6.0, 60.0, seed=5)
    shapes: dict[str, Any] = {"cold_shapes": cold, "shape_cache": 8}
    fast = simulate(reqs, cost, FleetConfig(workers=2, max_pending=64, **shapes))
    slow = simulate(reqs, cost, FleetConfig(workers=2, max_pending=64, fast_path=False, **shapes))
    assert fast["fast_forwarded_steps"] > fast["steps"] // 2 and slow["fast_forwarded_steps"] == 0
    for key in (
        "ttft_p50_s",
        "ttft_p99_s",
        "tpot_p50_s",
        "tpot_p99_s",
        "output_tok_s",
        "steps",
        "utilisation",
    ):
        assert fast[key] == pytest.approx(slow[key], rel=1e-9), key
    if cold:  # and the cold workers did pay for shapes
        warm = simulate(reqs, cost, FleetConfig(workers=2, max_pending=64))
        assert fast["utilisation"] > warm["utilisation"]


def test_gateway_bound_turns_away_the_excess() -> None:
    # Ten at once, one worker fetching while fewer than 2 wait: the first is fetched at once, three
    # more fill the bound of 3 pending, six are told 429.
    reqs = [SimRequest(0.0, 32, 4, i) for i in range(10)]
    r = simulate(reqs, COST, FleetConfig(workers=1, max_pending=3, max_waiting=2))
    assert r["num_rejected_gateway"] == 6 and r["num_completed"] == 4


def test_a_worker_without_a_partition_does_nothing() -> None:
    reqs = synthetic(8.0, 30.0, seed=2)
    one = simulate(reqs, COST, FleetConfig(workers=1))
    two_one_partition = simulate(reqs, COST, FleetConfig(workers=2, partitions=1))
    two = simulate(reqs, COST, FleetConfig(workers=2))
    assert two_one_partition["ttft_p99_s"] == one["ttft_p99_s"]
    assert two["ttft_p99_s"] < one["ttft_p99_s"]


def test_cli_simulate_and_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cost = tmp_path / "cost.json"
    COST.save(cost)
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"arrival": i * 0.05, "prompt_len": 64, "output_len": 16}) + "\n" for i in range(200)
        )
    )
    assert (
        main(["plan", "simulate", "--trace", str(trace), "--cost", str(cost), "--workers", "2", "--json"])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "output_tok_s"):
        assert result[key] > 0
    assert result["num_completed"] == 200
    png = tmp_path / "size.png"
    args = ["plan", "size", "--rate", "40", "--slo", "ttft:300", "tpot:40", "--cost", str(cost)]
    assert main([*args, "--duration", "60", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "smallest fleet meeting ttft:300 tpot:40" in out and png.stat().st_size > 1000
    best = int(out.split("req/s: ")[1].split(" workers")[0])
    rows = {
        int(line.split()[0]): line.split()[-1] for line in out.splitlines()[1:] if line.split()[0].isdigit()
    }
    assert rows[best] == "yes" and rows.get(best - 1, "no") == "no"


@pytest.mark.parametrize(("process", "cv"), [("poisson", 1.0), ("gamma", 2.0)])
def test_thinned_arrivals_keep_the_rate_of_the_kept_share(process: str, cv: float) -> None:
    kept = synthetic(100.0, 600.0, process=process, cv=cv, seed=1, partitions=([0, 1], 8))
    assert len(kept) == pytest.approx(100.0 * 600.0 * 2 / 8, rel=0.05)
    assert {r.partition_key % 8 for r in kept} == {0, 1}


def test_sampled_workers_see_the_fleets_latencies() -> None:
    fleet = FleetConfig(workers=12, sample_workers=4)
    full = simulate(synthetic(36.0, 120.0, seed=4), COST, FleetConfig(workers=12))
    part = simulate(synthetic(36.0, 120.0, seed=4, partitions=sampled_partitions(fleet)), COST, fleet)
    assert part["simulated_workers"] == 4 and part["num_requests"] < full["num_requests"] / 2
    for key in ("ttft_p50_s", "tpot_p50_s", "output_tok_s"):
        assert part[key] == pytest.approx(full[key], rel=0.1), key


def test_slo_policy_with_reject_raises_goodput_over_fcfs_when_overloaded() -> None:
    # Bursty arrivals above capacity: fcfs lets every queued request miss its TTFT; the slo policy
    # serves the ones that can still make it and drops the lost ones.
    reqs = synthetic(12.0, 60.0, process="gamma", cv=3.0, seed=8)
    slo = (1.0, 0.1)
    base = {"max_num_seqs": 8, "max_num_batched_tokens": 256}
    fcfs = simulate(reqs, COST, FleetConfig(workers=1, max_waiting=None, engine=base), slo)
    eng = {**base, "scheduling_policy": "slo", "slo_ttft_s": 1.0, "slo_tpot_s": 0.1, "slo_reject": True}
    slo_run = simulate(reqs, COST, FleetConfig(workers=1, max_waiting=None, engine=eng), slo)
    assert slo_run["num_rejected_slo"] > 0 and slo_run["ttft_p99_s"] < fcfs["ttft_p99_s"]
    assert slo_run["goodput_req_s"] >= 1.3 * fcfs["goodput_req_s"]
    for run in (fcfs, slo_run):  # goodput counts the requests it says met both bounds
        assert run["num_good"] == round(run["goodput_req_s"] * run["duration_s"]) <= run["num_completed"]
    assert slo_run["tpot_p99_s"] <= 0.1 * 1.1  # chunks sized to the TPOT deadline


def test_cli_policies_writes_the_comparison(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cost = tmp_path / "cost.json"
    COST.save(cost)
    out = tmp_path / "pol"
    args = ["plan", "policies", "--cost", str(cost), "--slo", "ttft:1000", "tpot:100", "--out", str(out)]
    assert main([*args, "--cvs", "3", "--loads", "1.2", "--num-requests", "300"]) == 0
    result = json.loads((out / "policies.json").read_text())
    assert [r["policy"] for r in result["rows"]] == ["fcfs", "priority", "slo", "slo+reject"]
    assert result["capacity_req_s"] > 0 and (out / "policies.png").stat().st_size > 1000
    goodput = {r["policy"]: r["goodput_req_s"] for r in result["rows"]}
    assert goodput["slo+reject"] > goodput["fcfs"]
    text = capsys.readouterr().out
    assert "slo+reject" in text and "ceiling" in text
    # The ceiling: the requests over those fcfs met; fcfs left room under it at 1.2x in bursts.
    fcfs = result["rows"][0]
    assert ceiling(fcfs) == fcfs["num_requests"] / fcfs["num_good"] > 1.0
    assert all(r["num_requests"] == fcfs["num_requests"] for r in result["rows"])


def test_a_sliding_window_model_holds_only_its_window_in_kv() -> None:
    # Eight requests of 64 + 200 tokens need 17 blocks of 16 each (136): 40 blocks hold two at a time
    # unless, as a model whose every layer slides a 32-token window, each holds cdiv(31 + 1, 16) + 1
    # blocks a step. Then all eight run together, exactly as with room for every whole context.
    reqs = [SimRequest(0.0, 64, 200, 0) for _ in range(8)]

    def run(blocks: int, window: int | None) -> dict[str, Any]:
        engine = {**COST.engine, "num_blocks": blocks, "kv_free_window": window}
        return simulate(reqs, replace(COST, engine=engine), FleetConfig(workers=1))

    roomy, tight, windowed = run(1000, None), run(40, None), run(40, 32)
    assert windowed["num_completed"] == tight["num_completed"] == 8
    assert windowed["duration_s"] == pytest.approx(roomy["duration_s"], rel=1e-12)
    assert tight["duration_s"] > 1.5 * roomy["duration_s"]
