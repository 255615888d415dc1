"""``python -m bench batch-interference``: what a running batch costs interactive traffic.

On a loopback stack (tansu, Redis, one gateway, one worker), the same interactive load runs twice in
each of ``--rounds`` rounds: alone, then while a batch of ``--lines`` requests (the OpenAI Batch API,
1,000 by default) runs, which finishes before the next round. Each
interactive request is a streamed completion sent one at a time, ``--interval-s`` apart; its TTFT is
taken at the client (request sent to first text chunk). Reported, as JSON under ``--out``:

    interactive TTFT p50 / p99 without and with the batch, and their ratio (target: p99 within 1.2x),
    over every round's requests together, and each round's own ratio with the median of them
    each round's batch: its completion time (create to "completed") and its request_counts
    where each interactive request's time to its first token went in each phase (the stages of
    ``python -m bench service``: gateway, queue and claim, worker to first token, delivery; the
    worker's stage split at the engine core's arrival and first token), and the five slowest requests'
    own stages
    the cores each process group kept busy in each phase (gateway, worker, engine core, broker, Redis,
    this client, the rest of the host): where the interactive request's way in competes with the batch
    whether the batch was still running when the last interactive request finished (else the "with"
    figures cover only part of the window and say less)

Figures from a shared or busy host are noise: run it on a quiet machine for numbers to quote.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from bench.process_cpu import CpuMeter, stack_processes
from bench.results import write_json
from bench.service_load_args import resolve_model
from bench.service_replay import Streamed
from bench.service_stages import records, slowest, stages
from harness.stack import build_stack
from services.common import keys

PROMPT = "The quick brown fox jumps over the lazy dog. A continuous batching server"
MODEL = "bench"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench batch-interference", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", default="bench-results", help="directory for batch_interference.json")
    p.add_argument("--model", default="tiny", help="tiny, bench, smollm2 or a checkpoint path (default tiny)")
    p.add_argument("--lines", type=int, default=1000, help="requests in the batch (default 1000)")
    p.add_argument("--batch-max-tokens", type=int, default=32, help="tokens per batch line (default 32)")
    p.add_argument("--interactive", type=int, default=50, help="interactive requests per phase (default 50)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per interactive request (default 8)")
    p.add_argument("--interval-s", type=float, default=0.2, help="gap between interactive requests")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alone-then-beside rounds, each with a batch of its own (default 1); the figures pool every "
        "round's requests, and each round's p99 ratio is kept with their median",
    )
    p.add_argument("--torch-threads", type=int, default=None, help="the worker's torch threads")
    p.add_argument(
        "--batch-max-queued",
        type=int,
        default=None,
        help="INFLIGHT_BATCH_MAX_QUEUED for the stack (default: the setting's default)",
    )
    return p


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _ttfts(client: openai.OpenAI, num: int, max_tokens: int, interval_s: float) -> list[Streamed]:
    """``num`` streamed completions sent one after another, as their client saw them (TTFT:
    ``first``, seconds from the send to the first text)."""
    out = []
    for i in range(num):
        sent = time.perf_counter()
        seen = Streamed(sent_wall=time.time())
        stream = client.completions.create(
            model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=max_tokens, temperature=0, stream=True
        )
        for chunk in stream:
            seen.request_id = seen.request_id or chunk.id
            if seen.first is None and chunk.choices and chunk.choices[0].text:
                seen.first, seen.first_wall = time.perf_counter() - sent, time.time()
        if seen.first is None:
            seen.first = time.perf_counter() - sent
        out.append(seen)
        time.sleep(interval_s)
    return out


def _summary(streamed: list[Streamed]) -> dict[str, float]:
    ttfts = [s.first for s in streamed if s.first is not None]
    return {
        "n": len(ttfts),
        "p50_ms": round(1e3 * statistics.median(ttfts), 2),
        "p99_ms": round(1e3 * _percentile(ttfts, 0.99), 2),
    }


def _batch_file(lines: int, max_tokens: int) -> bytes:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    rows = [
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {**body, "prompt": f"Story {i}:"},
            }
        )
        for i in range(lines)
    ]
    return ("\n".join(rows) + "\n").encode()


def _phase_cores(samples: list[dict[str, float]]) -> dict[str, float]:
    """Each process group's cores, averaged over the rounds' phases."""
    return {k: round(statistics.fmean(c[k] for c in samples), 3) for k in samples[0]}


def _batch_round(client: openai.OpenAI, args: argparse.Namespace) -> tuple[Any, float]:
    """Create a batch, wait until it has begun, and return it with its start time."""
    upload = client.files.create(
        file=("batch.jsonl", io.BytesIO(_batch_file(args.lines, args.batch_max_tokens))), purpose="batch"
    )
    started = time.perf_counter()
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    time.sleep(2.0)  # the batch's first rounds: its lines are queued and running
    return batch, started


def _finished(client: openai.OpenAI, batch_id: str) -> Any:
    while True:
        state = client.batches.retrieve(batch_id)
        if state.status in ("completed", "failed", "cancelled", "expired"):
            return state
        time.sleep(1.0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = {"INFLIGHT_SERVED_MODEL_NAME": MODEL, "INFLIGHT_LOG_LEVEL": "WARNING"}
    if args.torch_threads:
        env["INFLIGHT_TORCH_THREADS"] = str(args.torch_threads)
    if args.batch_max_queued:
        env["INFLIGHT_BATCH_MAX_QUEUED"] = str(args.batch_max_queued)
    stack = build_stack(
        resolve_model(args.model),
        Path(tempfile.mkdtemp(prefix="inflight-bench-")),
        tag="bench-batch",
        env=env,
    )
    alone: list[Streamed] = []
    beside: list[Streamed] = []
    rounds: list[dict[str, Any]] = []
    cores: dict[str, list[dict[str, float]]] = {"without_batch": [], "with_batch": []}
    try:
        client = openai.OpenAI(
            base_url=f"{stack.gateways[0].url}/v1", api_key="bench", max_retries=0, timeout=120
        )
        _ttfts(client, 3, args.max_tokens, 0.0)  # warm-up: first requests compile and fill caches
        groups = stack_processes(stack)
        for n in range(args.rounds):
            # Alone, then beside a batch, in every round: drift of the host over the run shows in both.
            tag = f"round {n + 1}/{args.rounds}:"
            print(f"{tag} interactive alone, {args.interactive} requests ...", flush=True)
            meter = CpuMeter(groups)
            round_alone = _ttfts(client, args.interactive, args.max_tokens, args.interval_s)
            cores["without_batch"].append(meter.cores())
            batch, started = _batch_round(client, args)
            print(f"{tag} interactive beside a {args.lines}-line batch ...", flush=True)
            meter = CpuMeter(groups)
            round_beside = _ttfts(client, args.interactive, args.max_tokens, args.interval_s)
            cores["with_batch"].append(meter.cores())
            running_throughout = client.batches.retrieve(batch.id).status == "in_progress"
            print(f"{tag} waiting for the batch to complete ...", flush=True)
            state = _finished(client, batch.id)
            counts = state.request_counts
            without, with_batch = _summary(round_alone), _summary(round_beside)
            rounds.append(
                {
                    "interactive_without_batch": without,
                    "interactive_with_batch": with_batch,
                    "p99_ratio": round(with_batch["p99_ms"] / without["p99_ms"], 3),
                    "batch": {
                        "status": state.status,
                        "completion_s": round(time.perf_counter() - started, 2),
                        "request_counts": None if counts is None else counts.model_dump(),
                        "running_throughout": running_throughout,
                    },
                }
            )
            alone += round_alone
            beside += round_beside
        redis = stack.redis_client()
        by_phase = {"without_batch": alone, "with_batch": beside}
        recs = {phase: records(redis, keys, group) for phase, group in by_phase.items()}
        stage_ms = {phase: stages(group, recs[phase]) for phase, group in by_phase.items()}
        slow = {phase: slowest(group, recs[phase]) for phase, group in by_phase.items()}
    finally:
        stack.close()
    without, with_batch = _summary(alone), _summary(beside)
    return {
        "model": args.model,
        "lines": args.lines,
        "rounds": args.rounds,
        "batch_max_tokens": args.batch_max_tokens,
        "batch_max_queued": args.batch_max_queued,
        "interactive_max_tokens": args.max_tokens,
        # Every round's requests together: the p99 of rounds x --interactive samples per phase.
        "interactive_without_batch": without,
        "interactive_with_batch": with_batch,
        "p99_ratio": round(with_batch["p99_ms"] / without["p99_ms"], 3) if without["p99_ms"] else None,
        "p99_ratio_median_of_rounds": round(statistics.median(r["p99_ratio"] for r in rounds), 3),
        "per_round": rounds,
        "stages": stage_ms,
        "slowest_requests": slow,
        "cpu_cores": {phase: _phase_cores(samples) for phase, samples in cores.items()},
    }


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "batch_interference.json", result)
    print(json.dumps(result, indent=1))
    return 0
