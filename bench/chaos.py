"""``python -m bench chaos`` (``make chaos``): a fault-injection soak of the whole service path.

Two gateways, three workers, the broker (tansu) and Redis on loopback. Seeded requests of every kind
(streams, plain and chat completions, jobs, cancels, hostile bodies) run while a seeded schedule
SIGKILLs and restarts a worker, restarts the broker, restarts Redis (from a snapshot taken just before,
as a Redis with persistence would) and SIGKILLs a gateway. Then the end state is checked:

- every accepted request completed exactly once with the text of an undisturbed run, or failed with an
  error its client saw (an HTTP error, an SSE error event, a broken connection, a failed job);
- nothing is lost (no client left without an answer) and nothing ran twice (each request's Redis log
  has unique, consecutive sequence numbers and one terminal event);
- hostile bodies got a 4xx; every worker's KV blocks are free; the pending set is empty.

It prints a table (faults, accepted / completed / failed / lost / duplicated, recovery time per fault)
and returns non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis as redis_lib

from bench.chaos_report import Fault, Report, check, print_table
from bench.chaos_traffic import Result, Spec, make_specs, reference_body, run_one, text_of_response
from harness.stack import Stack, build_stack, launch

MODEL_NAME = "tiny"
PASSWORD = "chaos"


def start_stack(log_dir: Path, model: str) -> Stack:
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
    }
    return build_stack(model, log_dir, workers=3, gateways=2, redis_password=PASSWORD, tag="chaos", env=env)


# ---- faults ---------------------------------------------------------------------------------------
def _inject(stack: Stack, name: str, rng: random.Random) -> None:
    if name == "kill worker":
        victim = rng.randrange(len(stack.workers))
        stack.workers[victim].kill()
        stack.workers[victim] = launch("worker", stack.env, stack.log_dir)  # the Deployment restarts it
    elif name == "restart broker":
        stack.kafka.restart(down_s=0.5)
    elif name == "restart redis":
        # A Redis with persistence comes back with its data. SHUTDOWN SAVE writes it and exits in one
        # step: a SAVE and then a stop lost whatever Redis acknowledged in between (a job finished in
        # that window came back "in_progress" with its Kafka offset committed: stuck for good), which
        # a deployment's Redis, saving on shutdown or logging every write, never does.
        with contextlib.suppress(redis_lib.ConnectionError):  # the connection closes as it exits
            stack.redis_client().shutdown(save=True)
        stack.redis.restart(down_s=0.5)
    elif name == "kill gateway":
        stack.gateways[0].kill()  # not restarted: its clients see the failure, the other serves on
    else:
        raise ValueError(name)


def _recovered(stack: Stack) -> bool:
    """A canary request succeeds end to end (through a live gateway, a worker, the broker and Redis)."""
    body = {"model": MODEL_NAME, "prompt": "canary", "max_tokens": 2}
    for url in stack.live_gateways():
        try:
            if httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
    return False


def run_faults(
    stack: Stack, schedule: list[tuple[float, str]], rng: random.Random, start: float
) -> list[Fault]:
    faults = []
    for at_s, name in schedule:
        time.sleep(max(0.0, start + at_s - time.monotonic()))
        began = time.monotonic()
        _inject(stack, name, rng)
        while not _recovered(stack) and time.monotonic() - began < 90:
            time.sleep(0.25)
        ready = time.monotonic()
        faults.append(Fault(name, round(began - start, 1), round(ready - began, 1)))
    return faults


def make_schedule(seed: int, duration_s: float) -> list[tuple[float, str]]:
    """One of each fault, in a seeded order at seeded times, the gateway last (it is not restarted)."""
    rng = random.Random(seed)
    names = ["kill worker", "restart broker", "restart redis"]
    rng.shuffle(names)
    names.append("kill gateway")
    slot = duration_s / len(names)
    return [(round(i * slot + rng.uniform(0.1, 0.4) * slot, 1), n) for i, n in enumerate(names)]


# ---- the soak -------------------------------------------------------------------------------------
def references(stack: Stack, specs: list[Spec]) -> dict[int, str]:
    """The undisturbed run: every request's text, through the stack before any fault."""

    def one(spec: Spec) -> tuple[int, str]:
        path, body = reference_body(spec)
        resp = httpx.post(f"{stack.gateways[1].url}{path}", json=body, timeout=120)
        resp.raise_for_status()
        return spec.index, text_of_response(resp.json())

    wanted = [s for s in specs if s.kind != "hostile"]
    with ThreadPoolExecutor(4) as pool:
        return dict(pool.map(one, wanted))


def soak(seed: int, num_requests: int, duration_s: float, log_dir: Path, model: str) -> Report:
    stack = start_stack(log_dir, model)
    try:
        specs = make_specs(seed, num_requests, duration_s, MODEL_NAME)
        expected = references(stack, specs)
        schedule = make_schedule(seed, duration_s)
        rng = random.Random(seed + 1)
        start = time.monotonic()
        faults: list[Fault] = []
        over = threading.Event()

        def fault_loop() -> None:
            faults.extend(run_faults(stack, schedule, random.Random(seed + 2), start))
            # Processes this thread started get SIGTERM when it exits (PR_SET_PDEATHSIG is per thread):
            # it lives until the soak is checked.
            over.wait()

        fault_thread = threading.Thread(target=fault_loop)
        fault_thread.start()

        def client(spec: Spec) -> Result:
            time.sleep(max(0.0, start + spec.at_s - time.monotonic()))
            gateways = stack.live_gateways() or [g.url for g in stack.gateways]
            return run_one(spec, gateways, random.Random(rng.random() + spec.index), deadline_s=90)

        try:
            with ThreadPoolExecutor(16) as pool:
                results = list(pool.map(client, specs))
            while len(faults) < len(schedule) and fault_thread.is_alive():
                time.sleep(0.2)
            report = check(stack, results, expected, faults)
            report.wall_s = round(time.monotonic() - start, 1)
            return report
        finally:
            over.set()
            fault_thread.join()
    finally:
        stack.close()  # the gateways, the workers, then the broker and Redis it started


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--requests", type=int, default=240, help="requests sent over the fault phase")
    p.add_argument("--duration", type=float, default=60.0, help="seconds over which faults and requests run")
    p.add_argument("--model", default="", help="checkpoint (default: the tiny model)")
    p.add_argument("--out", default="", help="write the report as JSON here")


def run(args: argparse.Namespace) -> int:
    model = args.model
    if not model:
        from engine.models.tiny import default_model_path

        model = str(default_model_path())
    log_dir = Path(tempfile.mkdtemp(prefix="inflight-chaos-"))
    report = soak(args.seed, args.requests, args.duration, log_dir, model)
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
