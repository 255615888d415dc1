"""PNG plots of benchmark runs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap

from bench.results import RunResult
from bench.timeline import batch_matrix

# One colour per target, the same in every plot.
COLORS = {
    "continuous": "tab:blue",
    "static": "tab:red",
    "hf-batch": "tab:green",
    "hf-generate": "tab:purple",
    "vllm": "tab:orange",
}


def _color(target: str) -> str | None:
    return COLORS.get(target)


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(
    sweeps: dict[str, list[dict[str, Any]]], path: Path, *, ttft_limit_s: float | None = None
) -> None:
    """Throughput and P99 latencies vs offered rate, one line per target (summaries from stats)."""
    panels = [
        ("output_throughput", None, "output tokens/s"),
        ("request_throughput", None, "completed requests/s"),
        ("goodput", None, "goodput (requests/s within SLO)"),
        ("ttft", "p99_ms", "P99 TTFT (ms)"),
        ("tpot", "p99_ms", "P99 TPOT (ms)"),
        ("itl", "p99_ms", "P99 ITL (ms)"),
        ("e2e", "p99_ms", "P99 end-to-end (ms)"),
        ("ttft", "p50_ms", "P50 TTFT (ms)"),
    ]
    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    for ax, (key, sub, title) in zip(axes.flat, panels, strict=True):
        for target, rows in sweeps.items():
            pts = sorted(
                (r["offered_rate"], _get(r, key, sub)) for r in rows if math.isfinite(r["offered_rate"])
            )
            pts = [(x, y) for x, y in pts if y is not None and math.isfinite(y)]
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", label=target, color=_color(target))
        if sub is not None:
            ax.set_yscale("log")
        if key == "ttft" and sub == "p99_ms" and ttft_limit_s is not None:
            ax.axhline(ttft_limit_s * 1e3, ls="--", color="grey", lw=1, label=f"{ttft_limit_s:g} s")
        ax.set_title(title)
        ax.set_xlabel("offered rate (requests/s)")
        ax.grid(alpha=0.3)
    for ax in (axes.flat[0], axes.flat[3]):
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    _save(fig, path)


def _get(row: dict[str, Any], key: str, sub: str | None) -> float | None:
    v = row.get(key)
    if sub is not None:
        v = v.get(sub) if isinstance(v, dict) else None
    return float(v) if isinstance(v, int | float) else None


def plot_cdfs(runs: Sequence[RunResult], path: Path, title: str = "") -> None:
    """Empirical CDFs of TTFT, TPOT, ITL and end-to-end latency, one line per run."""
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, name in zip(axes, ("TTFT", "TPOT", "ITL", "end-to-end"), strict=True):
        for run in runs:
            vals = sorted(_latencies(run, name))
            if not vals:
                continue
            ys = [(i + 1) / len(vals) for i in range(len(vals))]
            ax.step([v * 1e3 for v in vals], ys, where="post", label=run.target, color=_color(run.target))
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("gaps" if name == "ITL" else "requests"))
        ax.grid(alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    _save(fig, path)


def _latencies(run: RunResult, name: str) -> list[float]:
    if name == "ITL":
        return [g for r in run.requests for g in r.itls()]
    attr = {"TTFT": "ttft", "TPOT": "tpot", "end-to-end": "e2e"}[name]
    return [v for r in run.requests if (v := getattr(r, attr)) is not None]


def plot_batch_timeline(run: RunResult, path: Path, max_steps: int = 4000) -> None:
    """Requests as rows (by arrival), steps as columns: waiting grey, prefill orange, decode blue."""
    ids, matrix = batch_matrix(run)
    if not matrix or not run.steps:
        return
    if len(run.steps) > max_steps:  # keep the image readable: the first max_steps steps
        matrix = [row[:max_steps] for row in matrix]
    cmap = ListedColormap(["white", "0.8", "tab:orange", "tab:blue"])
    fig, ax = plt.subplots(figsize=(14, max(3.0, min(12.0, 0.08 * len(ids) + 2))))
    ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=3)
    ax.set_xlabel("engine step")
    ax.set_ylabel("request (by arrival)")
    ax.set_title(f"{run.target} {run.label}: waiting (grey), prefill (orange), decode (blue)")
    _save(fig, path)


def plot_engine_series(runs: Sequence[RunResult], path: Path) -> None:
    """Per engine run, over time: running/waiting, scheduled tokens and batch size, KV usage with
    preemptions, and where each step's time went."""
    runs = [r for r in runs if r.steps]
    if not runs:
        return
    fig, axes = plt.subplots(4, len(runs), figsize=(7 * len(runs), 12), squeeze=False, sharex="col")
    for col, run in enumerate(runs):
        t = [s.start for s in run.steps]
        ax = axes[0][col]
        ax.plot(t, [s.num_running for s in run.steps], label="running")
        ax.plot(t, [s.num_waiting for s in run.steps], label="waiting")
        ax.set_title(f"{run.target} {run.label}")
        ax.set_ylabel("requests")
        ax.legend()
        ax = axes[1][col]
        ax.plot(t, [s.num_scheduled_tokens for s in run.steps], label="scheduled tokens", lw=0.8)
        ax.plot(t, [s.num_scheduled_seqs for s in run.steps], label="batch size (seqs)")
        ax.set_ylabel("per step")
        ax.legend()
        ax = axes[2][col]
        ax.plot(t, [s.kv_usage for s in run.steps], label="KV usage")
        pre = [s.start for s in run.steps if s.step_preemptions]
        if pre:
            ax.plot(pre, [1.0] * len(pre), "rx", label="preemption")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("fraction of blocks")
        ax.legend()
        ax = axes[3][col]
        parts = {
            "schedule": [s.schedule_time for s in run.steps],
            "prepare inputs": [s.prepare_time for s in run.steps],
            "model + sampling": [s.model_time for s in run.steps],
            "postprocess": [max(0.0, s.duration - s.schedule_time - s.execute_time) for s in run.steps],
        }
        ax.stackplot(t, [[1e3 * v for v in vs] for vs in parts.values()], labels=list(parts), step="post")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylabel("step time (ms)")
        ax.set_xlabel("time (s)")
        ax.legend(loc="upper left")
        for row in axes:
            row[col].grid(alpha=0.3)
    _save(fig, path)


def plot_bars(series: dict[str, dict[str, float]], path: Path, ylabel: str, title: str) -> None:
    """Grouped bars: one group per target, one bar per series (hatched after the first)."""
    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(next(iter(series.values())))
    width = 0.8 / len(series)
    for k, (label, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(names))]
        ys = [values.get(n, math.nan) for n in names]
        colors = [_color(n) or "grey" for n in names]
        ax.bar(
            xs,
            ys,
            width,
            color=colors,
            hatch="" if k == 0 else "//",
            alpha=1.0 if k == 0 else 0.5,
            label=label,
        )
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(f"{y:.1f}", (x, y), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    _save(fig, path)
