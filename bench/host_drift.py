"""``python -m bench host``: how steady this host's speed is, before any figure from it is trusted.

A fixed piece of work (bf16 matmuls of decode and prefill shapes, one intra-op thread) runs in a loop
on each allowed core at once, one process a core, and its rate is sampled every ``window`` seconds.
Everything is reported relative to each core's median rate:

    windows      the lowest and highest window, and the share of windows 20% or more off the median
    means        the spread of the means over longer spans (10, 30, 60 s): what a benchmark run of
                 that length sees; a validation that compares a calibration with a later run of
                 that length cannot be more exact than the spread of these means. Their log standard
                 deviation times sqrt(2) is how far two such spans differ (one sigma): what
                 ``python -m bench validate --host-drift`` takes to widen its band by
    correlation  between the cores' windows: near 0, two workers on this host drift independently

On the 2-core VM this project is developed on (a cloud vCPU pair), nothing else running: over four
minutes, windows 0.67x-1.87x the median, one-minute means 0.76-1.20, correlation between the cores
-0.03; another minute, 0.48x-1.23x and +0.23. The variation is the neighbours', and no benchmark
here can control it.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

SPANS_S = (10.0, 30.0, 60.0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=180.0, help="how long to sample (default 180)")
    p.add_argument("--window", type=float, default=0.5, help="seconds a sample (default 0.5)")
    p.add_argument("--cores", type=int, default=0, help="processes, one a core (default: every allowed core)")
    p.add_argument("--json", default=None, help="also write the samples and summary here")


def _sample(core: int | None, seconds: float, window: float, out: Any) -> None:
    import torch

    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    from engine.platform.cpu import cpu_has_bf16_matmul

    # The dtype the engine would pick here: bf16 only where the CPU multiplies it in hardware (an
    # AVX2-only host runs bf16 GEMMs hundreds of times slower, and a window would hold no loop at all).
    dtype = torch.bfloat16 if cpu_has_bf16_matmul() else torch.float32
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(576, 1536, generator=gen).to(dtype)
    decode = torch.randn(64, 576, generator=gen).to(dtype)
    prefill = torch.randn(256, 576, generator=gen).to(dtype)
    rates = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        began, n = time.perf_counter(), 0
        while time.perf_counter() - began < window:
            for _ in range(10):
                decode @ weight
                prefill @ weight
            n += 1
        rates.append(n / (time.perf_counter() - began))
    out.put((core, rates))


def measure(seconds: float, window: float, cores: list[int | None]) -> dict[int | None, list[float]]:
    """Rates (loops a second) per window, one list a core, all cores sampled at once."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_sample, args=(c, seconds, window, out), daemon=True) for c in cores]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=seconds + 120) for _ in procs)
    for p in procs:
        p.join(timeout=10)
    return results


def summarize(rates: list[float], window: float) -> dict[str, Any]:
    """One core's samples relative to its median (see the module docstring)."""
    mid = statistics.median(rates)
    rel = [r / mid for r in rates]
    means = {}
    for span in SPANS_S:
        k = max(1, round(span / window))
        chunks = [statistics.fmean(rel[i : i + k]) for i in range(0, len(rel) - k + 1, k)]
        if chunks:
            logs = [math.log(c) for c in chunks]
            pair = math.sqrt(2) * statistics.stdev(logs) if len(logs) > 1 else math.nan
            means[f"{span:g}s"] = (min(chunks), max(chunks), len(chunks), pair)
    return {
        "windows": len(rel),
        "lowest": min(rel),
        "highest": max(rel),
        "off_by_20pct_share": sum(abs(x - 1.0) >= 0.2 for x in rel) / len(rel),
        "means": means,
    }


def correlation(a: list[float], b: list[float]) -> float:
    n = min(len(a), len(b))
    if n < 3:
        return math.nan
    try:
        return statistics.correlation(a[:n], b[:n])
    except statistics.StatisticsError:  # a constant series
        return math.nan


def main(args: argparse.Namespace) -> int:
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [None]
    cores: list[int | None] = list(allowed[: args.cores] if args.cores > 0 else allowed)
    results = measure(args.seconds, args.window, cores)
    summary = {str(c): summarize(r, args.window) for c, r in results.items()}
    for core, s in summary.items():
        spans = ", ".join(
            f"{k} means {lo:.2f}-{hi:.2f} ({n}; two differ by {pair:.2f} in log, one sigma)"
            for k, (lo, hi, n, pair) in s["means"].items()
        )
        print(
            f"core {core}: {s['windows']} windows of {args.window:g} s: "
            f"{s['lowest']:.2f}x-{s['highest']:.2f}x the median, "
            f"{100 * s['off_by_20pct_share']:.0f}% of them 20% or more off; {spans}"
        )
    series = list(results.values())
    if len(series) > 1:
        print(f"correlation between the first two cores' windows: {correlation(series[0], series[1]):+.2f}")
    if args.json:
        payload = {
            "window_s": args.window,
            "rates": {str(c): r for c, r in results.items()},
            "summary": summary,
        }
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=1) + "\n")
    return 0
