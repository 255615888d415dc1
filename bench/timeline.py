"""Per-request timelines joined with the engine's steps, the batch matrix, and Chrome trace export.

For each request, every step of the run falls in one of: not yet arrived, waiting (arrived, not in
the step), prefill (a chunk of its prompt, or a recompute after preemption), decode (one new token),
or done. From that a run can say, per request, whether it was queueing, held back while the batch
had free seats (token budget or KV blocks, or a static batch that admits nobody), or slowed down
because its decode steps shared the batch with someone's prefill.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from bench.results import RequestResult, RunResult, StepSample

# Batch-matrix cell codes (requests x steps); also the colour index of the batch-timeline plot.
ABSENT, WAITING, PREFILL, DECODE = 0, 1, 2, 3


def _ordered(run: RunResult) -> list[RequestResult]:
    return sorted(run.requests, key=lambda r: (r.arrival, r.request_id))


def _done_at(r: RequestResult) -> float:
    if r.token_times:
        return r.token_times[-1]
    return r.finished if r.finished is not None else float("inf")


def batch_matrix(run: RunResult) -> tuple[list[str], list[list[int]]]:
    """Rows: requests by arrival; columns: steps. A cell says what the request did in that step."""
    reqs = _ordered(run)
    index = {r.request_id: i for i, r in enumerate(reqs)}
    prompt = {r.request_id: r.num_prompt_tokens for r in reqs}
    rows = [[ABSENT] * len(run.steps) for _ in reqs]
    for col, step in enumerate(run.steps):
        in_step = {}
        for rid, n, before in step.batch:
            # A decode computes one token past the prompt; anything else is (re)computing the prompt.
            in_step[rid] = DECODE if n == 1 and before >= prompt.get(rid, 0) else PREFILL
        for r in reqs:
            code = in_step.get(r.request_id)
            if code is None and r.arrival <= step.start and _done_at(r) > step.start:
                code = WAITING
            rows[index[r.request_id]][col] = code or ABSENT
    return [r.request_id for r in reqs], rows


def request_timelines(run: RunResult, max_num_seqs: int | None = None) -> list[dict[str, Any]]:
    """One record per request: its instants, the steps it took part in, and a diagnosis of its waits.

    ``held_with_free_seats`` counts steps in which the request was waiting although the batch had
    fewer than ``max_num_seqs`` sequences: it was held back by the token budget, KV blocks or the
    batching rule, not by the sequence limit. ``held_with_free_seats_and_budget`` narrows that to
    steps that also left token budget unused: only KV blocks (or a static batch) can explain those.
    """
    seats = max_num_seqs or int(run.config.get("max_num_seqs", 0)) or None
    budget = int(run.config.get("max_num_batched_tokens", 0)) or None
    ids, matrix = batch_matrix(run)
    by_id = {r.request_id: r for r in run.requests}
    out = []
    for rid, row in zip(ids, matrix, strict=True):
        r = by_id[rid]
        prefill_steps = [run.steps[c].step for c, v in enumerate(row) if v == PREFILL]
        decode_cols = [c for c, v in enumerate(row) if v == DECODE]
        wait_cols = [c for c, v in enumerate(row) if v == WAITING]
        slowed = [c for c in decode_cols if _has_prefill(run.steps[c], rid, by_id)]
        rec: dict[str, Any] = {
            "request_id": rid,
            "prompt_tokens": r.num_prompt_tokens,
            "output_tokens": r.num_output_tokens,
            "arrival": r.arrival,
            "first_scheduled": r.first_scheduled,
            "prefill_done": r.prefill_done,
            "first_token": r.token_times[0] if r.token_times else None,
            "finished": r.finished,
            "preemptions": r.num_preemptions,
            "ttft": r.ttft,
            "tpot": r.tpot,
            "prefill_steps": prefill_steps,
            "decode_steps": [run.steps[c].step for c in decode_cols],
            "waiting_steps": len(wait_cols),
            "decode_steps_sharing_a_prefill": len(slowed),
            "events": [[name, t, attrs] for name, t, attrs in r.events],
        }
        if seats is not None:
            rec["held_with_free_seats"] = sum(1 for c in wait_cols if run.steps[c].num_scheduled_seqs < seats)
        if seats is not None and budget is not None:
            rec["held_with_free_seats_and_budget"] = sum(
                1
                for c in wait_cols
                if run.steps[c].num_scheduled_seqs < seats and run.steps[c].num_scheduled_tokens < budget
            )
        if slowed and len(slowed) < len(decode_cols):
            slowed_set = set(slowed)
            pure = [run.steps[c].duration for c in decode_cols if c not in slowed_set]
            mixed = [run.steps[c].duration for c in slowed]
            rec["decode_step_ms_pure"] = 1e3 * sum(pure) / len(pure)
            rec["decode_step_ms_with_prefill"] = 1e3 * sum(mixed) / len(mixed)
        out.append(rec)
    return out


def _has_prefill(step: StepSample, rid: str, by_id: dict[str, RequestResult]) -> bool:
    for other, n, before in step.batch:
        if other == rid:
            continue
        r = by_id.get(other)
        if r is not None and (n > 1 or before < r.num_prompt_tokens):
            return True
    return False


def _us(t: float) -> float:
    return round(t * 1e6, 1)


def chrome_trace(runs: Iterable[RunResult]) -> dict[str, Any]:
    """Chrome / Perfetto trace JSON (open in ui.perfetto.dev or chrome://tracing).

    One process per run: thread 0 holds the steps (split into schedule / prepare / model + sampling /
    postprocess) and counters (running, waiting, scheduled tokens, KV usage); each request gets its own
    thread with spans queued -> prefill -> decode and an instant at its first token.
    """
    events: list[dict[str, Any]] = []
    for pid, run in enumerate(runs, start=1):
        meta = {"ph": "M", "pid": pid}
        events.append({**meta, "name": "process_name", "args": {"name": f"{run.target} {run.label}"}})
        events.append({**meta, "tid": 0, "name": "thread_name", "args": {"name": "engine steps"}})
        for s in run.steps:
            events.extend(_step_events(pid, s))
        for tid, r in enumerate(_ordered(run), start=1):
            events.append({**meta, "tid": tid, "name": "thread_name", "args": {"name": r.request_id}})
            events.extend(_request_events(pid, tid, r))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _step_events(pid: int, s: StepSample) -> list[dict[str, Any]]:
    base = {"pid": pid, "tid": 0}
    args = {
        "scheduled_tokens": s.num_scheduled_tokens,
        "seqs": s.num_scheduled_seqs,
        "decode_seqs": s.num_decode_seqs,
        "running": s.num_running,
        "waiting": s.num_waiting,
        "kv_usage": round(s.kv_usage, 4),
        "preemptions": s.step_preemptions,
        "requests": [f"{rid}:{n}" for rid, n, _ in s.batch],
    }
    events: list[dict[str, Any]] = [
        {
            **base,
            "ph": "X",
            "name": f"step {s.step}",
            "cat": "step",
            "ts": _us(s.start),
            "dur": _us(s.duration),
            "args": args,
        }
    ]
    t = s.start
    phases = [
        ("schedule", s.schedule_time),
        ("prepare inputs", s.prepare_time),
        ("model + sampling", s.model_time),
        ("postprocess", max(0.0, s.duration - s.schedule_time - s.execute_time)),
    ]
    for name, dur in phases:
        events.append({**base, "ph": "X", "name": name, "cat": "phase", "ts": _us(t), "dur": _us(dur)})
        t += dur
    counters = {
        "requests": {"running": s.num_running, "waiting": s.num_waiting},
        "scheduled tokens": {"tokens": s.num_scheduled_tokens},
        "kv usage": {"usage": s.kv_usage},
    }
    for name, values in counters.items():
        events.append({"pid": pid, "ph": "C", "name": name, "ts": _us(s.start), "args": values})
    return events


def _request_events(pid: int, tid: int, r: RequestResult) -> list[dict[str, Any]]:
    base = {"pid": pid, "tid": tid, "ph": "X", "cat": "request"}
    first_token = r.token_times[0] if r.token_times else None
    end = _done_at(r)
    events = []
    spans: list[tuple[str, float | None, float | None]]
    if r.first_scheduled is not None and r.prefill_done is not None:
        spans = [
            ("queued", r.arrival, r.first_scheduled),
            ("prefill", r.first_scheduled, r.prefill_done),
            ("decode", r.prefill_done, end),
        ]
    else:  # targets without step records: waiting until the first token, then decoding
        spans = [("waiting", r.arrival, first_token), ("decode", first_token, end)]
    for name, start, stop in spans:
        if start is not None and stop is not None and stop != float("inf") and stop >= start:
            events.append({**base, "name": name, "ts": _us(start), "dur": _us(stop - start)})
    if first_token is not None:
        events.append(
            {"pid": pid, "tid": tid, "ph": "i", "s": "t", "name": "first token", "ts": _us(first_token)}
        )
    for name, t, attrs in r.events:  # the engine's own lifecycle marks, where it recorded them
        if name != "first_token":
            events.append(
                {"pid": pid, "tid": tid, "ph": "i", "s": "t", "name": name, "ts": _us(t), "args": attrs}
            )
    return events
