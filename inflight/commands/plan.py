"""``inflight plan calibrate|simulate|size``: the step-cost model and the capacity planner."""

from __future__ import annotations

import argparse

NAME = "plan"
HELP = "capacity planning: calibrate a step-cost model, simulate a fleet, size it for an SLO"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="plan_command", required=True)
    cal = sub.add_parser("calibrate", help="time the engine's steps on this host and fit the cost model")
    cal.add_argument("--model", default=None, help="checkpoint (default: the bench preset)")
    cal.add_argument("--out", required=True, help="where to write the cost model (JSON)")
    cal.add_argument("--dtype", default="auto")
    cal.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    cal.add_argument("--max-num-seqs", type=int, default=64)
    cal.add_argument("--max-num-batched-tokens", type=int, default=512)
    cal.add_argument("--max-model-len", type=int, default=2048)
    cal.add_argument("--block-size", type=int, default=16)
    cal.add_argument("--num-blocks", type=int, default=None)
    cal.add_argument("--quick", action="store_true", help="a few-second grid (tests, smoke checks)")


def _model_path(model: str | None) -> str:
    if model:
        return model
    from bench.session import bench_model_path

    return str(bench_model_path())


def _calibrate(args: argparse.Namespace) -> int:
    import torch

    from inflight.plan.calibrate import DEFAULT_GRID, QUICK_GRID, calibrate, describe

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    engine_args = dict(
        dtype=args.dtype,
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
    )
    cost = calibrate(
        _model_path(args.model), QUICK_GRID if args.quick else DEFAULT_GRID, engine_args=engine_args
    )
    cost.save(args.out)
    print(describe(cost))
    print(f"wrote {args.out}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.plan_command == "calibrate":
        return _calibrate(args)
    raise AssertionError(args.plan_command)
