"""The stack under load beside the engine alone: the third measurement of ``python -m bench service``.

Capacity first, on the engine alone: an in-process ``InprocClient`` with the worker's engine arguments
and torch threads, every request of the load's length mix at t = 0. Its saturation throughput sets the
load. Saturation throughput, on either path: requests completed per second from t = 0 until the
completion that leaves max_num_seqs requests unfinished (after it no batch can be full, and the drain's
length depends on the few longest requests only).

Then the same seeded workloads run both ways:

    poisson   exponential gaps, mean rate LOAD (default 0.8) x capacity
    gamma     gamma gaps at the same mean rate, shape 0.25 (CV 2: bursts, then silences)
    burst     every request at t = 0: the throughput ratio stack / engine

through the whole stack (gateway, Kafka, one worker, Redis pub/sub, SSE; streaming HTTP clients)
and through the engine alone (its streamed outputs): the same arrival schedule, prompt token ids and
max_tokens, greedy, EOS ignored. TTFT = first text received - scheduled arrival; TPOT = (last text -
first text) / (max_tokens - 1); a request completed when it finished with reason "length". The send lag
(scheduled arrival to the send) is the load generator's own delay, in TTFT on both paths: on the stack's
path its streaming clients share this process's event loop and the host's cores with the stack.

Where a stack request's time to its first token goes, from its job record (``created``: the gateway's
enqueue; ``started``: the worker's claim; ``ttft_worker_s``: the worker's fetch to the first token out of
its engine) and the client's clock, all on this host's wall clock:

    client -> gateway enqueue         HTTP, validation
    gateway enqueue -> worker claim   admission, produce, Kafka, the worker's fetch bound, the claim
    worker fetch -> first token       claim, hand-off to the engine core, engine queue, prefill
    first token -> client             publish, Redis pub/sub, the gateway's SSE

The stages add up to the time from sending to the first token. The worker counts from its fetch, which
comes a little before its claim stamp: the two middle stages both hold that gap and the last is short by
it (the time the claim's task takes to start: short while the worker's event loop is idle, longer when
it is busy). Not observable from the
records: admission + produce apart from the Kafka wait, and the worker's own queue apart from the
engine's queue and prefill; the traces (OTEL_* settings) hold both splits.

And who kept the host's cores busy during each run, as CPU seconds per second of it: on the stack's runs
the gateway, the worker, its engine core, the broker, Redis and this process (the clients); on the
engine's, this process (the engine and its caller); on both, the rest of the host. On a host with few
cores the stack's processes take their CPU from the engine core, and its steps slow down; on a shared
host the rest of the host shows when other work did the same to either path.
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.process_cpu import CpuMeter, stack_processes
from bench.service_replay import CompletionsStream, Streamed, quiet_collector, replay, warm_up
from bench.service_stages import STAGES, WORKER_PARTS, records, stages
from bench.stats import percentile
from inflight.plan.workload import LengthMix, RequestSpec, describe, synthetic, warmup_specs

SERVED_NAME = "bench"
# TTFT p99 through the stack <= the engine alone's + this, per trace. The gamma trace's bursts arrive
# many requests within a millisecond or two, each one admitted, produced and fetched in turn: twice the
# Poisson trace's allowance.
TARGET_ADDED_TTFT_P99_MS = {"poisson": 25.0, "gamma": 50.0}
TARGET_THROUGHPUT_RATIO = 0.95  # saturation throughput through the stack / the engine alone's
TRACES = ("poisson", "gamma")


@dataclass(frozen=True)
class LoadConfig:
    model: str
    engine_args: dict[str, Any] = field(default_factory=dict)  # the worker's and the in-process engine's
    threads: int = 1  # torch threads on both paths (0: torch's default)
    mix: LengthMix = field(default_factory=LengthMix)
    # Per trace: enough that p99 is not simply the slowest request or two.
    num_requests: int = 200
    # 0: eight batches' worth. Saturation is a steady state: with two batches' worth, the time the
    # stack takes to admit the whole burst at once (a few ms of gateway and client CPU per request)
    # is a large share of the measured window, and the figure says more about the ramp than the rate.
    burst_requests: int = 0
    load: float = 0.8  # of the engine's saturation throughput
    rate: float = 0.0  # requests/s; when set, instead of load x capacity
    gamma_shape: float = 0.25
    seed: int = 0
    fetch_wait_ms: int = 0  # the stack's fetch wait; 0: the loopback broker's (harness.stack)

    @property
    def max_num_seqs(self) -> int:
        from engine.config import EngineArgs

        return int(self.engine_args.get("max_num_seqs", EngineArgs.max_num_seqs))

    @property
    def num_burst(self) -> int:
        return self.burst_requests or 8 * self.max_num_seqs


def workloads(cfg: LoadConfig, vocab_size: int, rate: float) -> dict[str, list[RequestSpec]]:
    """The traces at ``rate`` requests/s. One seed: the same prompts and lengths in every trace (the
    lengths come from a stream of their own), only the arrivals differ."""
    cv = 1.0 / math.sqrt(cfg.gamma_shape)  # a gamma's CV is 1/sqrt(shape)
    return {
        name: synthetic(
            cfg.num_requests, rate, vocab_size, process=name, cv=cv, mix=cfg.mix, seed=cfg.seed, prefix=name
        )
        for name in TRACES
    }


def burst(cfg: LoadConfig, vocab_size: int) -> list[RequestSpec]:
    return synthetic(
        cfg.num_burst, math.inf, vocab_size, process="burst", mix=cfg.mix, seed=cfg.seed, prefix="burst"
    )


# ---- the engine alone ---------------------------------------------------------------------------------
async def _engine_stream(engine: Any, spec: RequestSpec, t0: float) -> Streamed:
    from engine.inputs import EngineRequest
    from engine.sampling_params import SamplingParams

    await asyncio.sleep(max(0.0, t0 + spec.arrival - time.monotonic()))
    out = Streamed(
        request_id=spec.request_id, sent_wall=time.time(), lag=time.monotonic() - t0 - spec.arrival
    )
    params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
    async for item in engine.generate(EngineRequest(spec.request_id, list(spec.prompt_token_ids), params)):
        for c in item.outputs:
            if c.text:  # text, as the stack's client sees it: a token that decodes to nothing yet waits
                out.last = time.monotonic() - t0
                if out.first is None:
                    out.first, out.first_wall = out.last, time.time()
            out.finish_reason = c.finish_reason or out.finish_reason
    return out


async def engine_replay(engine: Any, specs: Sequence[RequestSpec]) -> list[Streamed]:
    """Every spec at its arrival time from now, into an ``InprocClient``; results in spec order."""
    quiet_collector()
    t0 = time.monotonic()
    return list(await asyncio.gather(*(_engine_stream(engine, s, t0) for s in specs)))


# ---- figures ------------------------------------------------------------------------------------------
def _ms(values: Sequence[float]) -> dict[str, float]:
    return {f"p{q}_ms": 1e3 * percentile(values, q) for q in (50, 90, 99)}


def completed(streamed: Sequence[Streamed]) -> int:
    return sum(1 for s in streamed if s.finish_reason == "length" and s.last is not None)


def trace_figures(specs: Sequence[RequestSpec], streamed: Sequence[Streamed]) -> dict[str, Any]:
    """TTFT and TPOT percentiles (ms) and output tokens/s of one replay (completed requests only)."""
    ttft, tpot, tokens, end = [], [], 0, 0.0
    for spec, s in zip(specs, streamed, strict=True):
        if s.finish_reason != "length" or s.first is None or s.last is None:
            continue
        ttft.append(s.first - spec.arrival)
        if spec.max_tokens > 1:
            tpot.append((s.last - s.first) / (spec.max_tokens - 1))
        tokens += spec.max_tokens
        end = max(end, s.last)
    return {
        "ttft": _ms(ttft),
        "tpot": _ms(tpot),
        "send_lag": _ms([s.lag for s in streamed if s.lag is not None]),
        "output_tok_s": tokens / end if end > 0 else math.nan,
        "duration_s": end,
        "num_requests": len(specs),
        "num_completed": completed(streamed),
    }


def saturation_figures(
    specs: Sequence[RequestSpec], streamed: Sequence[Streamed], max_num_seqs: int
) -> dict[str, Any]:
    """Requests/s over the saturated window (see the module docstring), and output tokens/s over it
    counting the requests completed in it; the whole run's output tokens/s beside them."""
    ends = sorted(
        (s.last, spec.max_tokens)
        for spec, s in zip(specs, streamed, strict=True)
        if s.finish_reason == "length" and s.last is not None
    )
    k = len(specs) - max_num_seqs
    window = ends[k - 1][0] if k >= 1 and len(ends) >= k and ends[k - 1][0] > 0 else math.nan
    whole = ends[-1][0] if ends else math.nan
    return {
        "requests_per_s": k / window if math.isfinite(window) else math.nan,
        "window_output_tok_s": sum(n for _, n in ends[:k]) / window if math.isfinite(window) else math.nan,
        "window_s": window,
        "run_output_tok_s": sum(n for _, n in ends) / whole if ends else math.nan,
        "duration_s": whole,
        "num_requests": len(specs),
        "num_completed": completed(streamed),
    }


