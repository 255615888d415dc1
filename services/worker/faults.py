"""Fault injection for the failure-path tests and the chaos soak; inert unless its variable is set.

``INFLIGHT_FAULT_ENGINE_DIES_AFTER_STEPS=N``: the engine's step raises from step N+1 on, so its loop
dies for good (what a GPU fault or a kernel bug does to a real engine), while the process lives on.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

ENGINE_DIES_AFTER_STEPS = "INFLIGHT_FAULT_ENGINE_DIES_AFTER_STEPS"


def install(core: Any) -> None:
    """Wrap ``core.step`` (an ``LLMEngine``'s: in the engine core process, or in the worker's)."""
    raw = os.environ.get(ENGINE_DIES_AFTER_STEPS)
    if not raw:
        return
    limit = int(raw)
    step = core.step
    num_steps = 0

    def failing_step() -> Any:
        nonlocal num_steps
        num_steps += 1
        if num_steps > limit:
            raise RuntimeError(f"injected fault: the engine step fails for good after {limit} steps")
        return step()

    core.step = failing_step
    log.warning("fault injection: the engine dies after %d steps", limit)
