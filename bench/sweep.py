"""``python -m bench sweep``: any targets over a range of request rates, light load to overload.

    python -m bench sweep --targets continuous,static --rates 0.2,0.5,1,2 --num-requests 64
    python -m bench sweep --targets continuous --process gamma --cv 3 --rates 0.5,1
    python -m bench sweep --targets continuous,hf-batch --trace my.jsonl --speedups 0.5,1,2
    python -m bench sweep --targets continuous --rates 1 --engine-arg max_num_batched_tokens=256
    python -m bench sweep --targets continuous,vllm --rates 1,4 --engine-arg dtype=bfloat16

Each rate runs every target on the same requests (a rate only rescales arrival times), interleaved
target by target. Where continuous and vllm (``make bench-peers``) both ran a point, their greedy
outputs are compared token by token (identical n/N, in sweep.json). Writes sweep.json, per-run JSON,
sweep.png (throughput and P99s vs rate, one line per target), CDFs, batch timelines and engine time
series per rate, and a Chrome trace if asked.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from bench import plots
from bench.compare import describe_identical, peer_comparisons
from bench.results import RunResult, write_json
from bench.run_support import Session, set_threads
from bench.targets import TARGETS, TargetConfig
from bench.timeline import chrome_trace, request_timelines
from inflight.plan.slo import parse_slo
from inflight.plan.workload import LengthMix, RequestSpec, bench_model_path, describe, load_trace, synthetic


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF checkpoint dir (default: the bench preset, written on first use)")
    p.add_argument("--out", default="bench-results/sweep")
    p.add_argument("--targets", default="continuous,static", help=f"comma list of {', '.join(TARGETS)}")
    p.add_argument("--rates", default="0.25,0.5,1,2", help="requests/s (synthetic workloads)")
    p.add_argument("--process", choices=("poisson", "gamma"), default="poisson")
    p.add_argument("--cv", type=float, default=2.0, help="gamma arrivals: coefficient of variation")
    p.add_argument("--trace", help="JSONL trace instead of a synthetic workload")
    p.add_argument("--speedups", default="1", help="trace replay speed factors (2 = twice the rate)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-short", default="16,128", help="short prompt length range")
    p.add_argument("--prompt-long", default="256,512", help="long prompt length range")
    p.add_argument("--long-fraction", type=float, default=0.25)
    p.add_argument("--output-len", default="8,256", help="output length range (log-uniform)")
    p.add_argument("--slo", nargs="+", default=["ttft:2000", "tpot:500"])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch default)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, help="KV blocks (default: max_num_seqs full-length requests)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="extra engine arg")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stop-after-ttft", type=float, help="drop a target after a rate with P99 TTFT above this (s)"
    )
    p.add_argument("--trace-out", help="write a Chrome/Perfetto trace of every run here")
    p.add_argument("--vllm-compile", action="store_true", help="vllm target: torch.compile (default: eager)")


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def parse_engine_args(items: list[str]) -> dict[str, Any]:
    """``["max_num_batched_tokens=256", "scheduling_policy=priority"]`` -> typed dict (JSON literals
    where they parse, strings otherwise)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg wants KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def workloads(
    args: argparse.Namespace, vocab_size: int, encode: Any
) -> list[tuple[str, float, list[RequestSpec]]]:
    """(label, offered rate, specs) per sweep point."""
    if args.trace:
        base = load_trace(args.trace, vocab_size, encode=encode, seed=args.seed)
        span = base[-1].arrival - base[0].arrival
        points = []
        for factor in sorted(float(x) for x in args.speedups.split(",")):
            specs = [
                RequestSpec(s.request_id, s.arrival / factor, s.prompt_token_ids, s.max_tokens) for s in base
            ]
            rate = (len(base) - 1) * factor / span if span > 0 else math.inf
            points.append((f"trace-x{factor:g}", rate, specs))
        return points
    mix = LengthMix(
        _pair(args.prompt_short), _pair(args.prompt_long), args.long_fraction, _pair(args.output_len)
    )
    points = []
    for rate in sorted(float(x) for x in args.rates.split(",")):
        specs = synthetic(
            args.num_requests, rate, vocab_size, process=args.process, cv=args.cv, mix=mix, seed=args.seed
        )
        points.append((f"{args.process}-{rate:g}", rate, specs))
    return points


def run(args: argparse.Namespace) -> int:
    started = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = set_threads(args.threads)
    model = args.model or str(bench_model_path())
    from engine.config import ModelConfig
    from engine.tokenizer import load_tokenizer

    mc = ModelConfig.from_path(model)
    tok = load_tokenizer(model) if (Path(model) / "tokenizer.json").is_file() else None
    points = workloads(args, mc.vocab_size, tok.encode if tok else None)
    longest = max(s.num_prompt_tokens + s.max_tokens for _, _, specs in points for s in specs)
    config = TargetConfig(
        model=model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=-(-(longest + 1) // args.block_size) * args.block_size,
        seed=args.seed,
        engine_args=parse_engine_args(args.engine_arg),
        vllm_eager=not args.vllm_compile,
    )
    slo = parse_slo(args.slo)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    session = Session(config, out, slo, mc.vocab_size)
    print(f"model {model}, {threads} threads, targets {targets}, SLO {slo.describe()}", flush=True)
    sweep: dict[str, list[dict[str, Any]]] = {t: [] for t in targets}
    runs: list[RunResult] = []
    stopped: set[str] = set()
    identical: dict[str, dict[str, Any]] = {}
    for label, rate, specs in points:
        point_runs = []
        for name in targets:
            if name in stopped:
                continue
            result, summary = session.run(name, specs, label, rate)
            sweep[name].append(summary)
            point_runs.append(result)
            limit = args.stop_after_ttft
            if limit is not None and not summary["ttft"]["p99_ms"] <= limit * 1e3:
                stopped.add(name)
        runs.extend(point_runs)
        for peer, same in peer_comparisons({r.target: r for r in point_runs}).items():
            identical.setdefault(label, {})[peer] = same
            print(describe_identical(same, "continuous", peer), flush=True)
        _point_outputs(out, label, point_runs, args.max_num_seqs)
    session.close()
    write_json(
        out / "sweep.json",
        {
            "command": "python -m bench sweep " + " ".join(args.argv),
            "threads": threads,
            "model": model,
            "workloads": {label: describe(specs) for label, _, specs in points},
            "slo": slo.describe(),
            "sweep": sweep,
            "greedy_outputs_identical": identical,
        },
    )
    plots.plot_sweep(sweep, out / "sweep.png", ttft_limit_s=slo.ttft_s)
    if args.trace_out:
        Path(args.trace_out).write_text(json.dumps(chrome_trace(runs)))
    print(f"wrote {out} in {time.time() - started:.0f} s", flush=True)
    return 0


def _point_outputs(out: Path, label: str, runs: list[RunResult], max_num_seqs: int) -> None:
    if not runs:
        return
    plots.plot_cdfs(runs, out / f"cdf_{label}.png", label)
    engine_runs = [r for r in runs if r.steps]
    if engine_runs:
        plots.plot_engine_series(engine_runs, out / f"engine_{label}.png")
        for r in engine_runs:
            plots.plot_batch_timeline(r, out / f"batch_timeline_{r.target}_{label}.png")
        write_json(
            out / f"timelines_{label}.json",
            {r.target: request_timelines(r, max_num_seqs) for r in engine_runs},
        )
