"""``python -m bench service``: the full service path, through the gateway with the ``openai`` client.

Three measurements, one command (``make bench-service``), JSON plus a plot under ``--out``:

* Low load, one request at a time: the latency the service path (HTTP, admission, Kafka, worker,
  Redis pub/sub, SSE) adds over the same request run by an in-process ``InprocClient``. Each request
  is sent both ways, identical and greedy, so the pairwise difference is the service's overhead:
      added_i = service_latency_i - engine_latency_i        (p50 and p99 reported)
  for the whole response (non-streaming) and for the first token (streaming).
* Overload: many concurrent clients against a small admission bound. Reported: the admission rate
  sustained (accepted requests/s), the share answered 429, and the gateway's CPU time per request
  (user + system time of the gateway process over the window, per HTTP request it answered).
* Under load (``--no-load`` skips it, ``--load-only`` runs only it): one worker's capacity on the engine
  alone, then Poisson and gamma traces at 80% of it, and a saturating burst, through the stack and through
  the engine alone side by side (bench/service_load.py says how each figure is taken).

The broker (tansu) and Redis run on loopback, as in the tests; on such a machine the floor is about
4.4 ms p50 for a Kafka produce-to-consume and 0.24 ms for a Redis pub/sub round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
import redis as redis_lib

from bench import service_load, service_load_args
from bench.process_cpu import cpu_s
from harness.stack import build_stack
from services.common import keys

PROMPT = (
    "The quick brown fox jumps over the lazy dog. A continuous batching server keeps the accelerator busy"
)
TARGET_P50_MS, TARGET_P99_MS = 10.0, 25.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench service", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-results", help="directory for service.json and service.png")
    p.add_argument(
        "--model",
        default="tiny",
        help="model of the low-load and overload measurements: tiny, bench, smollm2 or a checkpoint path "
        "(default tiny, the random-weight test model)",
    )
    p.add_argument("--requests", type=int, default=200, help="low-load requests per path (default 200)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per low-load request (default 8)")
    p.add_argument("--overload-s", type=float, default=20.0, help="overload window in seconds (default 20)")
    p.add_argument("--concurrency", type=int, default=96, help="concurrent overload clients (default 96)")
    p.add_argument("--max-pending", type=int, default=16, help="the gateway's admission bound (default 16)")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads, in-process and in the worker alike (default 1: the stack's other processes "
        "need the host's other cores; 0 = torch's default)",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--no-load", action="store_true", help="skip the under-load measurement")
    which.add_argument("--load-only", action="store_true", help="run only the under-load measurement")
    service_load_args.add_arguments(p)
    return p


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _summary(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {
        "p50_ms": _pct(ms, 50),
        "p90_ms": _pct(ms, 90),
        "p99_ms": _pct(ms, 99),
        "mean_ms": statistics.fmean(ms),
    }


# ---- the in-process engine ---------------------------------------------------------------------
async def _engine_latencies(model: str, n: int, max_tokens: int) -> tuple[list[float], list[float]]:
    from engine.core.inproc_client import InprocClient
    from engine.inputs import EngineRequest
    from engine.sampling_params import SamplingParams

    engine = InprocClient.from_engine_args(model=model)
    await engine.start()
    totals, firsts = [], []
    try:
        for i in range(n + 10):  # the first 10 warm up
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            began = time.perf_counter()
            first = None
            async for _ in engine.generate(EngineRequest(f"bench-{i}", PROMPT, params)):
                first = first or time.perf_counter()
            if i >= 10:
                totals.append(time.perf_counter() - began)
                firsts.append((first or time.perf_counter()) - began)
    finally:
        await engine.shutdown()
    return totals, firsts


# ---- through the service -----------------------------------------------------------------------
def _service_latencies(
    client: openai.OpenAI, model: str, n: int, max_tokens: int, records: Any
) -> tuple[list[float], list[float], dict[str, list[float]]]:
    """Whole-response and first-token latencies, and where the whole response's time went.

    Stages come from the request's record, stamped by the gateway (created) and the worker (started,
    finished); all processes share this host's clock.
    """
    totals, firsts = [], []
    stages: dict[str, list[float]] = {name: [] for name in STAGES}
    extra = {"ignore_eos": True}
    for i in range(n + 10):
        start_wall, began = time.time(), time.perf_counter()
        resp = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body=extra
        )
        total, end_wall = time.perf_counter() - began, time.time()
        record = records.hgetall(keys.record(resp.id))
        began = time.perf_counter()
        first = None
        stream = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body=extra, stream=True
        )
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - began
        if i >= 10:
            totals.append(total)
            firsts.append(first if first is not None else time.perf_counter() - began)
            created, started, finished = (float(record[k]) for k in ("created", "started", "finished"))
            for name, value in zip(
                STAGES,
                (created - start_wall, started - created, finished - started, end_wall - finished),
                strict=True,
            ):
                stages[name].append(value)
    return totals, firsts, stages


STAGES = (
    "client -> gateway enqueue (HTTP, validation, tokenization)",
    "gateway enqueue -> worker claim (admission, produce, Kafka, claim)",
    "worker claim -> last token (engine, token events)",
    "last token -> client (done event, gateway, HTTP)",
)


async def _overload(
    url: str, model: str, seconds: float, concurrency: int, gateway_pid: int
) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=120)
    counts = {"accepted": 0, "rejected": 0, "failed": 0}
    accept_latencies: list[float] = []
    reject_latencies: list[float] = []
    stop_at = time.monotonic() + seconds

    async def one_client() -> None:
        while time.monotonic() < stop_at:
            began = time.perf_counter()
            try:
                await client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
                counts["accepted"] += 1
                accept_latencies.append(time.perf_counter() - began)
            except openai.RateLimitError:
                counts["rejected"] += 1
                reject_latencies.append(time.perf_counter() - began)
            except openai.OpenAIError:
                counts["failed"] += 1

    cpu_before, wall_before = cpu_s(gateway_pid), time.monotonic()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    cpu, wall = cpu_s(gateway_pid) - cpu_before, time.monotonic() - wall_before
    await client.close()
    answered = counts["accepted"] + counts["rejected"] + counts["failed"]
    return {
        **counts,
        "window_s": wall,
        "admission_rate_per_s": counts["accepted"] / wall,
        "share_429": counts["rejected"] / max(answered, 1),
        "gateway_cpu_s": cpu,
        "gateway_cpu_ms_per_request": 1000 * cpu / max(answered, 1),
        "gateway_cpu_utilisation": cpu / wall,
        "accepted_latency": _summary(accept_latencies) if accept_latencies else None,
        "rejected_latency": _summary(reject_latencies) if reject_latencies else None,  # 429 at once?
    }


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (["low_load", "overload"] if "low_load" in result else []) + (
        ["under_load"] if "under_load" in result else []
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    ax = dict(zip(panels, axes[0], strict=True))
    if "low_load" in ax:
        for name, series in result["raw_ms"].items():
            ordered = sorted(series)
            ax["low_load"].plot(ordered, [i / len(ordered) for i in range(1, len(ordered) + 1)], label=name)
        ax["low_load"].set_xlabel("ms")
        ax["low_load"].set_ylabel("fraction of requests")
        ax["low_load"].set_title("Low load: added latency of the service path")
        ax["low_load"].axvline(TARGET_P50_MS, ls="--", c="grey", lw=0.8)
        ax["low_load"].legend(fontsize=8)
        ov = result["overload"]
        bars = {"accepted/s": ov["admission_rate_per_s"], "429 share %": 100 * ov["share_429"],
                "gateway CPU ms/req": ov["gateway_cpu_ms_per_request"]}  # fmt: skip
        ax["overload"].bar(list(bars), list(bars.values()), color=["tab:green", "tab:red", "tab:blue"])
        ax["overload"].set_title(
            f"Overload: {result['config']['concurrency']} clients, bound {result['config']['max_pending']}"
        )
    if "under_load" in ax:
        _plot_load(ax["under_load"], result["under_load"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_load(ax: Any, load: dict[str, Any]) -> None:
    """TTFT p50 and p99 of each trace, the engine alone beside the stack."""
    labels, engine, stack = [], [], []
    for name in service_load.TRACES:
        for q in ("p50_ms", "p99_ms"):
            labels.append(f"{name}\n{q[:3]}")
            engine.append(load["engine"][name]["ttft"][q])
            stack.append(load["stack"][name]["ttft"][q])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], engine, width=0.4, label="engine alone")
    ax.bar([i + 0.2 for i in x], stack, width=0.4, label="stack")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("TTFT, ms")
    ax.set_title(
        f"Under load ({100 * load['config']['load']:.0f}% of {load['capacity_req_s']:.1f} req/s); "
        f"saturation ratio {load['throughput_ratio']:.2f}",
        fontsize=9,
    )
    ax.legend(fontsize=8)


def _verdict(value: float, bound: float) -> str:
    return "PASS" if value <= bound else "FAIL"


def _idle(args: argparse.Namespace) -> dict[str, Any]:
    """The low-load and overload measurements."""
    print(f"in-process engine: {args.requests} requests ...", flush=True)
    engine_totals, engine_firsts = asyncio.run(_engine_latencies(args.model, args.requests, args.max_tokens))

    env = {
        "INFLIGHT_SERVED_MODEL_NAME": "bench",
        "INFLIGHT_MAX_PENDING": str(args.max_pending),
        # The overload's clients share one key: the admission bound, not the key's, is what is measured.
        "INFLIGHT_MAX_CONCURRENT_PER_KEY": "100000",
        "INFLIGHT_LOG_LEVEL": "WARNING",
    }
    if args.torch_threads:
        env["INFLIGHT_TORCH_THREADS"] = str(args.torch_threads)
    stack = build_stack(args.model, Path(tempfile.mkdtemp(prefix="inflight-bench-")), tag="bench", env=env)
    try:
        gateway = stack.gateways[0]
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="bench", max_retries=0, timeout=60)
        print(f"service path: {args.requests} requests ...", flush=True)
        records = redis_lib.Redis.from_url(stack.redis.url, decode_responses=True)
        service_totals, service_firsts, stages = _service_latencies(
            client, "bench", args.requests, args.max_tokens, records
        )
        print(f"overload: {args.concurrency} clients for {args.overload_s:.0f}s ...", flush=True)
        overload = asyncio.run(
            _overload(gateway.url, "bench", args.overload_s, args.concurrency, gateway.proc.pid)
        )
    finally:
        stack.close()

    added_total = [s - e for s, e in zip(service_totals, engine_totals, strict=False)]
    added_first = [s - e for s, e in zip(service_firsts, engine_firsts, strict=False)]
    return {
        "low_load": {
            "engine_total": _summary(engine_totals),
            "service_total": _summary(service_totals),
            "added_total": _summary(added_total),
            "engine_first_token": _summary(engine_firsts),
            "service_first_token": _summary(service_firsts),
            "added_first_token": _summary(added_first),
            "targets_ms": {"p50": TARGET_P50_MS, "p99": TARGET_P99_MS},
            "stages_of_the_whole_response": {name: _summary(values) for name, values in stages.items()},
        },
        "overload": overload,
        "raw_ms": {
            "added (whole response)": [1000 * v for v in added_total],
            "added (first token)": [1000 * v for v in added_first],
        },
    }


def _idle_report(result: dict[str, Any]) -> str:
    low, overload = result["low_load"], result["overload"]
    added = low["added_total"]
    first = low["added_first_token"]
    return (
        f"added latency, whole response: p50 {added['p50_ms']:.2f} ms "
        f"({_verdict(added['p50_ms'], TARGET_P50_MS)}, target {TARGET_P50_MS:.0f}), "
        f"p99 {added['p99_ms']:.2f} ms "
        f"({_verdict(added['p99_ms'], TARGET_P99_MS)}, target {TARGET_P99_MS:.0f})\n"
        f"added latency, first token:    p50 {first['p50_ms']:.2f} ms, p99 {first['p99_ms']:.2f} ms\n"
        f"overload: {overload['admission_rate_per_s']:.1f} admitted/s, "
        f"{100 * overload['share_429']:.1f}% answered 429, "
        f"gateway CPU {overload['gateway_cpu_ms_per_request']:.2f} ms/request\n"
        + "".join(
            f"  {name}: p50 {v['p50_ms']:.2f} ms\n" for name, v in low["stages_of_the_whole_response"].items()
        )
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.load_only:
        args.model = service_load_args.resolve_model(args.model)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    load_cfg = None if args.no_load else service_load_args.config_from_args(args)
    result: dict[str, Any] = {"config": {**vars(args), "cpus": os.cpu_count()}}
    if not args.load_only:
        result.update(_idle(args))
    if load_cfg is not None:
        print(f"under load ({Path(load_cfg.model).name}):", flush=True)
        result["under_load"] = service_load.measure(load_cfg)
    (out / "service.json").write_text(json.dumps(result, indent=2))
    _plot(result, out / "service.png")
    text = _idle_report(result) if "low_load" in result else ""
    if "under_load" in result:
        text += service_load.report(result["under_load"]) + "\n"
    print(text + f"wrote {out / 'service.json'} and {out / 'service.png'}")
    return 0
