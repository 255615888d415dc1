"""The loopback stack: a broker, a Redis, worker and gateway processes, built in one place.

``build_stack`` is what ``inflight dev``, the service tests, the chaos soak and the service benchmarks
all start; ``ServiceProcess`` is one ``inflight gateway`` or ``inflight worker`` child. Children run in
their own process group (``stop()`` reaches everything they started) and die with the process that
launched them even if it is killed (PR_SET_PDEATHSIG), so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.servers import ServerProcess, free_port, start_kafka, start_redis

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: ask the kernel to SIGTERM it when the parent dies.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(eq=False)
class ServiceProcess:
    """An ``inflight gateway`` or ``inflight worker`` child with its HTTP port."""

    role: str
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        wait_ready([self], timeout_s)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        self.send_signal(sig)
        return self.wait_stopped(timeout_s)

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to its process group, if it is still running."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def wait_stopped(self, timeout_s: float) -> int | None:
        """Wait for it to exit; SIGKILL its process group if it has not within ``timeout_s``."""
        try:
            self.proc.wait(max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crashed pod: no drain, no goodbye to the consumer group."""
        self.stop(signal.SIGKILL, timeout_s=5)

    def tail_log(self, num_bytes: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")
        return ""


def launch(role: str, env: dict[str, str], log_dir: Path, port: int | None = None) -> ServiceProcess:
    """Start ``python -m inflight <role>`` with ``env`` on top of this process's environment."""
    port = port or free_port()
    port_var = "INFLIGHT_GATEWAY_PORT" if role == "gateway" else "INFLIGHT_WORKER_PORT"
    full_env = {**os.environ, **env, port_var: str(port)}
    if role == "gateway" and not env.get("INFLIGHT_GATEWAY_METRICS_PORT"):
        # Gateways side by side on one host each need a metrics port of their own (the default is fixed).
        full_env["INFLIGHT_GATEWAY_METRICS_PORT"] = str(free_port())
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{role}-{port}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "inflight", role],
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() reaches everything it started
            preexec_fn=_die_with_parent,
        )
    return ServiceProcess(role, proc, port, log_path)


