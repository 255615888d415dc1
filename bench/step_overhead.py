"""Does the worker's Kafka and Redis I/O slow the engine down?

The engine steps on its own thread, but in the worker it shares one Python interpreter (one GIL) with the
event loop that fetches from Kafka, publishes tokens to Redis and answers probes. This measures the
engine's own step time (``StepRecord.duration``: schedule + inputs + model + sampling) three ways, with the
same stack up (broker, Redis, gateway) and the same model, threads and workload:

    in the worker   the ``Worker`` runs in this process, fed through the gateway by HTTP clients, its
                    engine loop on a thread here (INFLIGHT_ENGINE_PROCESS=false);
    alone           the same engine, stepped directly, ``--concurrency`` requests kept in flight;
    core process    the ``Worker`` again, with the engine core in a process of its own (the default):
                    the same model, stepped by ``engine.core``, its records sent back with its outputs.

Only full decode steps (``--concurrency`` sequences, one token each) are compared, so both sides time
the same work. With ``--pin`` (the default on a host of 2+ cores) this process (engine thread and, in the
worker run, its event loop) runs on core 0 and the gateway, broker and Redis on the other cores, so
their work on the worker run's requests does not land on the engine's core: the difference of the
medians is then the cost of the interpreter the engine shares with the worker's I/O. For the core
process side the core stays on core 0 and this process (the worker's loop) moves to the others, as
it would run on a pod with two or more cores. Other load on the host still adds noise.

    python -m bench.step_overhead --out bench-results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from engine.metrics import StepRecord
from harness.stack import build_stack

THRESHOLD = 0.05  # the bar: run the engine core in its own process above a 5% cost


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.step_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-results", help="directory for step_overhead.json")
    p.add_argument("--model", help="model directory (default: the tiny random-weight model)")
    p.add_argument("--requests", type=int, default=48, help="requests per side (default 48)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default 48)")
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=(os.cpu_count() or 1) >= 2,
        help="this process on core 0, the stack's servers on the others (default: on with 2+ cores)",
    )
    return p


def _full_decode_steps(steps: list[StepRecord], concurrency: int) -> list[float]:
    return [
        s.duration
        for s in steps
        if s.stats.num_scheduled_seqs == concurrency and all(n == 1 for _, n, _ in s.batch)
    ]


def _prompt(i: int) -> list[int]:
    return [3 + (i * 7 + j) % 90 for j in range(12)]


async def _through_worker(
    args: argparse.Namespace, env: dict[str, str], engine: Any, gateway_url: str, recorded: list[StepRecord]
) -> None:
    """Serve ``--requests`` through the gateway with a Worker in this process.

    ``engine``: an ``LLMEngine`` (its loop on a thread here, as INFLIGHT_ENGINE_PROCESS=false runs),
    or a model path: an engine core is spawned for it (the worker's default), pinned to core 0 while
    this process's threads move to the other cores.
    """
    from engine.core.client import EngineCoreClient
    from engine.core.inproc_client import InprocClient
    from services.common.settings import Settings
    from services.worker.worker import Worker
    from services.worker.worker_telemetry import instrument_engine

    settings = Settings.from_env(env)
    eng: InprocClient | EngineCoreClient
    if isinstance(engine, str):
        eng = EngineCoreClient(
            engine, {"max_num_seqs": max(args.concurrency, 8)}, torch_threads=args.torch_threads
        )
        await eng.start()
        if args.pin and eng.pid is not None:
            os.sched_setaffinity(eng.pid, {0})
            os.sched_setaffinity(0, set(range(1, os.cpu_count() or 1)))
        await _warm_up(args, eng)
    else:
        eng = InprocClient(engine)
    spans = instrument_engine(eng, settings)  # as the worker's main does
    eng.metrics.step_listeners.append(recorded.append)
    worker = Worker(settings, eng, spans)
    await worker.start()
    todo = list(range(args.requests))
    try:
        async with httpx.AsyncClient(base_url=gateway_url, timeout=120) as client:

            async def client_loop() -> None:
                while todo:
                    i = todo.pop()
                    body = {"model": "model", "prompt": _prompt(i), "max_tokens": args.max_tokens,
                            "temperature": 0, "ignore_eos": True}  # fmt: skip
                    resp = await client.post("/v1/completions", json=body)
                    resp.raise_for_status()

            await asyncio.gather(*(client_loop() for _ in range(args.concurrency)))
    finally:
        await worker.drain()


async def _warm_up(args: argparse.Namespace, client: Any) -> None:
    from engine.inputs import EngineRequest
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    async def one(i: int) -> None:
        async for _ in client.generate(EngineRequest(f"warm-{uuid.uuid4().hex}", _prompt(i), params)):
            pass

    await asyncio.gather(*(one(i) for i in range(args.concurrency)))


def _alone(args: argparse.Namespace, engine: Any, num_requests: int) -> None:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    todo, in_flight = list(range(num_requests)), 0
    while todo or engine.has_unfinished_requests():
        while todo and in_flight < args.concurrency:
            engine.add_request(f"alone-{uuid.uuid4().hex}", _prompt(todo.pop()), params)
            in_flight += 1
        in_flight -= sum(1 for out in engine.step() if out.finished)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from engine.llm_engine import LLMEngine
    from engine.models.tiny import default_model_path

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    others = set(range(1, os.cpu_count() or 1))
    if args.pin:
        os.sched_setaffinity(0, {0})  # threads started from now on (the engine's) inherit it
    model = args.model or str(default_model_path())
    engine = LLMEngine.from_engine_args(model, max_num_seqs=max(args.concurrency, 8))
    work = Path(tempfile.mkdtemp(prefix="inflight-step-overhead-"))
    settings = {
        "INFLIGHT_FETCH_MAX_WAITING": str(args.concurrency * 2),
        "INFLIGHT_SERVED_MODEL_NAME": "model",
        "INFLIGHT_WORKER_PORT": "0",
    }
    # No worker process: this process is the worker, with the engine above.
    stack = build_stack(model, work, workers=0, tag="overhead", env=settings)
    env, gateway = stack.env, stack.gateways[0]
    if args.pin:
        for proc in (stack.kafka.proc, stack.redis.proc, gateway.proc):
            if proc is not None:
                os.sched_setaffinity(proc.pid, others)
    try:
        _alone(args, engine, args.concurrency)  # warm-up
        recorded: list[StepRecord] = []
        began = time.monotonic()
        asyncio.run(_through_worker(args, env, engine, gateway.url, recorded))
        worker_s = time.monotonic() - began
        in_worker = _full_decode_steps(recorded, args.concurrency)
        recorded.clear()
        engine.metrics.step_listeners.append(recorded.append)
        began = time.monotonic()
        _alone(args, engine, args.requests)
        alone_s = time.monotonic() - began
        alone = _full_decode_steps(recorded, args.concurrency)
        recorded = []
        began = time.monotonic()
        # Last: it moves this process's threads off core 0 for the rest of the run.
        asyncio.run(
            _through_worker(
                args,
                {**env, "INFLIGHT_KAFKA_CONSUMER_GROUP": env["INFLIGHT_KAFKA_CONSUMER_GROUP"] + "-core"},
                model,
                gateway.url,
                recorded,
            )
        )
        core_s = time.monotonic() - began
        in_core = _full_decode_steps(recorded, args.concurrency)
    finally:
        stack.close()
    if not in_worker or not alone or not in_core:
        raise SystemExit("no full decode steps recorded: raise --requests or --max-tokens")
    med_w, med_a, med_c = statistics.median(in_worker), statistics.median(alone), statistics.median(in_core)
    result = {
        "model": model,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "torch_threads": args.torch_threads,
        "pinned": args.pin,
        "cpu_count": os.cpu_count(),
        "steps": {"in_worker": len(in_worker), "alone": len(alone), "core_process": len(in_core)},
        "median_ms": {"in_worker": med_w * 1e3, "alone": med_a * 1e3, "core_process": med_c * 1e3},
        "p90_ms": {
            "in_worker": statistics.quantiles(in_worker, n=10)[-1] * 1e3,
            "alone": statistics.quantiles(alone, n=10)[-1] * 1e3,
            "core_process": statistics.quantiles(in_core, n=10)[-1] * 1e3,
        },
        "wall_s": {"in_worker": worker_s, "alone": alone_s, "core_process": core_s},
        "overhead": med_w / med_a - 1,
        "overhead_core_process": med_c / med_a - 1,
        "threshold": THRESHOLD,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_overhead.json").write_text(json.dumps(result, indent=2))
    verdict = "above" if result["overhead"] > THRESHOLD else "below"
    print(
        f"full decode step ({args.concurrency} seqs): median {med_w * 1e3:.2f} ms in the worker vs "
        f"{med_a * 1e3:.2f} ms alone: {result['overhead']:+.1%} ({verdict} the {THRESHOLD:.0%} bar)"
    )
    print(
        f"with the engine core in its own process: median {med_c * 1e3:.2f} ms: "
        f"{result['overhead_core_process']:+.1%} against alone"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
