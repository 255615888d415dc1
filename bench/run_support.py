"""Shared plumbing of the benchmark commands: threads, targets kept warm, runs saved.

The default checkpoint (``bench_model_path``) and the warm-up requests come from the planner's
workloads (inflight/plan/workload.py), which the planner's validation runs on too.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.results import RunResult, write_json
from bench.stats import summarize
from bench.targets import Target, TargetConfig, make_target
from inflight.plan.slo import SLO
from inflight.plan.workload import RequestSpec, warmup_specs


def set_threads(threads: int) -> int:
    """Same intra-op thread count for every target (0: torch's default). Returns the count in use."""
    if threads > 0:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def cpu_kernel_parser(doc: str | None, repeats: int, repeats_help: str) -> argparse.ArgumentParser:
    """The arguments every CPU kernel bench takes: --threads, --repeats (the best counts), --dtypes."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--repeats", type=int, default=repeats, help=f"{repeats_help} (the best counts)")
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"]
    )
    return parser


def run_cpu_kernel_bench(name: str, threads: int, report: Callable[[], None]) -> int:
    """``report()`` at ``threads`` torch threads, once the C++ CPU kernels load; exit status 2, said
    on stderr, where they cannot be built. The caller's thread count comes back after: a bench's
    main() may run inside another program (the tests)."""
    from engine.kernels import cpu as cpu_kernels

    if not cpu_kernels.load():
        print(f"{name}: the C++ CPU kernels could not be built here", file=sys.stderr)
        return 2
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        report()
    finally:
        torch.set_num_threads(before)
    return 0


def fmt_ms(summary: dict[str, Any], key: str, q: str) -> str:
    v = summary.get(key, {}).get(q, math.nan)
    return "-" if not math.isfinite(v) else (f"{v / 1e3:.2f}s" if v >= 1e4 else f"{v:.0f}ms")


def one_line(s: dict[str, Any]) -> str:
    rate = s["offered_rate"]
    rate_s = "all at t=0" if not math.isfinite(rate) else f"{rate:.3g} req/s"
    text = (
        f"{s['target']:<12} {s['label']:<14} offered {rate_s:<12} | {s['request_throughput']:.3f} req/s "
        f"{s['output_throughput']:7.1f} out tok/s | TTFT p50 {fmt_ms(s, 'ttft', 'p50_ms')} "
        f"p99 {fmt_ms(s, 'ttft', 'p99_ms')} | TPOT p50 {fmt_ms(s, 'tpot', 'p50_ms')} "
        f"p99 {fmt_ms(s, 'tpot', 'p99_ms')} | ITL p99 {fmt_ms(s, 'itl', 'p99_ms')} "
        f"| E2E p99 {fmt_ms(s, 'e2e', 'p99_ms')}"
    )
    if "goodput" in s:
        text += f" | goodput {s['goodput']:.3f} req/s ({100 * s['slo_attainment']:.0f}%)"
    if "output_tokens_per_cpu_s" in s:
        text += f" | {s['output_tokens_per_cpu_s']:.1f} tok/CPU-s, load {s['loadavg_1m'][0]:.1f}"
    return text


class Session:
    """Targets created on first use and warmed up once; every run is summarized, printed and saved."""

    def __init__(self, config: TargetConfig, out: Path, slo: SLO | None, vocab_size: int) -> None:
        self.config = config
        self.out = out
        self.slo = slo
        self.vocab_size = vocab_size
        self.targets: dict[str, Target] = {}
        self.runs: list[RunResult] = []
        (out / "runs").mkdir(parents=True, exist_ok=True)

    def target(self, name: str) -> Target:
        if name not in self.targets:
            t = make_target(name, self.config)
            t.warmup(warmup_specs(self.vocab_size, self.config.max_model_len))
            self.targets[name] = t
        return self.targets[name]

    def release(self, name: str) -> None:
        t = self.targets.pop(name, None)
        if t is not None:
            t.close()

    def run(
        self, name: str, specs: list[RequestSpec], label: str, rate: float
    ) -> tuple[RunResult, dict[str, Any]]:
        target = self.target(name)
        load_before = os.getloadavg()[0]
        cpu_before = time.process_time()
        result = target.run(specs, label, rate)
        # CPU seconds of this process (all its threads) and of any child processes the target ran the
        # work in (vllm): on a shared machine, tokens per CPU-second is the contention-free view of
        # the same work that wall-clock tokens/s measures.
        child_cpu = float(result.extra.pop("child_cpu_s", 0.0))
        result.extra["cpu_s"] = time.process_time() - cpu_before + child_cpu
        result.extra["loadavg_1m"] = [load_before, os.getloadavg()[0]]
        summary = summarize(result, self.slo)
        cpu = result.extra["cpu_s"]
        summary["cpu_s"] = cpu
        summary["output_tokens_per_cpu_s"] = sum(r.num_output_tokens for r in result.requests) / cpu
        summary["loadavg_1m"] = result.extra["loadavg_1m"]
        print(one_line(summary), flush=True)
        write_json(self.out / "runs" / f"{name}_{label}.json", {"summary": summary, **result.to_json()})
        self.runs.append(result)
        return result, summary

    def close(self) -> None:
        for name in list(self.targets):
            self.release(name)


def add_layer_shape(parser: argparse.ArgumentParser) -> None:
    """The decoder layer's shape the CPU linear benches time (defaults: SmolLM2-135M's)."""
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
