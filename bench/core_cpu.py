"""The engine core process's CPU per generated token, driven through the process client.

The worker's own path to the engine: ``make_client`` spawns the core (``engine/core/proc.py``), and
``--requests`` requests run through it, ``--concurrency`` in flight, ``--max-tokens`` each (ignore_eos,
greedy: every request makes exactly that many tokens). The core process's user + system CPU seconds are
read from /proc around the run, after start-up and one warm-up request, so model loading and first-step
costs are not counted. Prints core CPU-milliseconds per generated token (what the core spends besides
the model's own work: scheduling, the pipe, and whatever output processing runs there) and tok/s.

    python -m bench core-cpu [--requests 32 --concurrency 8 --max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from bench.process_cpu import cpu_s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: the tiny random-weight model)")
    p.add_argument("--requests", type=int, default=32, help="requests (default 32)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--torch-threads", type=int, default=1, help="the core's torch threads (default 1)")
    p.add_argument("--stop", action="append", default=[], help="a stop string for every request (repeatable)")
    p.add_argument("--json", dest="json_out", help="also write the figures to this JSON file")


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from engine.core.client import make_client
    from engine.inputs import EngineRequest
    from engine.sampling_params import SamplingParams

    if args.model:
        model = args.model
    else:
        from engine.models.tiny import default_model_path

        model = str(default_model_path())
    engine_args = {"max_num_seqs": max(args.concurrency, 8)}
    client = make_client(model, engine_args, torch_threads=args.torch_threads, log_level="WARNING")
    await client.start()
    pid = client.pid
    assert pid is not None
    params = SamplingParams(
        max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0, stop=list(args.stop)
    )
    room = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> int:
        request = EngineRequest(f"r{i}", f"Request {i}: tell me a story about the number {i}.", params)
        tokens = 0
        async with room:
            async for out in client.generate(request):
                tokens += sum(len(c.token_ids) for c in out.outputs)
        return tokens

    rows: list[int] = []  # sequences per step: fewer means more steps, each with its fixed cost
    try:
        await one(-1)  # warm-up
        client.metrics.step_listeners.append(lambda step: rows.append(len(step.batch)))
        cpu0, began = cpu_s(pid), time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(args.requests))))
        wall, cpu = time.perf_counter() - began, cpu_s(pid) - cpu0
    finally:
        await client.shutdown()
    return {
        "model": model,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "tokens": tokens,
        "core_cpu_s": round(cpu, 3),
        "core_cpu_ms_per_token": round(1e3 * cpu / max(tokens, 1), 4),
        "tok_per_s": round(tokens / wall, 1),
        "wall_s": round(wall, 3),
        "steps": len(rows),
        "mean_batch": round(sum(rows) / max(len(rows), 1), 2),
    }


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(measure(args))
    shape = f"requests {result['requests']}, concurrency {result['concurrency']}"
    print(f"{shape}, max_tokens {result['max_tokens']}: {result['tokens']} tokens")
    print(
        f"core process: {result['core_cpu_s']:.2f} CPU-s, "
        f"{result['core_cpu_ms_per_token']:.3f} CPU-ms per generated token"
    )
    print(f"throughput: {result['tok_per_s']:.1f} tok/s over {result['wall_s']:.2f} s wall")
    print(f"steps: {result['steps']}, {result['mean_batch']:.2f} sequences a step on average")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0
