"""The gateway's background loops, supervised as the worker's are (services/worker/supervise.py).

The token hub's reader and health check, the queue watch, the liveness heartbeat and the live feed each
run until the gateway stops. One that raises is restarted with a capped backoff and reported by /readyz
meanwhile. Unlike a worker's watchers, none of these has a job that ends: one that *returns* has stopped
doing its work just as surely (a loop that fell out of its ``while``), so it counts as a failure too:
logged, reported and restarted.
"""

from __future__ import annotations

from services.worker import faults
from services.worker.supervise import Supervisor, TaskFactory

__all__ = ["Supervisor", "TaskFactory", "forever"]


def forever(name: str, factory: TaskFactory) -> TaskFactory:
    """``factory``, whose coroutine raises if it ever returns; and, where ``INFLIGHT_FAULT_TASK_FAILS``
    names it (tests), fails its first starts."""

    async def run() -> None:
        await factory()
        raise RuntimeError(f"background task {name} returned; it should run until the gateway stops")

    return faults.failing_task(name, run)
