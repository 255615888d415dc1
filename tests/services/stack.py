"""The service tests' stacks: harness/stack.py's builder with the tests' settings, and helpers to poll."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from harness.servers import ServerProcess
from harness.stack import ServiceProcess, Stack, build_stack

__all__ = [
    "FAST_RECOVERY",
    "MODEL_NAME",
    "PACED_STEP_DELAY_S",
    "REDIS_PASSWORD",
    "Stack",
    "new_stack",
    "wait_for",
    "worker_stats",
]

MODEL_NAME = "tiny"
REDIS_PASSWORD = "test-secret"

# The product's defaults are a 2 s consumer session and a 2 s lease (a SIGKILLed worker's requests
# resume within about 5 s; test_crash runs those defaults where it measures that). The other tests keep
# a 6 s session and a 3 s lease: on a loaded 2-core host, where the whole suite's processes take turns,
# a live worker's I/O loop can go without CPU long enough to miss a 2 s session or let a 2 s lease lapse
# under a request it still runs, and crash recovery at 6 s still fits a test. (tansu also waits about
# half the session timeout for members to join a rebalance.)
FAST_RECOVERY = {
    "INFLIGHT_LEASE_TTL_S": "3",
    "INFLIGHT_KAFKA_SESSION_TIMEOUT_MS": "6000",
}


# The paced stack's engine step delay (conftest.py ``paced_stack``): a request of N tokens runs for at
# least N x 20 ms on any host (1,800 tokens: 36 s), while the steps stay short enough that a cancel is
# seen at the next one and a paced test ends soon after it acts.
PACED_STEP_DELAY_S = "0.02"


def new_stack(
    kafka: ServerProcess,
    redis_server: ServerProcess,
    model: Path,
    log_dir: Path,
    *,
    workers: int = 1,
    gateway: bool = True,
    **env: str,
) -> Stack:
    """A stack on the given servers with its own topic and consumer group, so stacks sharing a broker
    never mix requests. ``env`` overrides the settings below."""
    settings = {
        "INFLIGHT_SERVED_MODEL_NAME": MODEL_NAME,
        "INFLIGHT_KAFKA_PARTITIONS": "4",
        "INFLIGHT_LOG_LEVEL": "INFO",
        "INFLIGHT_DRAIN_TIMEOUT_S": "5",
        "INFLIGHT_TORCH_THREADS": "1",  # a worker shares this small host with everything else here
        **FAST_RECOVERY,
        **env,
    }
    return build_stack(
        model,
        log_dir,
        workers=workers,
        gateways=int(gateway),
        kafka=kafka,
        redis=redis_server,
        tag="test",
        env=settings,
        ready_timeout_s=180.0,
    )


def worker_stats(worker: ServiceProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"{worker.url}/stats", timeout=5) as resp:
        stats: dict[str, Any] = json.loads(resp.read())
    return stats


def wait_for(predicate: Any, timeout_s: float, interval_s: float = 0.1, message: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {message}")
        time.sleep(interval_s)
