"""``python -m bench chaos`` (``make chaos``): a fault-injection soak of the whole service path.

Two gateways, three workers, the broker (tansu) and Redis on loopback. Seeded requests of every kind
(streams, plain and chat completions, jobs, cancels, poison bodies) and a crowd of slow stream readers
run while a seeded schedule injects each fault once (bench/chaos_faults.py): a worker SIGKILLed and
restarted, the broker restarted, Redis restarted (from a snapshot taken just before, as a Redis with
persistence would), an engine core SIGSTOPped (the stall watchdog must catch it), Redis over
``maxmemory`` and Redis answering READONLY for a few seconds each, and a gateway SIGKILLed. Then the end
state is checked:

- every accepted request completed exactly once with the text of an undisturbed run, or failed with an
  error its client saw (an HTTP error, an SSE error event, a broken connection, a failed job);
- nothing is lost (no client left without an answer) and nothing ran twice (each request's Redis log
  has unique, consecutive sequence numbers and one terminal event);
- every poison body got a 4xx; every slow reader completed or was cut off with the ``slow_reader``
  error, and the gateways' memory stayed bounded;
- every worker is alive and ready (apart from those the faults killed), its KV blocks free; the
  pending set is empty.

It prints a table (each fault with its recovery time, then the counts) and returns non-zero when a check
fails. Engine steps are paced (INFLIGHT_FAULT_STEP_DELAY_S) so that the stalled core's witness stream is
still running when the core is stopped, whatever the host's speed.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.chaos_faults import FAULTS, FaultRunner, make_schedule
from bench.chaos_hostile import Crowd, snapshot
from bench.chaos_report import Fault, Report, SlowSummary, check, print_table
from bench.chaos_slow import (
    RssSampler,
    SlowResult,
    SlowSpec,
    make_slow_specs,
    read_slowly,
    rss_mib,
    slow_bodies,
)
from bench.chaos_traffic import Result, Spec, make_specs, reference_body, run_one, text_of_response
from harness.stack import Stack, build_stack

MODEL_NAME = "tiny"
PASSWORD = "chaos"
STEP_DELAY_S = 0.01  # paces every engine step: the witness of 160 tokens runs for 1.6 s at least
WITNESS = {
    "model": MODEL_NAME,
    "prompt": "stall witness",
    "max_tokens": 160,
    "temperature": 0.0,
    "ignore_eos": True,
}


def start_stack(log_dir: Path, model: str, step_delay_s: float = STEP_DELAY_S) -> Stack:
    env = {
        "INFLIGHT_SERVED_MODEL_NAME": MODEL_NAME,
        "INFLIGHT_KAFKA_PARTITIONS": "6",
        "INFLIGHT_KAFKA_PRODUCE_TIMEOUT_S": "3",
        "INFLIGHT_LEASE_TTL_S": "3",
        "INFLIGHT_KAFKA_SESSION_TIMEOUT_MS": "6000",
        "INFLIGHT_PENDING_TTL_S": "6",
        "INFLIGHT_DRAIN_TIMEOUT_S": "5",
        "INFLIGHT_TORCH_THREADS": "1",
        # float32: bf16 results depend on the batch a request shares (and on prefix-cache hits), which
        # would flip tokens between the undisturbed run and the soak for reasons that are not faults.
        "INFLIGHT_ENGINE_ARGS": json.dumps({"dtype": "float32"}),
        "INFLIGHT_LOG_LEVEL": "INFO",
        "INFLIGHT_FAULT_STEP_DELAY_S": str(step_delay_s),
        # A stall is caught within seconds, well above a paced step on a loaded host. The first steps
        # get more (the warm-up bound: a restarted worker's core may be the one stopped), but not the
        # default five minutes: the tiny model on CPU compiles nothing that long.
        "INFLIGHT_ENGINE_STALL_TIMEOUT_S": "5",
        "INFLIGHT_ENGINE_STALL_WARMUP_S": "10",
        # Small (the default is 1 MiB), so that what a slow reader makes the gateway hold is its smallest.
        "INFLIGHT_STREAM_BUFFER_BYTES": str(16 * 1024),
    }
    return build_stack(model, log_dir, workers=3, gateways=2, redis_password=PASSWORD, tag="chaos", env=env)


# ---- the soak -------------------------------------------------------------------------------------
def references(
    stack: Stack, specs: list[Spec], bodies: list[dict[str, Any]]
) -> tuple[dict[int, str], list[str]]:
    """The undisturbed run, through the stack before any fault: every request's text, and the text of
    each of ``bodies`` (completions)."""

    def one(path_body: tuple[str, dict[str, Any]]) -> str:
        path, body = path_body
        resp = httpx.post(f"{stack.gateways[1].url}{path}", json=body, timeout=300)
        resp.raise_for_status()
        return text_of_response(resp.json())

    wanted = [s for s in specs if s.kind != "hostile"]
    jobs = [reference_body(s) for s in wanted] + [("/v1/completions", b) for b in bodies]
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(one, jobs))
    return {s.index: t for s, t in zip(wanted, texts, strict=False)}, texts[len(wanted) :]


def summarize_slow(results: list[SlowResult], expected: dict[str, str], slow: SlowSummary) -> None:
    slow.sent = len(results)
    for r in results:
        if r.outcome == "completed":
            if r.text == expected[r.spec.body["prompt"]]:
                slow.completed += 1
            else:
                slow.wrong_text += 1
        elif r.outcome == "cut_off":
            slow.cut_off += 1
        elif r.outcome == "failed":
            slow.failed += 1
        else:
            slow.lost += 1


def soak(
    seed: int,
    num_requests: int,
    duration_s: float,
    log_dir: Path,
    model: str,
    faults: list[str] | None = None,
    slow_readers: int = 0,
    step_delay_s: float = STEP_DELAY_S,
    hostile_clients: int = 0,
) -> Report:
    """Run the soak on a stack of its own; ``faults``: which to inject (default: all of FAULTS);
    ``hostile_clients``: the hostile crowd's size (bench/chaos_hostile.py), on a keyed gateway of its own."""
    stack = start_stack(log_dir, model, step_delay_s)
    runner: FaultRunner | None = None
    crowd: Crowd | None = None
    try:
        if hostile_clients:
            crowd = Crowd(stack, MODEL_NAME, seed, hostile_clients, duration_s)
        specs = make_specs(seed, num_requests, duration_s, MODEL_NAME)
        slow_specs = make_slow_specs(seed, slow_readers, duration_s, MODEL_NAME)
        bodies = [b for b in slow_bodies(MODEL_NAME) if any(s.body is b or s.body == b for s in slow_specs)]
        expected, texts = references(stack, specs, [*bodies, WITNESS])
        slow_expected = {b["prompt"]: t for b, t in zip(bodies, texts, strict=False)}
        schedule = make_schedule(seed, duration_s, faults)
        rng = random.Random(seed + 1)
        gateway_pids = [g.proc.pid for g in stack.gateways]
        rss_before = {pid: rss_mib(pid) for pid in gateway_pids}
        sampler = RssSampler(gateway_pids)
        sampler.start()
        start = time.monotonic()
        runner = FaultRunner(stack, MODEL_NAME, random.Random(seed + 2), start, (WITNESS, texts[-1]))
        if crowd is not None:
            crowd_gateway = crowd.gateway
            runner.snapshot = lambda: snapshot(stack, crowd_gateway)
        done_faults: list[Fault] = []
        over = threading.Event()

        def fault_loop() -> None:
            assert runner is not None
            done_faults.extend(runner.run(schedule))
            # Processes this thread started get SIGTERM when it exits (PR_SET_PDEATHSIG is per thread):
            # it lives until the soak is checked.
            over.wait()

        fault_thread = threading.Thread(target=fault_loop)
        fault_thread.start()
        if crowd is not None:
            crowd.start()

        def client(spec: Spec) -> Result:
            time.sleep(max(0.0, start + spec.at_s - time.monotonic()))
            gateways = stack.live_gateways() or [g.url for g in stack.gateways]
            return run_one(spec, gateways, random.Random(rng.random() + spec.index), deadline_s=90)

        def slow_client(spec: SlowSpec) -> SlowResult:
            time.sleep(max(0.0, start + spec.at_s - time.monotonic()))
            gateways = stack.live_gateways() or [g.url for g in stack.gateways]
            return read_slowly(spec, random.Random(seed + spec.index).choice(gateways), deadline_s=120)

        try:
            with ThreadPoolExecutor(16) as pool, ThreadPoolExecutor(max(1, slow_readers)) as slow_pool:
                slow_futures = [slow_pool.submit(slow_client, s) for s in slow_specs]
                results = list(pool.map(client, specs))
                slow_results = [f.result() for f in slow_futures]
            while len(done_faults) < len(schedule) and fault_thread.is_alive():
                time.sleep(0.2)
            sampler.stop()
            slow = SlowSummary()
            summarize_slow(slow_results, slow_expected, slow)
            slow.rss_mib = [
                {"before": rss_before[pid], "peak": sampler.peak.get(pid), "after": rss_mib(pid)}
                for pid in gateway_pids
            ]
            report = check(stack, results, expected, done_faults, slow)
            if crowd is not None:
                report.crowd = crowd.finish(stack)
            report.wall_s = round(time.monotonic() - start, 1)
            return report
        finally:
            over.set()
            fault_thread.join()
    finally:
        if runner is not None:
            runner.close()
        if crowd is not None:
            crowd.close()
        stack.close()  # the gateways, the workers, then the broker and Redis it started


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--requests", type=int, default=240, help="requests sent over the fault phase")
    p.add_argument("--duration", type=float, default=60.0, help="seconds over which faults and requests run")
    p.add_argument(
        "--faults", default=",".join(FAULTS), help="comma-separated faults to inject (default: all)"
    )
    p.add_argument("--slow-readers", type=int, default=100, help="slow stream readers running alongside")
    p.add_argument(
        "--hostile", type=int, default=400, help="hostile clients (random paths, vanishing streams, ...)"
    )
    p.add_argument("--model", default="", help="checkpoint (default: the tiny model)")
    p.add_argument("--out", default="", help="write the report as JSON here")


def run(args: argparse.Namespace) -> int:
    model = args.model
    if not model:
        from engine.models.tiny import default_model_path

        model = str(default_model_path())
    log_dir = Path(tempfile.mkdtemp(prefix="inflight-chaos-"))
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise SystemExit(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    report = soak(
        args.seed,
        args.requests,
        args.duration,
        log_dir,
        model,
        faults,
        args.slow_readers,
        hostile_clients=args.hostile,
    )
    print_table(report)
    print(f"logs: {log_dir}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report.as_dict(), indent=2))
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench chaos", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))
