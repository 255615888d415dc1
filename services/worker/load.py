"""How loaded this worker is, told to Prometheus and to Kubernetes (pod-deletion-cost).

The engine's own load (running, waiting, KV usage) is exported once, by the engine's exporter
(``inflight:num_requests_running`` ..., services/common/metrics.py); this module adds only what the
worker alone knows: the requests it holds, engine or not.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from services.common.metrics import service_families
from services.worker.control import Spawn

if TYPE_CHECKING:
    from services.worker.k8s import PodDeletionCost

log = logging.getLogger(__name__)

INFLIGHT = service_families().worker_requests


class LoadReporter:
    def __init__(self, spawn: Spawn) -> None:
        self._spawn = spawn
        self._deletion_cost = _deletion_cost()

    def requests_changed(self, num_requests: int) -> None:
        INFLIGHT.set(num_requests)
        if self._deletion_cost is not None:
            # The pod with fewer requests is the cheaper one to delete when a deployment scales down.
            self._spawn(self._deletion_cost.update(num_requests))


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