def wait_ready(
    children: Sequence[ServiceProcess],
    timeout_s: float = 300.0,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Wait until every child answers ``/readyz``; raise with its log tail if one exits or the time runs
    out. Children start together, so one deadline covers them all. ``progress`` hears how many of each
    role are ready every few seconds (model loads take a while, and a silent terminal looks hung)."""
    started = time.monotonic()
    deadline, last_report = started + timeout_s, started
    pending = list(children)
    while True:
        for child in pending:
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.role} exited with {child.proc.returncode}:\n{child.tail_log()}")
        pending = [c for c in pending if not c.ready()]
        if not pending:
            return
        now = time.monotonic()
        if now > deadline:
            child = pending[0]
            raise TimeoutError(f"{child.role} not ready after {timeout_s:.0f}s:\n{child.tail_log()}")
        if progress is not None and now - last_report >= 5:
            last_report = now
            progress(f"  ... {readiness_line(children, pending)} ({now - started:.0f}s)")
        time.sleep(0.2)


def readiness_line(children: Sequence[ServiceProcess], pending: Sequence[ServiceProcess]) -> str:
    """``workers 2/4 ready (loading the model), gateway ready``: each role's count, in start order."""
    parts = []
    for role in dict.fromkeys(c.role for c in children):
        total = sum(1 for c in children if c.role == role)
        ready = total - sum(1 for c in pending if c.role == role)
        doing = "loading the model" if role == "worker" else "starting"
        name = f"{role}s" if total > 1 else role
        count = f"{ready}/{total} ready" if total > 1 else ("ready" if ready else "not ready")
        parts.append(f"{name} {count}" + (f" ({doing})" if ready < total else ""))
    return ", ".join(parts)


def consuming_workers(gateway_url: str) -> int | None:
    """What a gateway's ``/readyz`` counts as workers consuming its topic (None: not answering)."""
    try:
        with urllib.request.urlopen(f"{gateway_url}/readyz", timeout=2) as resp:
            body = json.loads(resp.read())
    except (OSError, ValueError):
        return None
    workers = body.get("workers") if isinstance(body, dict) else None
    return workers if isinstance(workers, int) else None


def wait_consuming(
    gateway: ServiceProcess,
    num_workers: int,
    timeout_s: float,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Wait until the gateway counts ``num_workers`` workers consuming its topic: a worker is ready once
    its consumer runs, but it takes requests only once the group has given it partitions (a rebalance
    per worker joining), and a request sent before any worker has them waits in Kafka meanwhile."""
    started = time.monotonic()
    last_report = started
    while True:
        found = consuming_workers(gateway.url) or 0
        if found >= num_workers:
            return
        now = time.monotonic()
        if now - started > timeout_s:
            raise TimeoutError(
                f"{found} of {num_workers} workers consuming the topic after {timeout_s:.0f}s "
                "(the consumer group has not given every worker partitions)"
            )
        if progress is not None and now - last_report >= 5:
            last_report = now
            progress(f"  ... workers consuming: {found}/{num_workers} ({now - started:.0f}s)")
        time.sleep(0.2)


# The fetch wait of services on tansu, the loopback broker: it answers a fetch late in the wait (tens of
# ms into a 100 ms wait) even when a message is there, where Apache Kafka answers at once.
TANSU_FETCH_WAIT_MS = 5


def stack_env(kafka: ServerProcess, redis: ServerProcess, model: str) -> dict[str, str]:
    """Settings for services talking to the loopback broker and Redis."""
    env = {
        "INFLIGHT_KAFKA_BOOTSTRAP": kafka.address,
        "INFLIGHT_KAFKA_IDEMPOTENCE": "false",  # tansu has no idempotent producer
        # tansu answers a fetch late in its wait rather than when a message arrives, as Apache Kafka does:
        # a short wait keeps a request's pick-up quick on it (TANSU_FETCH_WAIT_MS).
        "INFLIGHT_KAFKA_FETCH_MAX_WAIT_MS": str(TANSU_FETCH_WAIT_MS),
        "INFLIGHT_REDIS_URL": redis.url,
        "INFLIGHT_MODEL": model,
        "INFLIGHT_BIND_HOST": "127.0.0.1",
    }
    if redis.password:
        env["INFLIGHT_REDIS_PASSWORD"] = redis.password
    return env


@dataclass(eq=False)
class Stack:
    """Servers and service processes on loopback. ``close()`` stops the gateways first (no new
    requests), then the workers (they drain), then the servers this stack started itself."""

    kafka: ServerProcess
    redis: ServerProcess
    env: dict[str, str]
    log_dir: Path
    workers: list[ServiceProcess] = field(default_factory=list)
    gateways: list[ServiceProcess] = field(default_factory=list)
    own_servers: list[ServerProcess] = field(default_factory=list)

    @property
    def gateway(self) -> ServiceProcess | None:
        """The first gateway (most stacks have one)."""
        return self.gateways[0] if self.gateways else None

    @property
    def url(self) -> str:
        if self.gateway is None:
            raise RuntimeError("this stack has no gateway")
        return self.gateway.url

    def live_gateways(self) -> list[str]:
        return [g.url for g in self.gateways if g.proc.poll() is None]

    def add_worker(self, wait: bool = True, **env: str) -> ServiceProcess:
        worker = launch("worker", {**self.env, **env}, self.log_dir)
        self.workers.append(worker)
        if wait:
            worker.wait_ready()
        return worker

    def add_gateway(self, wait: bool = True, port: int | None = None, **env: str) -> ServiceProcess:
        """A gateway on this stack's broker and Redis; ``env`` overrides the stack's settings for it."""
        gateway = launch("gateway", {**self.env, **env}, self.log_dir, port=port)
        self.gateways.append(gateway)
        if wait:
            gateway.wait_ready()
        return gateway

    def client(self, **kwargs: Any) -> Any:
        """An ``openai.OpenAI`` client on the first gateway (no retries: tests see every failure)."""
        import openai  # dev extra: only tests and benchmarks talk to the stack through it

        kwargs.setdefault("api_key", "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60)
        return openai.OpenAI(base_url=f"{self.url}/v1", **kwargs)

    def redis_client(self) -> Any:
        import redis as redis_lib

        return redis_lib.Redis.from_url(self.redis.url, password=self.redis.password, decode_responses=True)

    def close(self, timeout_s: float = 10.0) -> None:
        # The gateways together, then the workers together: one at a time, each worker that leaves
        # the consumer group would start a rebalance the next one has to sit through before its own
        # drain and goodbye.
        for group in (self.gateways, self.workers):
            for proc in group:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for proc in group:
                proc.wait_stopped(deadline - time.monotonic())
        for server in self.own_servers:
            server.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.role} {p.port}\n{p.tail_log()}" for p in [*self.gateways, *self.workers])


def build_stack(
    model: str | Path,
    log_dir: Path,
    *,
    workers: int = 1,
    gateways: int = 1,
    kafka: ServerProcess | None = None,
    redis: ServerProcess | None = None,
    redis_password: str | None = None,
    tag: str | None = None,
    gateway_port: int | None = None,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 300.0,
    progress: Callable[[str], None] | None = None,
) -> Stack:
    """Start a stack and wait until every process is ready.

    ``kafka`` / ``redis``: servers to share (a test session's); without them the stack starts its own
    under ``log_dir`` and stops them on ``close()``. ``tag``: a topic and consumer group of the stack's
    own, so stacks sharing a broker never mix requests. ``env`` goes on top of the loopback settings.
    Processes start together and are waited for afterwards, so their start-ups (imports, model load)
    overlap. On any failure everything started here is stopped again.
    """
    stack: Stack | None = None
    owned: list[ServerProcess] = []
    try:
        if kafka is None:
            kafka = start_kafka(workdir=log_dir / "kafka")
            owned.append(kafka)
        if redis is None:
            redis = start_redis(password=redis_password, workdir=log_dir / "redis")
            owned.append(redis)
        full_env = stack_env(kafka, redis, str(model))
        if tag is not None:
            unique = uuid.uuid4().hex[:8]
            full_env["INFLIGHT_KAFKA_TOPIC"] = f"inflight.{tag}.{unique}"
            full_env["INFLIGHT_KAFKA_CONSUMER_GROUP"] = f"{tag}-{unique}"
        stack = Stack(kafka, redis, {**full_env, **(env or {})}, log_dir, own_servers=owned)
        for _ in range(workers):
            stack.add_worker(wait=False)
        for i in range(gateways):
            stack.add_gateway(wait=False, port=gateway_port if i == 0 else None)
        wait_ready([*stack.workers, *stack.gateways], ready_timeout_s, progress)
    except BaseException:
        if stack is not None:
            stack.close()
        for server in owned:
            server.stop()
        raise
    return stack
