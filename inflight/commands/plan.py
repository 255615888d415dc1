"""``inflight plan calibrate|simulate|size|validate|preset|policies``: the step-cost model, the capacity
planner, its validation against real engines, and the scheduling policies compared in simulation.

The research instruments around them live in the benchmark tree of a source checkout: repeated and
service-path validations, the policies measured on real engines, the host's speed (``python -m bench
validate|policies|host``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

# The simulator runs one step after the other, each taking the cost model's time. With async scheduling
# (auto: on for a CPU engine whose torch threads leave a core free) step() returns the previous step's
# tokens while the next runs, which neither the model nor the simulator describes; so calibration, the
# validation's engines and the real policy benchmark pin it off.
SEQUENTIAL_STEPS = False

NAME = "plan"
HELP = "capacity planning: calibrate a step-cost model, simulate a fleet, size it for an SLO"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="plan_command", required=True)
    cal = sub.add_parser("calibrate", help="time the engine's steps on this host and fit the cost model")
    cal.add_argument("--model", default=None, help="checkpoint (default: the bench preset)")
    cal.add_argument("--out", required=True, help="where to write the cost model (JSON)")
    cal.add_argument("--dtype", default="auto")
    cal.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "int8", "fp8_e4m3"),
        help="the engine's kv_cache_dtype",
    )
    cal.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    cal.add_argument("--max-num-seqs", type=int, default=64)
    cal.add_argument("--max-num-batched-tokens", type=int, default=512)
    cal.add_argument("--max-model-len", type=int, default=2048)
    cal.add_argument("--block-size", type=int, default=16)
    cal.add_argument("--num-blocks", type=int, default=None)
    cal.add_argument("--quick", action="store_true", help="a few-second grid (tests, smoke checks)")

    sim = sub.add_parser("simulate", help="simulate a fleet on a trace with the cost model's step times")
    sim.add_argument("--trace", required=True, help="a JSONL trace (inflight/plan/workload.py)")
    sim.add_argument("--model", default=None, help="checkpoint whose vocabulary/tokenizer reads the trace")
    _fleet_arguments(sim)
    sim.add_argument("--workers", type=int, required=True)
    sim.add_argument("--partitions", type=int, default=None, help="Kafka partitions (default: one a worker)")
    sim.add_argument("--max-pending", type=int, default=None, help="gateway admission bound (default: none)")
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.add_argument("--slo", nargs="+", default=None, help="ttft:MS tpot:MS: report goodput against it")

    size = sub.add_parser("size", help="the smallest fleet meeting an SLO at P99")
    size.add_argument("--rate", type=float, required=True, help="requests per second")
    size.add_argument("--slo", nargs="+", required=True, help="ttft:MS tpot:MS")
    size.add_argument("--trace", default=None, help="a JSONL trace, replayed at --rate")
    size.add_argument("--model", default=None)
    size.add_argument("--workload", choices=("poisson", "gamma"), default="poisson")
    size.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation")
    size.add_argument("--duration", type=float, default=600.0, help="seconds of synthetic traffic")
    size.add_argument("--seed", type=int, default=0)
    size.add_argument("--plot", default="plan_size.png", help="where to write P99 vs workers (PNG)")
    size.add_argument("--max-workers", type=int, default=4096)
    _fleet_arguments(size)

    validate_arguments(
        sub.add_parser(
            "validate", help="predicted vs measured: real engines and the simulator replay the same trace"
        )
    )

    pre = sub.add_parser(
        "preset",
        help="a roofline ESTIMATE of the cost model for a GPU this host cannot calibrate (e.g. h200)",
    )
    pre.add_argument("--list", action="store_true", help="the GPUs and named model shapes, then exit")
    pre.add_argument("--gpu", default=None, help="h200, h100, a100-80gb, l4 (see --list)")
    pre.add_argument("--model", default=None, help="a named shape (see --list) or a checkpoint directory")
    pre.add_argument("--out", default=None, help="where to write the cost model (JSON)")
    pre.add_argument("--max-num-seqs", type=int, default=256)
    pre.add_argument("--max-num-batched-tokens", type=int, default=8192)
    pre.add_argument("--max-model-len", type=int, default=8192)
    pre.add_argument("--block-size", type=int, default=16)
    pre.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "int8", "fp8_e4m3"),
        help="the KV cache's format: auto (bf16), or int8 / fp8_e4m3 (a byte a value plus a scale a row)",
    )
    pre.add_argument("--mbu", type=float, default=None, help="share of peak HBM bandwidth (default 0.8)")
    pre.add_argument("--mfu", type=float, default=None, help="share of peak bf16 FLOP/s (default 0.5)")
    pre.add_argument("--gpu-memory-utilization", type=float, default=None, help="(default 0.9)")
    pre.add_argument(
        "--step-overhead-ms", type=float, default=None, help="CPU time a step (default 1.5: no CUDA graphs)"
    )
    pre.add_argument("--seq-overhead-us", type=float, default=None, help="CPU time a row (default 10)")
    pre.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallelism over this many GPUs: weights and KV per rank, two all-reduces a layer "
        "at the GPU link's bandwidth (an estimate, like the rest)",
    )

    pol = sub.add_parser(
        "policies",
        help="fcfs vs priority vs slo on bursty arrivals (goodput), simulated; measured on real engines: "
        "python -m bench policies",
    )
    pol.add_argument("--cost", required=True, help="COST.json from inflight plan calibrate")
    pol.add_argument("--slo", nargs="+", required=True, help="ttft:MS tpot:MS")
    pol.add_argument("--cvs", default=None, help="gamma arrival CVs (default 2,4)")
    pol.add_argument(
        "--loads", default=None, help="offered load as fractions of capacity (default 0.8,1,1.2)"
    )
    pol.add_argument("--num-requests", type=int, default=1500, help="requests a run")
    pol.add_argument("--out", default="plan-policies", help="directory for policies.json and policies.png")


def validate_arguments(parser: argparse.ArgumentParser) -> None:
    """``plan validate``'s arguments (bench's research validation adds its own to the same set)."""
    parser.add_argument("--model", default=None, help="checkpoint (default: the bench preset)")
    parser.add_argument("--cost", default=None, help="COST.json (default: calibrate first, same threads)")
    parser.add_argument("--workers", default="1,2", help="fleet sizes to validate, comma list")
    parser.add_argument(
        "--threads", type=int, default=0, help="intra-op threads a worker (0: cores / workers)"
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="requests/s a worker (Poisson; default --load)"
    )
    parser.add_argument(
        "--load",
        type=float,
        default=0.7,
        help="offered load a worker as a fraction of the cost model's simulated capacity (default 0.7: "
        "queues form, as they do where a planner is asked; the same point on any host)",
    )
    parser.add_argument(
        "--num-requests", type=int, default=150, help="requests a worker (P99 of fewer is one request)"
    )
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument(
        "--shape-cache", type=int, default=None, help="simulate an LRU of this many warm token counts"
    )
    parser.add_argument(
        "--speed-window",
        type=float,
        default=0.5,
        help="seconds a window of the run's measured host speed spans in the run-speed prediction",
    )
    parser.add_argument(
        "--calibrate-workers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each worker calibrates itself just before the trace, side by side as they serve; the "
        "verdict uses that calibration (default: on)",
    )
    parser.add_argument("--tolerance", type=float, default=0.2, help="relative error allowed a figure")
    parser.add_argument("--out", default="plan-validate.json", help="where to write every figure (JSON)")


def _fleet_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cost", required=True, help="COST.json from inflight plan calibrate")
    parser.add_argument(
        "--max-waiting", type=int, default=16, help="worker fetch bound (INFLIGHT_FETCH_MAX_WAITING)"
    )
    parser.add_argument(
        "--policy",
        choices=("fcfs", "priority", "slo"),
        default=None,
        help="scheduling policy (default: the calibrated engine's); slo schedules by the --slo deadlines",
    )
    parser.add_argument(
        "--slo-reject", action="store_true", help="slo policy: reject requests whose TTFT is lost"
    )
    # The service path around each engine (0: an in-process engine, what calibrate times). Measured by
    # `python -m bench service` (its intake and delivery stages) and `inflight plan validate` (loop ms/step).
    parser.add_argument("--intake-ms", type=float, default=0.0, help="gateway -> worker queue latency")
    parser.add_argument("--delivery-ms", type=float, default=0.0, help="token -> client latency")
    parser.add_argument("--step-overhead-ms", type=float, default=0.0, help="serving loop time per step")
    parser.add_argument(
        "--shape-cache",
        type=int,
        default=None,
        help="workers keep only this many token counts warm (an LRU): others pay the cost model's "
        "first_shape again (default: all warm)",
    )
    parser.add_argument(
        "--sample-workers",
        type=int,
        default=None,
        help="simulate only this many workers and their partitions' traffic (workers interact only "
        "through the gateway bound, which is scaled to their share): fleets of thousands in seconds",
    )


def _model_path(model: str | None) -> str:
    if model:
        return model
    from inflight.plan.workload import bench_model_path

    return str(bench_model_path())


def _calibrate(args: argparse.Namespace) -> int:
    import torch

    from inflight.plan.calibrate import DEFAULT_GRID, QUICK_GRID, calibrate, describe

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    engine_args = dict(
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_blocks=args.num_blocks
        if args.num_blocks is not None
        else -(-args.max_num_seqs * args.max_model_len // args.block_size),
        # Calibration prompts are random, so a prefix hit can only be luck; serving settings are kept
        # in the JSON for the simulator.
        enable_prefix_caching=False,
        async_scheduling=SEQUENTIAL_STEPS,
    )
    cost = calibrate(
        _model_path(args.model), QUICK_GRID if args.quick else DEFAULT_GRID, engine_args=engine_args
    )
    cost.save(args.out)
    print(describe(cost))
    print(f"wrote {args.out}")
    return 0


def _slo(args: argparse.Namespace) -> tuple[float | None, float | None]:
    if not args.slo:
        return None, None
    from inflight.plan.slo import parse_slo

    slo = parse_slo(args.slo)
    return slo.ttft_s, slo.tpot_s


def _engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    if args.policy is None:
        return {}
    out: dict[str, Any] = {"scheduling_policy": args.policy}
    if args.policy == "slo":
        out["slo_ttft_s"], out["slo_tpot_s"] = _slo(args)
        out["slo_reject"] = args.slo_reject
    return out


def _service(args: argparse.Namespace) -> Any:
    from inflight.plan.simulate import ServicePath

    return ServicePath(args.intake_ms / 1e3, args.delivery_ms / 1e3, args.step_overhead_ms / 1e3)


def _trace(path: str, model: str | None, time_scale: float = 1.0) -> list[Any]:
    from inflight.plan.traffic import from_specs
    from inflight.plan.workload import load_trace

    vocab, encode = 1 << 30, None
    if model:
        from engine.config import ModelConfig
        from engine.models.gguf import local_checkpoint

        vocab = ModelConfig.from_path(model).vocab_size
        if (local_checkpoint(model) / "tokenizer.json").is_file():
            from engine.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(model)
            encode = None if tokenizer is None else tokenizer.encode
    return from_specs(load_trace(path, vocab, encode=encode, time_scale=time_scale))


def _simulate(args: argparse.Namespace) -> int:
    from engine.cost_model import StepCostModel
    from inflight.plan.simulate import FleetConfig, simulate

    cost = StepCostModel.load(args.cost)
    _warn_if_estimate(cost)
    fleet = FleetConfig(
        workers=args.workers,
        partitions=args.partitions,
        max_pending=args.max_pending,
        max_waiting=args.max_waiting,
        engine=_engine_overrides(args),
        sample_workers=args.sample_workers,
        service=_service(args),
        cold_shapes=args.shape_cache is not None,
        shape_cache=args.shape_cache,
    )
    result = simulate(_trace(args.trace, args.model), cost, fleet, _slo(args))
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value:.4g}" if isinstance(value, float) else f"{key:>22}: {value}")
    return 0


def _size(args: argparse.Namespace) -> int:
    from engine.cost_model import StepCostModel
    from inflight.plan.simulate import FleetConfig, SimRequest
    from inflight.plan.size import Target, plot, search, table
    from inflight.plan.slo import parse_slo
    from inflight.plan.traffic import sampled_partitions, synthetic

    slo = parse_slo(args.slo)
    if slo.ttft_s is None or slo.tpot_s is None:
        raise SystemExit("--slo needs both ttft:MS and tpot:MS")
    target = Target(slo.ttft_s, slo.tpot_s)
    cost = StepCostModel.load(args.cost)
    _warn_if_estimate(cost)
    fixed: list[SimRequest] | None = None
    if args.trace:
        raw = _trace(args.trace, args.model)
        span = max(r.arrival for r in raw) or 1.0
        # Replayed at the asked rate: the trace's own rate is len / span.
        fixed = _trace(args.trace, args.model, time_scale=(len(raw) / span) / args.rate)

    def workload(fleet: FleetConfig) -> list[SimRequest]:
        if fixed is not None:
            return fixed
        parts = sampled_partitions(fleet) if fleet.sample_workers else None
        return synthetic(
            args.rate, args.duration, process=args.workload, cv=args.cv, seed=args.seed, partitions=parts
        )

    best, points = search(
        workload,
        cost,
        args.rate,
        target,
        sample=args.sample_workers,
        engine=_engine_overrides(args),
        max_workers=args.max_workers,
        max_waiting=args.max_waiting,
        service=_service(args),
        shape_cache=args.shape_cache,
    )
    print(table(points))
    plot(points, target, args.plot)
    if best is None:
        print(f"no fleet of up to {args.max_workers} workers meets {slo.describe()} at P99")
        return 1
    chosen = next(p for p in points if p["workers"] == best)
    print(
        f"smallest fleet meeting {slo.describe()} at P99 for {args.rate:g} req/s: {best} workers, "
        f"{chosen['partitions']} partitions, gateway bound {chosen['max_pending']} (plot: {args.plot})"
    )
    return 0


def _policies(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.cost_model import StepCostModel
    from inflight.plan.policies import compare, plot, table

    ttft, tpot = _slo(args)
    if ttft is None or tpot is None:
        raise SystemExit("--slo needs both ttft:MS and tpot:MS")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = compare(
        StepCostModel.load(args.cost),
        (ttft, tpot),
        cvs=tuple(float(x) for x in (args.cvs or "2,4").split(",")),
        loads=tuple(float(x) for x in (args.loads or "0.8,1,1.2").split(",")),
        num_requests=args.num_requests,
    )
    (out / "policies.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "policies.png")
    print(table(result))
    print(f"wrote {out / 'policies.json'} and {out / 'policies.png'}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from inflight.plan.validate_command import run_from_args

    return run_from_args(args, _model_path(args.model), {"async_scheduling": SEQUENTIAL_STEPS})


def _preset(args: argparse.Namespace) -> int:
    from inflight.plan.preset_command import run_from_args

    return run_from_args(args)


def _warn_if_estimate(cost: Any) -> None:
    """One line on stderr when a planner command runs on a preset's estimate, not a calibration."""
    import sys

    from inflight.plan.presets import estimate_line

    line = estimate_line(cost)
    if line:
        print(f"warning: {line}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.plan_command == "calibrate":
        return _calibrate(args)
    if args.plan_command == "simulate":
        return _simulate(args)
    if args.plan_command == "size":
        return _size(args)
    if args.plan_command == "policies":
        return _policies(args)
    if args.plan_command == "validate":
        return _validate(args)
    if args.plan_command == "preset":
        return _preset(args)
    raise AssertionError(args.plan_command)
