"""Where a request's time to its first token went through the stack, from its job record and the
client's clock: the stages of ``python -m bench service`` and ``python -m bench batch-interference``.

The gateway stamps the record's ``created`` (enqueue) and the worker its ``started`` (claim) and
``ttft_worker_s``; where the worker also wrote the engine core's instants (``engine_arrival_s``,
``ttft_engine_s``), its stage splits at the core.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.service_replay import Streamed
from bench.stats import percentile

STAGES = (
    "client -> gateway enqueue",
    "gateway enqueue -> worker claim",
    "worker fetch -> first token",
    "first token -> client",
)
# The worker's stage in three: its fetch to the engine core's arrival, the core's arrival to its first
# token (queue and first step), and the first token's way back to the worker's stream.
WORKER_PARTS = (
    "  worker fetch -> engine core",
    "  engine core -> first token",
    "  engine core -> worker",
)


def records(redis: Any, keys: Any, streamed: Sequence[Streamed]) -> dict[str, dict[str, str]]:
    pipe = redis.pipeline(transaction=False)
    ids = [s.request_id for s in streamed if s.request_id]
    for request_id in ids:
        pipe.hgetall(keys.record(request_id))
    return dict(zip(ids, pipe.execute(), strict=True))


def breakdown(s: Streamed, rec: dict[str, str]) -> dict[str, float] | None:
    """One request's TTFT at the client and its stages (seconds): STAGES where its record has every
    stamp, WORKER_PARTS too where it has the engine core's; None without the stamps."""
    if s.sent_wall is None or s.first_wall is None or not {"created", "started", "ttft_worker_s"} <= set(rec):
        return None
    created, started, worker_ttft = float(rec["created"]), float(rec["started"]), float(rec["ttft_worker_s"])
    values = (created - s.sent_wall, started - created, worker_ttft, s.first_wall - started - worker_ttft)
    out = {"ttft": s.first_wall - s.sent_wall, **dict(zip(STAGES, values, strict=True))}
    if {"engine_arrival_s", "ttft_engine_s"} <= set(rec):
        to_core, in_core = float(rec["engine_arrival_s"]), float(rec["ttft_engine_s"])
        parts = (to_core, in_core, worker_ttft - to_core - in_core)
        out.update(zip(WORKER_PARTS, parts, strict=True))
    return out


def stages(streamed: Sequence[Streamed], records: dict[str, dict[str, str]]) -> dict[str, dict[str, float]]:
    """Median and p99 (ms) of each stage of STAGES, over the requests whose record has every stamp, and of
    each part of the worker's stage (WORKER_PARTS) where the record has the engine core's stamps too."""
    values: dict[str, list[float]] = {name: [] for name in (*STAGES, *WORKER_PARTS)}
    for s in streamed:
        for name, value in (breakdown(s, records.get(s.request_id, {})) or {}).items():
            if name in values:
                values[name].append(value)
    return {
        name: {"p50_ms": 1e3 * percentile(v, 50), "p99_ms": 1e3 * percentile(v, 99), "count": len(v)}
        for name, v in values.items()
        if v or name in STAGES
    }


def slowest(
    streamed: Sequence[Streamed], records: dict[str, dict[str, str]], k: int = 5
) -> list[dict[str, float]]:
    """The ``k`` requests with the longest TTFT, each with its stages (ms): whether a tail comes from one
    stage or from every process at once."""
    rows = [b for s in streamed if (b := breakdown(s, records.get(s.request_id, {}))) is not None]
    rows.sort(key=lambda b: b["ttft"], reverse=True)
    return [{f"{name.strip()} ms": round(1e3 * v, 2) for name, v in b.items()} for b in rows[:k]]
