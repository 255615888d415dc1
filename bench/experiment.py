"""``python -m bench engine``: continuous vs static batching, the seed's controlled experiment in one CPU run.

Same model (the ~50M-parameter bench checkpoint, float32), same threads, same workload for every
target; greedy, EOS ignored, per-request max_tokens; prefix caching off; each target warmed up.

  1. Decode probe: a decode step at 64 running requests vs its linear layers alone, measured alternately.
  2. Saturation: every request at t = 0 through continuous, static, hf-batch and hf-generate
     (--targets; add vllm for vLLM's CPU backend, whose greedy outputs are then compared with
     continuous's token by token). Static's completed requests/s there is its saturation rate S.
  3. Rate search, Poisson: continuous and static start at 1.0 x S (the "near static's saturation"
     comparison) and each halves or doubles its rate until its P99 TTFT limit is bracketed;
     continuous also runs at 2 x S (overload). The targets take turns, so a slow spell of a
     shared machine hits both.
Then every figure is printed next to its target, and JSON, plots, per-request timelines and
a Chrome trace are written into --out.
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
from bench.micro import decode_probe, linear_params
from bench.results import RunResult, write_json
from bench.run_support import Session, set_threads
from bench.stats import backlog_throughput, max_sustained_rate
from bench.target_report import print_figures, target_figures
from bench.targets import TARGETS, TargetConfig
from bench.timeline import chrome_trace, request_timelines
from inflight.plan.slo import parse_slo
from inflight.plan.workload import LengthMix, bench_model_path, describe, synthetic


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF checkpoint dir (default: the bench preset, written on first use)")
    p.add_argument("--out", default="bench-results", help="directory for JSON and PNG files")
    # Defaults sized for about ten minutes on a shared 2-core machine (see the README's results):
    # 32 requests at t=0 are two static batches of 16; low-rate runs cost their arrival span.
    p.add_argument("--saturation-requests", type=int, default=32, help="requests of the all-at-once runs")
    p.add_argument("--near", type=float, default=1.0, help="multiple of S for the TTFT comparison")
    p.add_argument("--ttft-limit", type=float, default=2.0, help="P99 TTFT bound (s) of the rate search")
    p.add_argument("--min-multiple", type=float, default=0.25, help="lowest rate searched, times S")
    p.add_argument("--max-multiple", type=float, default=4.0, help="highest rate searched, times S")
    p.add_argument("--overload", type=float, default=2.0, help="continuous also runs here (times S)")
    p.add_argument("--span", type=float, default=40.0, help="seconds of arrivals per sweep run")
    p.add_argument("--min-requests", type=int, default=8, help="fewest requests of a sweep run")
    p.add_argument("--num-requests", type=int, default=40, help="most requests of a sweep run")
    p.add_argument("--slo", nargs="+", default=["ttft:2000", "tpot:500"], help="goodput SLO: ttft:MS tpot:MS")
    # One thread: on a shared machine other processes stall multi-threaded OpenMP regions, which
    # makes step times erratic; every target and the matmul rate use the same count either way.
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch default)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="every target's batch limit")
    p.add_argument("--probe-batch", type=int, default=64, help="running requests of the decode probe")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true", help="leave out the HF transformers peers")
    p.add_argument(
        "--targets",
        default="continuous,static,hf-batch,hf-generate",
        help=f"saturation targets, comma list of {', '.join(TARGETS)} (continuous and static always run: "
        "the rate search needs them; vllm needs `make bench-peers`)",
    )
    p.add_argument(
        "--vllm-compile", action="store_true", help="let vLLM torch.compile its model (default: eager)"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="dtype of continuous, static and vllm (auto: this CPU's pick); the HF peers stay float32",
    )
    p.add_argument("--probe-rounds", type=int, default=8, help="decode steps timed by the probe")
    p.add_argument("--probe-prompt", type=int, default=128, help="prompt tokens of the probe's requests")
    p.add_argument(
        "--trace-out", help="Chrome/Perfetto trace of the near-saturation runs (default: in --out)"
    )
    p.add_argument("--quick", action="store_true", help="a tiny smoke run: few requests, short lengths")


def _saturation_targets(args: argparse.Namespace) -> list[str]:
    """--targets in order, continuous and static first and always, HF peers dropped by --skip-hf."""
    names = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise SystemExit(f"unknown target(s) {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    rest = [n for n in names if n not in ("continuous", "static")]
    if args.skip_hf:
        rest = [n for n in rest if not n.startswith("hf")]
    return ["continuous", "static", *dict.fromkeys(rest)]


def _next_multiple(passed: set[float], failed: set[float], lo: float, hi: float) -> float | None:
    """Halve or double from the first rate until the TTFT limit is bracketed or a bound is reached:
    [pass at 1] -> 2; [fail at 1] -> 0.5; [pass 0.5, fail 1] -> done."""
    if passed and failed:
        return None
    if failed:
        m = min(failed) / 2
        return m if m >= lo else None
    m = max(passed) * 2
    return m if m <= hi else None


def _rate_search(
    session: Session, args: argparse.Namespace, static_rate: float, vocab_size: int, mix: LengthMix
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, RunResult]]:
    """Each target starts at ``near`` x S and halves or doubles its rate until its P99 TTFT limit is
    bracketed; continuous also runs at ``overload`` x S so the plots reach overload. The targets
    take turns, so a slow spell of the shared machine falls on both. A run's requests are the
    first n of one seeded stream, n = rate x span (clamped): low rates need fewer requests to cover
    the same span, and any two runs at one rate are identical."""
    todo = {"continuous": args.near, "static": args.near}
    verdicts: dict[str, tuple[set[float], set[float]]] = {n: (set(), set()) for n in todo}
    sweep: dict[str, list[dict[str, Any]]] = {n: [] for n in todo}
    near_runs: dict[str, RunResult] = {}
    extra = [("continuous", args.overload)]
    while todo or extra:
        if not todo:
            name, m = extra.pop()
            if any(s["rate_multiple"] == m for s in sweep[name]):
                continue
            todo[name] = m
        for name, m in list(todo.items()):
            rate = m * static_rate
            n = min(args.num_requests, max(args.min_requests, round(rate * args.span)))
            specs = synthetic(n, rate, vocab_size, mix=mix, seed=args.seed, prefix="req")
            result, summary = session.run(name, specs, f"x{m:g}", rate)
            summary["rate_multiple"] = m
            sweep[name].append(summary)
            if m == args.near:
                near_runs[name] = result
            passed, failed = verdicts[name]
            (passed if summary["ttft"]["p99_ms"] <= args.ttft_limit * 1e3 else failed).add(m)
            nxt = _next_multiple(passed, failed, args.min_multiple, args.max_multiple)
            if nxt is None or any(s["rate_multiple"] == nxt for s in sweep[name]):
                del todo[name]
            else:
                todo[name] = nxt
    for rows in sweep.values():
        rows.sort(key=lambda s: s["rate_multiple"])
    return sweep, near_runs


def run(args: argparse.Namespace) -> int:
    started = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = set_threads(args.threads)
    model = args.model or str(bench_model_path())
    from engine.config import ModelConfig

    mc = ModelConfig.from_path(model)
    slo = parse_slo(args.slo)
    mix = LengthMix()
    if args.quick:
        mix = LengthMix(short_prompt=(16, 32), long_prompt=(64, 96), output=(4, 16))
        args.num_requests, args.saturation_requests = (
            min(args.num_requests, 8),
            min(args.saturation_requests, 12),
        )
        args.min_requests = min(args.min_requests, 4)
        args.probe_rounds, args.max_num_seqs = min(args.probe_rounds, 2), min(args.max_num_seqs, 8)
        args.probe_batch, args.probe_prompt = min(args.probe_batch, 8), min(args.probe_prompt, 32)
    config = TargetConfig(
        model=model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        max_model_len=mix.long_prompt[1] + mix.output[1] + args.block_size,
        seed=args.seed,
        engine_args={"dtype": args.dtype},
        vllm_eager=not args.vllm_compile,
    )
    session = Session(config, out, slo, mc.vocab_size)
    print(f"model {model} ({mc.num_hidden_layers} layers, hidden {mc.hidden_size}), {threads} threads")
    print(f"KV capacity {config.kv_tokens} tokens for every target; SLO {slo.describe()}", flush=True)

    # 1. The decode probe, before anything else fills memory.
    probe = decode_probe(
        model,
        batch=args.probe_batch,
        prompt_len=args.probe_prompt,
        rounds=args.probe_rounds,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
    )
    print(
        f"decode probe: step at {probe.batch} running {probe.step_ms:.0f} ms "
        f"({probe.step_gflops:.1f} GFLOP/s), "
        f"its linear layers {probe.packed_matmul_gflops:.1f} GFLOP/s, share "
        f"{probe.step_share_of_packed_rate:.2f}",
        flush=True,
    )

    # 2. Saturation: all at once.
    sat_specs = synthetic(
        args.saturation_requests, math.inf, mc.vocab_size, mix=mix, seed=args.seed, prefix="sat"
    )
    saturation: dict[str, dict[str, Any]] = {}
    sat_runs = {}
    for name in _saturation_targets(args):
        sat_runs[name], saturation[name] = session.run(name, sat_specs, "saturation", math.inf)
        window = backlog_throughput(sat_runs[name], args.max_num_seqs)
        saturation[name]["saturated_output_throughput"] = window
        print(
            f"  {name}: {window:.1f} output tokens/s until {args.max_num_seqs} requests remained", flush=True
        )
        if name not in ("continuous", "static"):
            session.release(name)  # one peer in memory at a time; only the engine runs again
    comparisons = peer_comparisons(sat_runs)
    for peer, result in comparisons.items():
        print(describe_identical(result, "continuous", peer), flush=True)
    static_rate = saturation["static"]["request_throughput"]
    print(f"static saturates at S = {static_rate:.3f} req/s", flush=True)

    # 3. The rate sweep, continuous and static interleaved.
    sweep, near_runs = _rate_search(session, args, static_rate, mc.vocab_size, mix)
    near_summaries = {
        n: next(s for s in rows if s["rate_multiple"] == args.near) for n, rows in sweep.items()
    }
    session.close()

    def max_rate(name: str, limit: float) -> tuple[float, bool]:
        return max_sustained_rate(
            [(s["offered_rate"], s["ttft"]["p99_ms"] / 1e3) for s in sweep[name]], limit
        )

    max_rates = {name: max_rate(name, args.ttft_limit) for name in sweep}
    # Looser bounds from the same runs, for context on a machine slower than the targets assume.
    limits = sorted({args.ttft_limit, 5.0, 10.0})
    rate_table = {f"{lim:g}s": {n: max_rate(n, lim) for n in sweep} for lim in limits}
    for lim, row in rate_table.items():
        text = ", ".join(f"{n} {'>=' if not b else ''}{r:.3f}" for n, (r, b) in row.items())
        print(f"max rate at P99 TTFT <= {lim}: {text} req/s")
    figures = target_figures(
        probe,
        saturation,
        near_summaries,
        max_rates,
        sat_runs.get("continuous"),
        lowest_rate=min(s["offered_rate"] for s in sweep["static"]),
        model=mc,
        max_num_seqs=args.max_num_seqs,
    )
    print_figures(figures)

    # Files: the summary JSON, plots, timelines, the trace.
    write_json(
        out / "results.json",
        {
            "command": "python -m bench engine " + " ".join(args.argv),
            "wall_s": time.time() - started,
            "threads": threads,
            "dtype": args.dtype,
            "model": {"path": model, "linear_params": linear_params(mc), "threads": threads},
            "target_config": {k: v for k, v in vars(config).items() if k != "engine_args"},
            "slo": slo.describe(),
            "workload": {"saturation": describe(sat_specs), "mix": vars(mix)},
            "static_saturation_rate": static_rate,
            "decode_probe": probe.to_json(),
            "saturation": saturation,
            "greedy_outputs_identical": comparisons,
            "sweep": sweep,
            "max_rate_at_p99_ttft": {
                lim: {n: {"rate": r, "bounded": b} for n, (r, b) in row.items()}
                for lim, row in rate_table.items()
            },
            "figures": figures,
        },
    )
    plots.plot_sweep(sweep, out / "sweep.png", ttft_limit_s=args.ttft_limit)
    plots.plot_bars(
        {
            "saturated window": {n: s["saturated_output_throughput"] for n, s in saturation.items()},
            "whole run": {n: s["output_throughput"] for n, s in saturation.items()},
        },
        out / "saturation_throughput.png",
        "output tokens/s",
        f"All {args.saturation_requests} requests at t=0",
    )
    plots.plot_cdfs(list(sat_runs.values()), out / "cdf_saturation.png", "saturation (all at t=0)")
    if near_runs:
        plots.plot_cdfs(
            list(near_runs.values()), out / "cdf_near_saturation.png", f"Poisson at {args.near:g} x S"
        )
        plots.plot_engine_series(list(near_runs.values()), out / "engine_near_saturation.png")
        for name, r in near_runs.items():
            plots.plot_batch_timeline(r, out / f"batch_timeline_{name}.png")
        timelines = {n: request_timelines(r, args.max_num_seqs) for n, r in near_runs.items()}
        write_json(out / "timelines_near_saturation.json", timelines)
        trace_path = Path(args.trace_out) if args.trace_out else out / "trace_near_saturation.json"
        trace_path.write_text(json.dumps(chrome_trace(near_runs.values())))
    plots.plot_engine_series([sat_runs["continuous"], sat_runs["static"]], out / "engine_saturation.png")
    print(f"wrote {out}/results.json and plots in {time.time() - started:.0f} s", flush=True)
    return 0
