"""Latency percentiles, throughput and goodput of a run, and SLO parsing.

Definitions (per request, times in seconds):
  TTFT  first output token delivered - arrival (queueing included: open-loop clients)
  TPOT  (last token - first token) / (output tokens - 1), a request's mean decode pace
  ITL   every gap between consecutive tokens of a request, pooled over all requests
  E2E   last token - arrival
Goodput counts only requests that completed and met every SLO bound (TTFT, and TPOT when the request
has two or more tokens), per second of the run: a system that is busy producing late tokens scores
low even if its raw tokens/s is high.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from bench.results import RunResult
from engine.metrics import percentile
from inflight.plan.slo import SLO

PERCENTILES = (50, 95, 99)


def distribution(values: Sequence[float]) -> dict[str, float]:
    """Mean and P50/P95/P99 in milliseconds."""
    out = {"mean_ms": 1e3 * sum(values) / len(values) if values else math.nan}
    for q in PERCENTILES:
        out[f"p{q}_ms"] = 1e3 * percentile(values, q)
    return out


def summarize(run: RunResult, slo: SLO | None = None) -> dict[str, Any]:
    """The per-run figures: throughput, latency distributions, goodput, engine-side aggregates."""
    reqs = run.requests
    done = [r for r in reqs if r.completed]
    duration = run.duration
    out_tokens = sum(r.num_output_tokens for r in reqs)
    prompt_tokens = sum(r.num_prompt_tokens for r in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    summary: dict[str, Any] = {
        "target": run.target,
        "label": run.label,
        "offered_rate": run.offered_rate,
        "num_requests": len(reqs),
        "num_completed": len(done),
        "num_errors": sum(1 for r in reqs if r.error is not None),
        "duration_s": duration,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(out_tokens + prompt_tokens),
        "ttft": distribution([x for r in reqs if (x := r.ttft) is not None]),
        "tpot": distribution([x for r in reqs if (x := r.tpot) is not None]),
        "itl": distribution([g for r in reqs for g in r.itls()]),
        "e2e": distribution([x for r in reqs if (x := r.e2e) is not None]),
    }
    queue = [x for r in reqs if (x := r.queue_time) is not None]
    if queue:
        summary["queue_time"] = distribution(queue)
    if slo is not None:
        good = sum(1 for r in reqs if slo.met(r))
        summary["slo"] = slo.describe()
        summary["goodput"] = per_s(good)
        summary["slo_attainment"] = good / len(reqs) if reqs else math.nan
    if run.steps:
        summary["engine"] = step_aggregates(run)
    return summary


def step_aggregates(run: RunResult) -> dict[str, Any]:
    """Engine-side figures over the run's steps, time-weighted where a level is averaged."""
    steps = run.steps
    busy = sum(s.duration for s in steps)
    weights = [s.duration for s in steps]

    def weighted(values: list[float]) -> float:
        return sum(v * w for v, w in zip(values, weights, strict=True)) / busy if busy > 0 else math.nan

    used = sum(s.kv_slots_used for s in steps)
    return {
        "num_steps": len(steps),
        "busy_s": busy,
        "mean_batch_seqs": weighted([s.num_scheduled_seqs for s in steps]),
        "mean_scheduled_tokens": weighted([s.num_scheduled_tokens for s in steps]),
        "mean_running": weighted([s.num_running for s in steps]),
        "mean_waiting": weighted([s.num_waiting for s in steps]),
        "max_waiting": max(s.num_waiting for s in steps),
        "mean_kv_usage": weighted([s.kv_usage for s in steps]),
        "max_kv_usage": max(s.kv_usage for s in steps),
        "kv_empty_slot_share": sum(s.kv_slots_empty for s in steps) / used if used else math.nan,
        "preemptions": sum(s.step_preemptions for s in steps),
        "steps_with_preemption": sum(1 for s in steps if s.step_preemptions),
        # Time split of the steps: scheduler (CPU bookkeeping), input packing, model + sampling, and
        # the rest of step() (token bookkeeping, detokenizing, building outputs).
        "schedule_share": sum(s.schedule_time for s in steps) / busy if busy else math.nan,
        "prepare_share": sum(s.prepare_time for s in steps) / busy if busy else math.nan,
        "model_share": sum(s.model_time for s in steps) / busy if busy else math.nan,
        "postprocess_share": (
            sum(s.duration - s.schedule_time - s.execute_time for s in steps) / busy if busy else math.nan
        ),
    }


def backlog_throughput(run: RunResult, backlog: int) -> float:
    """Output tokens/s of an all-at-once run over its saturated part: from the start until only
    ``backlog`` requests are left unfinished (tokens delivered by then, partial requests included).

    After that point even a continuous scheduler cannot fill its batch and the run ends in a drain
    whose length is set by the few longest requests; with few requests that tail is a large share
    of the whole run and pulls every target towards the speed of a nearly empty batch.
    Example: 4 requests ending at 1, 2, 3, 9 s, backlog 2 -> the window is [0, 2 s].
    """
    ends = sorted(r.token_times[-1] for r in run.requests if r.token_times)
    k = len(run.requests) - backlog
    if k < 1 or len(ends) < k or ends[k - 1] <= 0:
        return math.nan
    until = ends[k - 1]
    return sum(1 for r in run.requests for t in r.token_times if t <= until) / until


def max_sustained_rate(points: Sequence[tuple[float, float]], limit: float) -> tuple[float, bool]:
    """The highest offered rate whose latency stays within ``limit``, from (rate, latency) points,
    and whether a failing rate bounds it (False: every rate passed, so the answer is a lower bound).

    Walks up the rates and stops at the first one over the limit (a sweep's latency only grows with
    load; a lucky overloaded point after a failure does not count). Between the last passing and the
    first failing rate it interpolates linearly in log(latency), which follows the fast growth near
    saturation better than latency itself. Returns 0 when even the lowest rate fails.
    Example: limit 2 s, points (1, 0.5 s) (2, 1 s) (4, 4 s) -> 2 + 2 * log(2/1)/log(4/1) = 3.0 req/s.
    """
    ordered = sorted((r, lat) for r, lat in points if math.isfinite(r))
    best = 0.0
    prev: tuple[float, float] | None = None
    for rate, lat in ordered:
        if not math.isfinite(lat) or lat > limit:
            if prev is None:
                return 0.0, True
            r0, l0 = prev
            if not math.isfinite(lat) or l0 <= 0:
                return r0, True
            frac = (math.log(limit) - math.log(l0)) / (math.log(lat) - math.log(l0))
            return r0 + (rate - r0) * min(max(frac, 0.0), 1.0), True
        best, prev = rate, (rate, lat)
    return best, False