def judge(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target: the measured value, the bound, and whether it passed."""
    out: dict[str, dict[str, Any]] = {}
    for name in TRACES:
        added = result["stack"][name]["ttft"]["p99_ms"] - result["engine"][name]["ttft"]["p99_ms"]
        out[f"{name}: TTFT p99 stack - engine (ms)"] = {
            "value": added,
            "bound": f"<= {TARGET_ADDED_TTFT_P99_MS[name]:g}",
            "passed": bool(added <= TARGET_ADDED_TTFT_P99_MS[name]),
        }
    ratio = result["throughput_ratio"]
    out["saturation: throughput stack / engine"] = {
        "value": ratio,
        "bound": f">= {TARGET_THROUGHPUT_RATIO:g}",
        "passed": bool(ratio >= TARGET_THROUGHPUT_RATIO),
    }
    return out


# ---- the two paths ------------------------------------------------------------------------------------
def _resolve_threads(threads: int) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


async def _engine_runs(cfg: LoadConfig, vocab_size: int, say: Callable[[str], None]) -> dict[str, Any]:
    from engine.core.inproc_client import InprocClient

    engine = InprocClient.from_engine_args(model=cfg.model, **cfg.engine_args)
    await engine.start()
    try:
        await engine_replay(engine, warmup_specs(vocab_size, engine.max_model_len))
        specs = burst(cfg, vocab_size)
        say(f"  engine alone: capacity, {len(specs)} requests at t=0 ...")
        meter = CpuMeter({})
        sat = saturation_figures(specs, await engine_replay(engine, specs), cfg.max_num_seqs)
        sat["cpu_cores"] = meter.cores()
        capacity = sat["requests_per_s"]
        if not capacity > 0:
            raise RuntimeError(f"no saturation throughput from {len(specs)} requests: {sat}")
        rate = cfg.rate or cfg.load * capacity
        out: dict[str, Any] = {"capacity_req_s": capacity, "rate_req_s": rate, "burst": sat}
        out["max_model_len"] = engine.max_model_len
        traces = workloads(cfg, vocab_size, rate)
        for name, trace in traces.items():
            say(f"  engine alone: {name}, {len(trace)} requests at {rate:.2f}/s ...")
            meter = CpuMeter({})
            out[name] = trace_figures(trace, await engine_replay(engine, trace))
            out[name]["cpu_cores"] = meter.cores()
        out["workloads"] = {"burst": describe(specs), **{n: describe(t) for n, t in traces.items()}}
        return out
    finally:
        await engine.shutdown()


def _stack_runs(
    cfg: LoadConfig,
    vocab_size: int,
    rate: float,
    max_model_len: int,
    say: Callable[[str], None],
    log_dir: Path | None,
) -> dict[str, Any]:
    from harness.stack import build_stack
    from services.common import keys

    env = {
        "INFLIGHT_SERVED_MODEL_NAME": SERVED_NAME,
        "INFLIGHT_MAX_PENDING": str(
            10 * max(cfg.num_requests, cfg.num_burst) + 100
        ),  # no 429: the load is the trace
        # Every client of the trace is one key: its in-flight bound must not refuse the burst either.
        "INFLIGHT_MAX_CONCURRENT_PER_KEY": str(10 * max(cfg.num_requests, cfg.num_burst) + 100),
        "INFLIGHT_ENGINE_ARGS": json.dumps(cfg.engine_args),
        "INFLIGHT_LOG_LEVEL": "WARNING",
    }
    if cfg.threads:
        env["INFLIGHT_TORCH_THREADS"] = str(cfg.threads)
    if cfg.fetch_wait_ms:
        env["INFLIGHT_KAFKA_FETCH_MAX_WAIT_MS"] = str(cfg.fetch_wait_ms)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="inflight-bench-load-"))
    say("  stack: starting (broker, Redis, one worker, the gateway) ...")
    stack = build_stack(cfg.model, log_dir, tag="bench-load", env=env)
    try:
        redis = stack.redis_client()

        async def drive() -> dict[str, Any]:
            client = CompletionsStream(stack.url)
            try:
                await warm_up(client, warmup_specs(vocab_size, max_model_len) * 2, SERVED_NAME)
                out: dict[str, Any] = {}
                groups = stack_processes(stack)  # the engine core is up since the warm-up
                specs = burst(cfg, vocab_size)
                say(f"  stack: saturation, {len(specs)} requests at t=0 ...")
                meter = CpuMeter(groups)
                streamed = await replay(client, specs, SERVED_NAME)
                out["burst"] = saturation_figures(specs, streamed, cfg.max_num_seqs)
                out["burst"]["cpu_cores"] = meter.cores()
                out["burst"]["stages"] = stages(streamed, records(redis, keys, streamed))
                for name, trace in workloads(cfg, vocab_size, rate).items():
                    say(f"  stack: {name}, {len(trace)} requests at {rate:.2f}/s ...")
                    meter = CpuMeter(groups)
                    streamed = await replay(client, trace, SERVED_NAME)
                    out[name] = trace_figures(trace, streamed)
                    out[name]["cpu_cores"] = meter.cores()
                    out[name]["stages"] = stages(streamed, records(redis, keys, streamed))
                return out
            finally:
                await client.close()

        return asyncio.run(drive())
    except BaseException:
        say(stack.logs())
        raise
    finally:
        stack.close()


def measure(
    cfg: LoadConfig, say: Callable[[str], None] = print, log_dir: Path | None = None
) -> dict[str, Any]:
    """Capacity on the engine alone, then the traces on the engine alone and through the stack."""
    from engine.config import ModelConfig

    vocab_size = ModelConfig.from_path(cfg.model).vocab_size
    _resolve_threads(cfg.threads)
    engine = asyncio.run(_engine_runs(cfg, vocab_size, say))
    rate, max_model_len = engine.pop("rate_req_s"), engine.pop("max_model_len")
    stack = _stack_runs(cfg, vocab_size, rate, max_model_len, say, log_dir)
    result: dict[str, Any] = {
        "config": {**asdict(cfg), "max_num_seqs": cfg.max_num_seqs, "num_burst": cfg.num_burst},
        "capacity_req_s": engine.pop("capacity_req_s"),
        "rate_req_s": rate,
        "workloads": engine.pop("workloads"),
        "engine": engine,
        "stack": stack,
        "throughput_ratio": stack["burst"]["requests_per_s"] / engine["burst"]["requests_per_s"],
        "added_ttft_p99_ms": {
            name: stack[name]["ttft"]["p99_ms"] - engine[name]["ttft"]["p99_ms"] for name in TRACES
        },
    }
    result["targets"] = judge(result)
    return result


# ---- the report ---------------------------------------------------------------------------------------
def _row(label: str, engine: float, stack: float, digits: int = 1) -> str:
    return f"  {label:<14}{engine:>10.{digits}f}{stack:>10.{digits}f}{stack - engine:>+11.{digits}f}"


def _completions(engine: dict[str, Any], stack: dict[str, Any]) -> str:
    done = f"{engine['num_completed']} (engine), {stack['num_completed']} (stack)"
    return f"completed {done} of {stack['num_requests']}"


def report(result: dict[str, Any]) -> str:
    """A table: each trace's figures side by side, the saturation ratio, the stages, the targets."""
    eng, stk = result["engine"], result["stack"]
    lines = [
        f"under load: capacity (engine alone) {result['capacity_req_s']:.2f} req/s; traces at "
        f"{result['rate_req_s']:.2f} req/s ({100 * result['rate_req_s'] / result['capacity_req_s']:.0f}%)",
        f"  {'':<14}{'engine':>10}{'stack':>10}{'stack-eng':>11}",
    ]
    for name in TRACES:
        e, s = eng[name], stk[name]
        lines.append(f"{name}: {_completions(e, s)}")
        for metric in ("ttft", "tpot"):
            for q in ("p50", "p90", "p99"):
                lines.append(_row(f"{metric.upper()} {q} ms", e[metric][f"{q}_ms"], s[metric][f"{q}_ms"]))
        for q in ("p50", "p99"):  # in TTFT on both paths: the clients' own delay in sending
            lines.append(_row(f"send lag {q} ms", e["send_lag"][f"{q}_ms"], s["send_lag"][f"{q}_ms"]))
        lines.append(_row("output tok/s", e["output_tok_s"], s["output_tok_s"]))
    e, s = eng["burst"], stk["burst"]
    lines.append(f"saturation: {_completions(e, s)}; throughput ratio {result['throughput_ratio']:.3f}")
    lines.append(_row("req/s", e["requests_per_s"], s["requests_per_s"], 2))
    lines.append(_row("run tok/s", e["run_output_tok_s"], s["run_output_tok_s"]))
    lines.append("stages of the stack's TTFT, ms (p50 / p99):")
    lines.append(f"  {'':<32}" + "".join(f"{n:>16}" for n in (*TRACES, "saturation")))
    for stage in (*STAGES, *WORKER_PARTS):
        if any(stage not in stk[n]["stages"] for n in (*TRACES, "burst")):
            continue
        cells = [stk[n]["stages"][stage] for n in (*TRACES, "burst")]
        lines.append(f"  {stage:<32}" + "".join(f"{c['p50_ms']:>8.1f} /{c['p99_ms']:>6.1f}" for c in cells))
    lines.append("cores busy (CPU seconds per second of the run):")
    for path, runs in (("engine alone", eng), ("stack", stk)):
        for run in (*TRACES, "burst"):
            cores = runs[run]["cpu_cores"]
            busy = ", ".join(f"{name} {value:.2f}" for name, value in cores.items())
            lines.append(f"  {path}, {'saturation' if run == 'burst' else run}: {busy}")
    lines.append("targets:")
    for name, t in result["targets"].items():
        lines.append(f"  {name}: {t['value']:.3g} ({t['bound']}) {'PASS' if t['passed'] else 'FAIL'}")
    return "\n".join(lines)
