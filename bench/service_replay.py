"""The validation through the whole service path: the trace replayed by streaming clients against a
gateway, Kafka (tansu on loopback) and N worker processes, next to the simulator's prediction with
the path's own latencies (``python -m bench validate --service``).

What the path adds to an in-process engine, and how the prediction accounts for it:

    intake     gateway admission, produce, and the worker's fetch: tansu answers a fetch when
               fetch_max_wait expires, so a request waits about that long before any engine sees
               it; modelled as ServicePath.intake_s = kafka_fetch_max_wait_ms (the setting the
               workers run with), and the run's own (worker claim - gateway enqueue, from the job
               records, at its lowest decile where no queue formed) is reported beside it
    fetch      the worker takes from Kafka only while its engine's waiting queue is below
               max_waiting: modelled as is (FleetConfig.max_waiting)
    delivery   Redis publish, the gateway's SSE: a constant on every token, so TPOT keeps none of
               it; not modelled (a few hundred microseconds on loopback)
    engine     the engine core in its own process (IPC each step) and the worker's I/O: not in the
               cost model; the per-figure error after intake is what they cost

Token times come from the stream: TTFT is the first chunk with text, TPOT the span to the last chunk
over max_tokens - 1 (every request generates exactly max_tokens: EOS is ignored). The streaming client
(``CompletionsStream``, ``stream_spec``, ``replay``) also drives the under-load measurement of
``python -m bench service`` (bench/service_load.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from bench.stats import percentile as _pct


@dataclass
class Streamed:
    """One streamed request as its client saw it. ``first`` and ``last`` (the first and last chunk with
    text) are seconds after the replay's start on the monotonic clock; the ``*_wall`` instants are
    ``time.time()``, comparable with the stamps the gateway and worker write into the job record."""

    request_id: str = ""  # the response id ("" until a chunk arrives)
    sent_wall: float | None = None
    first: float | None = None
    last: float | None = None
    first_wall: float | None = None
    finish_reason: str | None = None  # of the last choice that said one; None: the stream ended early
    # Seconds from the scheduled arrival to the send: the load generator's own lag (its event loop busy
    # with other streams), which TTFT, counted from the scheduled arrival, includes on either path.
    lag: float | None = None


class CompletionsStream:
    """The load generator's HTTP client: streaming ``POST /v1/completions`` on one ``httpx.AsyncClient``,
    each server-sent event decoded as plain JSON. The ``openai`` package builds a typed model for every
    chunk; at a few hundred streams that is most of this process's CPU, taken from the cores the stack
    runs on, and it shows up as send lag in the stack's TTFT (as a load generator should not). The
    tests drive the gateway with the ``openai`` package; this measures it."""

    def __init__(self, base_url: str, timeout: float = 600.0) -> None:
        import httpx

        # No pool bound: a saturation burst opens a stream per request at once (httpx's default is 100).
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            timeout=timeout,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
            headers={"Authorization": "Bearer bench"},
        )

    async def chunks(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks as dicts, up to ``[DONE]``. A non-200 answer raises with its body."""
        async with self._http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return
                chunk: dict[str, Any] = msgspec.json.decode(data)
                yield chunk

    async def close(self) -> None:
        await self._http.aclose()


