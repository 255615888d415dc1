"""``inflight plan validate``: the verdict on a validation (inflight/plan/validate.py), its table, and
the command that calibrates, measures and judges each fleet size."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from engine.cost_model import StepCostModel
from inflight.plan.validate import FIGURES, validate


def verdict_errors(result: dict[str, Any]) -> dict[str, float]:
    """The errors a validation is judged by: from the workers' own calibration when they made one,
    against the median of the runs when the trace ran more than once."""
    errors: dict[str, float] = (
        result.get("error_against_median")
        or result.get("error_from_workers_calibration")
        or result["error_from_calibration"]
    )
    return errors


def verdict_bands(result: dict[str, Any]) -> dict[str, bool]:
    """For the judged prediction and measurement: whether each figure lies in its host-noise band."""
    bands: dict[str, bool] = (
        result.get("in_band_against_median")
        or result.get("in_band_from_workers_calibration")
        or result.get("in_band_from_calibration")
        or {}
    )
    return bands


def no_further_than_a_repeat(result: dict[str, Any], figure: str) -> bool:
    """Whether the judged error on ``figure`` is at most how far a repeat of the trace landed from
    the first run: there the host, not the model, sets the error. False without repeats."""
    spread = result.get("repeatability")
    return spread is not None and abs(verdict_errors(result)[figure]) <= spread[figure]


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:+.2f} ms"


def report(result: dict[str, Any], tolerance: float = 0.2) -> str:
    """A table of the figures and the diagnosis, errors past ``tolerance`` marked."""
    m, cal, run = result["measured"], result["predicted_from_calibration"], result["predicted_from_run_steps"]
    ecal, erun = result["error_from_calibration"], result["error_from_run_steps"]
    own, eown = result.get("predicted_from_workers_calibration"), result.get("error_from_workers_calibration")
    speed, espeed = result.get("predicted_from_run_speed"), result.get("error_from_run_speed")
    judged, in_band = verdict_errors(result), verdict_bands(result)
    band_of = own or cal
    again, spread = result.get("measured_again"), result.get("repeatability")
    median = result.get("measured_median")
    lines = [
        f"{result['workers']} worker(s), {result['threads_per_worker']} thread(s) each, "
        f"{result['num_requests']} requests",
        f"{'figure':<13} {'measured':>10} {'calibration':>12} {'error':>7}"
        + (f" {'workers cal.':>12} {'error':>7}" if own else "")
        + f" {'run steps':>10} {'error':>7}"
        + (f" {'run speed':>10} {'error':>7}" if speed else "")
        + f" {'host band (judged)':>19}"
        + (f" {f'median of {len(again) + 1}':>11} {'error':>7} {'apart':>6}" if again else ""),
    ]
    for k in FIGURES:
        mark = ""
        if abs(judged[k]) > tolerance:
            mark = "  <- over" + ("" if not in_band else " (in band)" if in_band[k] else " (outside band)")
        at = f" {own[k]:>12.4g} {100 * eown[k]:>+6.0f}%" if own and eown else ""
        sp = f" {speed[k]:>10.4g} {100 * espeed[k]:>+6.0f}%" if speed and espeed else ""
        band = f"{band_of[k + '_lo']:.4g}-{band_of[k + '_hi']:.4g}" if k + "_lo" in band_of else "-"
        rep = ""
        if median and spread:
            rep = f" {median[k]:>11.4g} {100 * judged[k]:>+6.0f}% {100 * spread[k]:>5.0f}%"
        if mark and no_further_than_a_repeat(result, k):
            mark += ", no further than a second run"
        lines.append(
            f"{k:<13} {m[k]:>10.4g} {cal[k]:>12.4g} {100 * ecal[k]:>+6.0f}%{at} {run[k]:>10.4g} "
            f"{100 * erun[k]:>+6.0f}%{sp} {band:>19}{rep}{mark}"
        )
    if "workers_cost" in result:
        from inflight.plan.calibrate import describe

        own_cost = StepCostModel.from_json(result["workers_cost"])
        lines.append("the workers' calibration: " + describe(own_cost).replace("\n", "\n  "))
    if "run_level" in result:
        lines.append(
            f"the run's steps took x{result['run_level']:.2f} the judged calibration's time for the same "
            "batches (the host's speed moved between the two by that much)"
        )
    if result.get("host_drift"):
        lines.append(
            f"bands: the host's noise, the calibration's level uncertainty and a host drift of "
            f"{result['host_drift']:g} (log, one sigma)"
        )
    if again and spread:
        lines.append(
            f"median of {len(again) + 1}: the trace ran again on fresh engines right after, the judged "
            "prediction's error is against the median of all the runs; apart: a repeat's largest "
            "difference from the first run, what the host alone moves a figure by"
        )
    if speed:
        lo, hi = result["run_speed_range"]
        lines.append(
            f"run speed: the run-steps model times the host's measured speed in "
            f"{result['speed_window_s']:g} s "
            f"windows ({lo:.2f}x-{hi:.2f}x)"
        )
    d = result["diagnosis"]
    lines.append(
        f"utilisation: measured {d['measured_utilisation']:.2f}, simulated {cal['utilisation']:.2f} "
        f"(calibration) / {run['utilisation']:.2f} (run steps)"
    )
    for kind, k in d["by_kind"].items():
        lines.append(
            f"  {kind:<8} {k['steps']:>5} steps: measured {k['measured_s']:.2f} s, model "
            f"{k['predicted_s']:.2f} s ({100 * k['error']:+.0f}%, median step ratio "
            f"{k['median_step_ratio']:.2f})"
        )
    lines.append(
        f"  waiting for a core {100 * d['waiting_for_cpu_share']:.1f}% of step time, output processing "
        f"{100 * d['output_processing_share']:.1f}%, loop {d['loop_gap_ms_per_step']:.3f} ms/step, "
        f"GC {d['gc_pause_s']:.2f} s in {d['gc_collections']} collections, "
        f"{d['new_shape_steps']} steps of a new token count: {_ms(d['new_shape_excess_ms'])} each over "
        f"the linear terms (model: {d['model_first_shape_ms']:.2f} ms); {d['stale_shape_steps']} of a count "
        f"unused for {d['shape_cache']}+ others: {_ms(d['stale_shape_excess_ms'])}; recently used: "
        f"{_ms(d['recent_shape_excess_ms'])}"
    )
    return "\n".join(lines)


# One fleet size measured and predicted: (model, specs, engine_args, cost, workers=, threads=) -> the
# result and its report. The planner's is ``in_process_fleet``; the benchmark tree brings others
# (repeated runs, the whole service path).
FleetValidation = Callable[..., tuple[dict[str, Any], str]]


def in_process_fleet(args: Any) -> FleetValidation:
    """Real engines in worker processes and the simulator on the same trace (validate.py), once."""
    from inflight.plan.calibrate import DEFAULT_GRID

    def one(
        model: str, specs: Any, engine_args: dict[str, Any], cost: StepCostModel, **kw: Any
    ) -> tuple[dict[str, Any], str]:
        result = validate(
            model,
            specs,
            engine_args,
            cost,
            shape_cache=args.shape_cache,
            grid=DEFAULT_GRID if args.calibrate_workers else None,
            speed_window_s=args.speed_window,
            **kw,
        )
        return result, report(result, args.tolerance)

    return one


def run_from_args(args: Any, model: str, pinned: dict[str, Any], fleet: FleetValidation | None = None) -> int:
    """``inflight plan validate``: calibrate (or load), then validate each fleet size with ``fleet``
    (default: ``in_process_fleet``); 1 if a figure from the calibration misses by more than
    ``args.tolerance``. ``pinned``: engine settings the cost model and simulator assume (async
    scheduling off)."""
    import json
    import os
    from pathlib import Path

    import torch

    from engine.config import ModelConfig
    from inflight.plan.calibrate import DEFAULT_GRID, calibrate, describe
    from inflight.plan.policies import capacity
    from inflight.plan.workload import synthetic

    sizes = [int(x) for x in args.workers.split(",")]
    fleet = fleet or in_process_fleet(args)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # Each worker its own cores, as pods have: the largest fleet decides, and the calibration uses the
    # same count (a model timed on two threads says nothing of a one-thread worker).
    threads = args.threads or max(1, cores // max(sizes))
    engine_args = dict(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_blocks=args.num_blocks,
        enable_prefix_caching=False,  # random prompts: a prefix hit would be luck
        **pinned,
    )
    if args.cost:
        cost = StepCostModel.load(args.cost)
        if cost.host.get("threads") not in (None, threads):
            raise SystemExit(
                f"{args.cost} was calibrated with {cost.host['threads']} threads, workers use {threads}"
            )
    else:
        torch.set_num_threads(threads)
        cost = calibrate(model, DEFAULT_GRID, engine_args=engine_args)
    print(describe(cost), flush=True)
    vocab = ModelConfig.from_path(model).vocab_size
    rate = args.rate
    if rate is None:
        rate = args.load * capacity(cost, 500, engine_args, args.seed)
        print(f"{rate:.3g} req/s a worker ({args.load:g} x the simulated capacity)", flush=True)
    results = []
    for workers in sizes:
        specs = synthetic(args.num_requests * workers, rate * workers, vocab, seed=args.seed)
        result, text = fleet(model, specs, engine_args, cost, workers=workers, threads=threads)
        print(text, flush=True)
        results.append(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cost": cost.to_json(), "runs": results}, indent=1) + "\n")
    over = [
        f"{r['workers']} worker(s) {k} {100 * verdict_errors(r)[k]:+.0f}%"
        for r in results
        for k in FIGURES
        if abs(verdict_errors(r)[k]) > args.tolerance
    ]
    outside = [
        f"{r['workers']} worker(s) {k}"
        for r in results
        for k, inside in verdict_bands(r).items()
        if not inside and abs(verdict_errors(r)[k]) > args.tolerance
    ]
    verdict = f"over {100 * args.tolerance:.0f}%: {', '.join(over)}" if over else "all within"
    if over and any("repeatability" in r for r in results):
        # A prediction no further from the run than a second run of the same trace is: the host,
        # not the model, sets the error there.
        near = [
            f"{r['workers']} worker(s) {k}"
            for r in results
            for k in FIGURES
            if abs(verdict_errors(r)[k]) > args.tolerance and no_further_than_a_repeat(r, k)
        ]
        verdict += f"; of those, no further than a second run: {', '.join(near) or 'none'}"
    if over and any(verdict_bands(r) for r in results):
        # Past the tolerance but inside the band: the host's own noise moves the figure that far
        # between a calibration and a run; outside it, the model is wrong.
        verdict += f"; outside the host band: {', '.join(outside) or 'none'}"
    print(f"wrote {args.out}; {verdict}")
    return 1 if over else 0
