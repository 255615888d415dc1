"""``python -m bench validate``: the planner's validation as a research instrument.

``inflight plan validate`` runs a trace once on real engines and judges the simulator's prediction of
it. Here the same command takes three questions further:

* ``--repeats N``: the trace runs N times on fresh engines, back to back. The first run is the one
  predicted and diagnosed; the others say how far the host lets two measurements of the same trace
  differ (``repeatability``), the floor under any prediction's error, and the median over all the runs
  is what the judged prediction is held to (``error_against_median``).
* ``--host-drift S``: the calibrations' bands widen by a host drift of S (log, one sigma; ``python -m
  bench host`` prints it for 30 s spans).
* ``--service``: measured through the gateway, Kafka and a worker process each (bench/service_replay.py).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from engine.cost_model import StepCostModel
from inflight.commands.plan import SEQUENTIAL_STEPS, validate_arguments
from inflight.plan.validate import FIGURES, compare, figures, measure, validate, within_band
from inflight.plan.validate_command import FleetValidation, in_process_fleet, report, run_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    validate_arguments(parser)
    parser.add_argument(
        "--host-drift",
        type=float,
        default=0.0,
        help="how far the host's speed moves between a calibration and a run (log, one sigma; "
        "`python -m bench host` prints it for 30 s spans): widens the band by it",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the trace this many times on fresh engines; the repeats show how far two real runs "
        "of the same trace differ on this host (the floor under any prediction's error)",
    )
    parser.add_argument(
        "--service",
        action="store_true",
        help="measure through the gateway, Kafka and a worker process each (bench/service_replay.py)",
    )


def repeatability(first: dict[str, float], again: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per figure, the largest relative difference of a repeat's measurement from the first run's:
    what the host alone moves a figure by between two runs of the same trace on the same code."""
    return {k: max(abs(m[k] - first[k]) / first[k] for m in again) for k in FIGURES}


def with_repeats(result: dict[str, Any], again: Sequence[dict[str, float]]) -> dict[str, Any]:
    """``result`` (validate.py's, for the first run) with the repeats' measurements and the verdict
    against the median of all the runs."""
    measured = result["measured"]
    predicted = result.get("predicted_from_workers_calibration") or result["predicted_from_calibration"]
    # The measurement a verdict should use: one run is one draw of the host's spells, the median of
    # several is the trace's figure on this host.
    median = {k: statistics.median(m[k] for m in (measured, *again)) for k in FIGURES}
    return {
        **result,
        "measured_again": list(again),
        "repeatability": repeatability(measured, again),
        "error_against_repeats": [compare(m, predicted) for m in again],
        "measured_median": median,
        "error_against_median": compare(median, predicted),
        "in_band_against_median": within_band(median, predicted),
    }


def validate_repeated(
    model: str,
    specs: Sequence[Any],
    engine_args: dict[str, Any],
    cost: StepCostModel,
    *,
    repeats: int,
    workers: int,
    threads: int,
    in_process: bool = False,
    **kw: Any,
) -> dict[str, Any]:
    """validate.py's comparison for one fleet size, then the trace ``repeats - 1`` more times on fresh
    engines (without the workers' calibration: it exists to predict the first run)."""
    fleet: dict[str, Any] = {"workers": workers, "threads": threads, "in_process": in_process}
    result = validate(model, specs, engine_args, cost, **fleet, **kw)
    if repeats <= 1:
        return result
    again = [figures(specs, measure(model, specs, engine_args, **fleet)) for _ in range(repeats - 1)]
    return with_repeats(result, again)


def _fleet(args: argparse.Namespace) -> FleetValidation:
    if args.service:
        from bench.service_replay import report_service, validate_service

        def through_service(
            model: str, specs: Any, engine_args: dict[str, Any], cost: StepCostModel, **kw: Any
        ) -> tuple[dict[str, Any], str]:
            result = validate_service(model, specs, engine_args, cost, shape_cache=args.shape_cache, **kw)
            return result, report_service(result, args.tolerance)

        return through_service
    if args.repeats <= 1 and not args.host_drift:
        return in_process_fleet(args)
    from inflight.plan.calibrate import DEFAULT_GRID

    def repeated(
        model: str, specs: Any, engine_args: dict[str, Any], cost: StepCostModel, **kw: Any
    ) -> tuple[dict[str, Any], str]:
        result = validate_repeated(
            model,
            specs,
            engine_args,
            cost,
            repeats=args.repeats,
            shape_cache=args.shape_cache,
            grid=DEFAULT_GRID if args.calibrate_workers else None,
            speed_window_s=args.speed_window,
            host_drift=args.host_drift,
            **kw,
        )
        return result, report(result, args.tolerance)

    return repeated


def main(args: argparse.Namespace) -> int:
    if args.service and args.repeats > 1:
        raise SystemExit("--repeats measures the engines' replay; --service runs once")
    from inflight.plan.workload import bench_model_path

    model = args.model or str(bench_model_path())
    return run_from_args(args, model, {"async_scheduling": SEQUENTIAL_STEPS}, _fleet(args))
