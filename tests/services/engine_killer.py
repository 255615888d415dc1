"""A watcher that SIGKILLs the engine core of each worker that publishes a token of one request."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

from harness.servers import ServerProcess
from harness.stack import ServiceProcess
from services.common import keys
from services.common.wire import DeltaEvent, decode_event
from tests.services.stack import Stack, new_stack, worker_stats


class EngineKiller:
    """Kills the engine core of each worker that publishes a token of the request, once per worker."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.request_id: str | None = None
        self.killed: list[tuple[ServiceProcess, str]] = []  # (worker process, its worker id)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        redis = self.stack.redis_client()
        while not self._stop.is_set():
            self._stop.wait(0.05)
            if self.request_id is None:
                continue
            raw = redis.lrange(keys.log(self.request_id), -1, -1)
            last = decode_event(raw[0]) if raw else None
            if not isinstance(last, DeltaEvent) or last.worker in {w for _, w in self.killed}:
                continue
            found = self._worker(last.worker)
            if found is None:
                continue  # /stats slow to answer on a loaded host: try again, not end the watcher
            worker, stats = found
            try:
                os.kill(stats["engine_pid"], signal.SIGKILL)
            except OSError:
                continue
            self.killed.append((worker, last.worker))

    def _worker(self, worker_id: str) -> tuple[ServiceProcess, dict[str, Any]] | None:
        """The worker process named ``worker_id`` and its /stats; one that does not answer (a process
        that exited, one slow on a loaded host) is passed over, not a reason to stop looking."""
        for worker in self.stack.workers:
            try:
                stats = worker_stats(worker)
            except OSError:
                continue
            if stats.get("worker") == worker_id:
                return worker, stats
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def poison_stack(
    kafka: ServerProcess, redis_server: ServerProcess, model: Path, log_dir: Path, bound: int, **env: str
) -> Stack:
    """One worker more than ``bound`` engine failures (a survivor), each engine paced at 50 ms a step so
    that every kill finds the request running, whatever the host's speed."""
    return new_stack(
        kafka,
        redis_server,
        model,
        log_dir,
        workers=bound + 1,
        INFLIGHT_FAULT_STEP_DELAY_S="0.05",
        INFLIGHT_MAX_ENGINE_FAILURES=str(bound),
        **env,
    )
