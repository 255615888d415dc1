"""How loaded this worker is, told to Prometheus and to Kubernetes (pod-deletion-cost)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from prometheus_client import Gauge

from services.worker.control import Spawn
from services.worker.engine_client import EngineClient

if TYPE_CHECKING:
    from services.worker.k8s import PodDeletionCost

log = logging.getLogger(__name__)

INFLIGHT = Gauge("inflight_worker_requests", "Requests this worker holds (in the engine or about to be)")
KV_USAGE = Gauge("inflight_worker_kv_usage", "Fraction of KV cache blocks in use")
WAITING = Gauge("inflight_worker_engine_waiting", "Requests in the engine's waiting queue")
RUNNING = Gauge("inflight_worker_engine_running", "Requests in the engine's running batch")


class LoadReporter:
    def __init__(self, engine: EngineClient, spawn: Spawn) -> None:
        self.engine = engine
        self._spawn = spawn
        self._deletion_cost = _deletion_cost()

    def requests_changed(self, num_requests: int) -> None:
        INFLIGHT.set(num_requests)
        if self._deletion_cost is not None:
            # The pod with fewer requests is the cheaper one to delete when a deployment scales down.
            self._spawn(self._deletion_cost.update(num_requests))

    async def gauges_forever(self) -> None:
        while True:
            stats = self.engine.kv_stats()
            KV_USAGE.set(stats["usage"])
            WAITING.set(self.engine.num_waiting)
            RUNNING.set(self.engine.num_running)
            await asyncio.sleep(1.0)


def _deletion_cost() -> PodDeletionCost | None:
    # k8s.py belongs to the deployment; the worker must run before (and without) it.
    try:
        from services.worker.k8s import PodDeletionCost
    except ImportError:
        return None
    try:
        return PodDeletionCost.from_env()
    except Exception:
        log.exception("pod deletion cost disabled")
        return None