async def stream_spec(client: CompletionsStream, spec: Any, t0: float, name: str) -> Streamed:
    """Send ``spec`` at ``t0 + spec.arrival`` (monotonic), greedy with EOS ignored and streaming, and
    note when its chunks arrive."""
    await asyncio.sleep(max(0.0, t0 + spec.arrival - time.monotonic()))
    out = Streamed(sent_wall=time.time(), lag=time.monotonic() - t0 - spec.arrival)
    body = {
        "model": name,
        "prompt": list(spec.prompt_token_ids),
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    async for chunk in client.chunks(body):
        out.request_id = out.request_id or chunk.get("id", "")
        choices = chunk.get("choices") or ()
        if not choices:
            continue
        choice = choices[0]
        if choice.get("text"):
            out.last = time.monotonic() - t0
            if out.first is None:
                out.first, out.first_wall = out.last, time.time()
        out.finish_reason = choice.get("finish_reason") or out.finish_reason
    return out


def quiet_collector() -> None:
    """Before a measured replay: out of the cyclic collector's sight whatever this process holds by now
    (torch, an engine, earlier runs' results). A full collection over it takes tens to hundreds of
    milliseconds, long enough to hold every stream's event loop (or the engine thread's step) still,
    and it lands in some request's TTFT as if the path under test had been slow."""
    from engine.platform.memory import freeze_heap

    freeze_heap()


async def replay(client: CompletionsStream, specs: Sequence[Any], name: str) -> list[Streamed]:
    """Every spec at its arrival time from now, concurrently; results in the order of ``specs``."""
    quiet_collector()
    t0 = time.monotonic()
    return list(await asyncio.gather(*(stream_spec(client, s, t0, name) for s in specs)))


async def warm_up(client: CompletionsStream, warmup: Sequence[Any], name: str) -> None:
    """Unmeasured: every worker's engine warm and every partition assigned before a trace starts."""
    await asyncio.gather(*(stream_spec(client, s, time.monotonic(), name) for s in warmup))
    await asyncio.sleep(2.0)


async def _drive(
    url: str, specs: Sequence[Any], name: str, warmup: Sequence[Any]
) -> list[tuple[float | None, float | None]]:
    client = CompletionsStream(url)
    try:
        await warm_up(client, warmup, name)
        return [(s.first, s.last) for s in await replay(client, specs, name)]
    finally:
        await client.close()


def measure_service(
    model: str,
    specs: Sequence[Any],
    engine_args: dict[str, Any],
    *,
    workers: int,
    threads: int,
    max_waiting: int,
    partitions: int,
    fetch_max_wait_ms: int,
) -> dict[str, Any]:
    """Run the stack, replay ``specs`` through it, return the figures and the intake it measured."""
    import redis as redis_lib

    from engine.config import ModelConfig
    from harness.stack import build_stack
    from inflight.plan.workload import warmup_specs
    from services.common import keys

    cfg = ModelConfig.from_path(model)
    warm = [w for w in warmup_specs(cfg.vocab_size, int(engine_args.get("max_model_len", 1024)))] * (
        2 * workers
    )
    env = {
        "INFLIGHT_SERVED_MODEL_NAME": "validate",
        "INFLIGHT_KAFKA_PARTITIONS": str(partitions),
        "INFLIGHT_KAFKA_FETCH_MAX_WAIT_MS": str(fetch_max_wait_ms),
        "INFLIGHT_MAX_PENDING": str(10 * len(specs) + 100),  # no 429: the trace is the load
        "INFLIGHT_MAX_CONCURRENT_PER_KEY": str(10 * len(specs) + 100),  # the trace's clients share one key
        "INFLIGHT_FETCH_MAX_WAITING": str(max_waiting),
        "INFLIGHT_ENGINE_ARGS": json.dumps(engine_args),
        "INFLIGHT_TORCH_THREADS": str(threads),
        "INFLIGHT_LOG_LEVEL": "WARNING",
    }
    workdir = Path(tempfile.mkdtemp(prefix="inflight-validate-"))
    stack = build_stack(model, workdir, workers=workers, tag="validate", env=env)
    try:
        times = asyncio.run(_drive(stack.url, specs, "validate", warm))
        records = redis_lib.Redis.from_url(stack.redis.url, decode_responses=True)
        intake = _intake(records, keys)
    finally:
        stack.close()
    return {**service_figures(specs, times), "measured_intake_s": intake}


def _intake(records: Any, keys: Any) -> float:
    """Worker claim - gateway enqueue over the run's job records, lowest decile (no engine queue)."""
    waits = []
    for key in records.scan_iter(keys.record("*")):
        rec = records.hgetall(key)
        if "created" in rec and "started" in rec:
            waits.append(float(rec["started"]) - float(rec["created"]))
    return _pct(waits, 10)


def service_figures(
    specs: Sequence[Any], times: Sequence[tuple[float | None, float | None]]
) -> dict[str, float]:
    ttft, tpot, ends, tokens = [], [], [], 0
    for spec, (first, last) in zip(specs, times, strict=True):
        if first is None or last is None:
            continue
        ttft.append(first - spec.arrival)
        if spec.max_tokens > 1:
            tpot.append((last - first) / (spec.max_tokens - 1))
        ends.append(last)
        tokens += spec.max_tokens
    end = max([*ends, *(s.arrival for s in specs)], default=0.0)
    return {
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50),
        "tpot_p99_s": _pct(tpot, 99),
        "output_tok_s": tokens / end if end > 0 else math.nan,
        "duration_s": end,
        "num_completed": float(len(ends)),
    }


def validate_service(
    model: str,
    specs: Sequence[Any],
    engine_args: dict[str, Any],
    cost: Any,
    *,
    workers: int,
    threads: int,
    max_waiting: int = 16,
    partitions: int = 8,
    fetch_max_wait_ms: int = 5,
    shape_cache: int | None = None,
) -> dict[str, Any]:
    from inflight.plan.simulate import FleetConfig, ServicePath, simulate
    from inflight.plan.traffic import from_specs
    from inflight.plan.validate import FIGURES, compare

    measured = measure_service(
        model,
        specs,
        engine_args,
        workers=workers,
        threads=threads,
        max_waiting=max_waiting,
        partitions=partitions,
        fetch_max_wait_ms=fetch_max_wait_ms,
    )
    fleet = FleetConfig(
        workers=workers,
        partitions=partitions,
        max_waiting=max_waiting,
        engine=engine_args,
        service=ServicePath(intake_s=fetch_max_wait_ms / 1e3),
        # Workers start cold but for the warm-up's prompts and small decode batches, and every padded
        # row count where the engine pads (built when the model loaded).
        cold_shapes=True,
        warm_shapes=frozenset(cost.rows(n) for n in (*range(1, 9), 24, 130, 500))
        | frozenset(cost.padding.built()),
        shape_cache=shape_cache,
    )
    result = simulate(from_specs(specs), cost, fleet)
    predicted = {k: float(result[k]) for k in (*FIGURES, "utilisation")}
    return {
        "workers": workers,
        "threads_per_worker": threads,
        "num_requests": len(specs),
        "path": "service",
        "measured": measured,
        "predicted_from_calibration": predicted,
        "error_from_calibration": compare(measured, predicted),
    }


def report_service(result: dict[str, Any], tolerance: float = 0.2) -> str:
    from inflight.plan.validate import FIGURES

    m, p, e = result["measured"], result["predicted_from_calibration"], result["error_from_calibration"]
    lines = [
        f"service path: {result['workers']} worker(s), {result['threads_per_worker']} thread(s) each, "
        f"{result['num_requests']} requests, {int(m['num_completed'])} completed",
        f"{'figure':<13} {'measured':>10} {'predicted':>10} {'error':>7}",
    ]
    for k in FIGURES:
        mark = "  <- over" if abs(e[k]) > tolerance else ""
        lines.append(f"{k:<13} {m[k]:>10.4g} {p[k]:>10.4g} {100 * e[k]:>+6.0f}%{mark}")
    lines.append(
        f"intake: measured {1e3 * m['measured_intake_s']:.1f} ms (lowest decile), modelled: fetch_max_wait; "
        f"simulated utilisation {p['utilisation']:.2f}"
    )
    return "\n".join(lines)
