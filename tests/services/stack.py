"""A service stack for tests: gateway and worker processes on a loopback broker and Redis."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import redis as redis_lib

from services.common.servers import ServerProcess
from services.dev import ServiceProcess, launch, stack_env

MODEL_NAME = "tiny"
REDIS_PASSWORD = "test-secret"

# Short enough that crash recovery fits a test, long enough for a loaded 2-core machine. (tansu also
# waits about half the session timeout for members to join a rebalance.)
FAST_RECOVERY = {
    "INFLIGHT_LEASE_TTL_S": "3",
    "INFLIGHT_KAFKA_SESSION_TIMEOUT_MS": "6000",
}


@dataclass
class Stack:
    kafka: ServerProcess
    redis: ServerProcess
    env: dict[str, str]
    log_dir: Path
    workers: list[ServiceProcess] = field(default_factory=list)
    gateway: ServiceProcess | None = None

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    def client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60)
        return openai.OpenAI(base_url=f"{self.url}/v1", **kwargs)

    def redis_client(self) -> redis_lib.Redis:
        return redis_lib.Redis.from_url(self.redis.url, password=REDIS_PASSWORD, decode_responses=True)

    def add_worker(self, wait: bool = True, **env: str) -> ServiceProcess:
        worker = launch("worker", {**self.env, **env}, self.log_dir)
        self.workers.append(worker)
        if wait:
            worker.wait_ready()
        return worker

    def start_gateway(self, wait: bool = True, **env: str) -> ServiceProcess:
        self.gateway = launch("gateway", {**self.env, **env}, self.log_dir)
        if wait:
            self.gateway.wait_ready()
        return self.gateway

    def close(self) -> None:
        for proc in [self.gateway, *self.workers]:
            if proc is not None:
                proc.stop(timeout_s=10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.role} {p.port}\n{p.tail_log()}" for p in [self.gateway, *self.workers] if p)


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
    """A stack with its own topic and consumer group, so stacks sharing a broker never mix requests."""
    tag = uuid.uuid4().hex[:8]
    full_env = {
        **stack_env(kafka, redis_server, str(model)),
        "INFLIGHT_REDIS_PASSWORD": REDIS_PASSWORD,
        "INFLIGHT_SERVED_MODEL_NAME": MODEL_NAME,
        "INFLIGHT_KAFKA_TOPIC": f"inflight.test.{tag}",
        "INFLIGHT_KAFKA_CONSUMER_GROUP": f"workers-{tag}",
        "INFLIGHT_KAFKA_PARTITIONS": "4",
        "INFLIGHT_LOG_LEVEL": "INFO",
        "INFLIGHT_DRAIN_TIMEOUT_S": "5",
        "INFLIGHT_TORCH_THREADS": "1",  # a worker shares this small host with everything else here
        **FAST_RECOVERY,
        **env,
    }
    stack = Stack(kafka, redis_server, full_env, log_dir)
    # Start everything, then wait: process start-up (imports, model load) overlaps.
    procs = [stack.add_worker(wait=False) for _ in range(workers)]
    if gateway:
        procs.append(stack.start_gateway(wait=False))
    try:
        for proc in procs:
            proc.wait_ready()
    except BaseException:
        stack.close()
        raise
    return stack


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
