"""Fault injection for the failure-path tests and the chaos soak; inert unless its variable is set.

``INFLIGHT_FAULT_ENGINE_DIES_AFTER_STEPS=N``: the engine's step raises from step N+1 on, so its loop
dies for good (what a GPU fault or a kernel bug does to a real engine), while the process lives on.

``INFLIGHT_FAULT_STEP_DELAY_S=S``: every engine step first sleeps S seconds. Tests that need a request
still running at some point (a drain, a cancel, a kill mid-stream) pace the engine with it instead of
trusting the host to be slow enough: their outcome then does not depend on how fast the machine is.

``INFLIGHT_FAULT_TASK_FAILS=NAME:N[,NAME:N]``: the worker's background task NAME (supervise.py: publisher,
cancel_listener, ...) raises at each of its first N starts, as a bug would: its supervisor restarts it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)

ENGINE_DIES_AFTER_STEPS = "INFLIGHT_FAULT_ENGINE_DIES_AFTER_STEPS"
STEP_DELAY_S = "INFLIGHT_FAULT_STEP_DELAY_S"
TASK_FAILS = "INFLIGHT_FAULT_TASK_FAILS"


def install(core: Any) -> None:
    """Wrap ``core.step`` (an ``EngineCore``'s in the engine core process, or the in-process
    ``LLMEngine``'s in the worker's)."""
    raw_limit = os.environ.get(ENGINE_DIES_AFTER_STEPS)
    raw_delay = os.environ.get(STEP_DELAY_S)
    if raw_delay:
        delay = float(raw_delay)
        paced = core.step

        def slow_step() -> Any:
            time.sleep(delay)
            return paced()

        core.step = slow_step
        log.warning("fault injection: every engine step sleeps %.3f s first", delay)
    if raw_limit:
        limit = int(raw_limit)
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


def failing_task(
    name: str, factory: Callable[[], Coroutine[Any, Any, Any]]
) -> Callable[[], Coroutine[Any, Any, Any]]:
    """``factory``, or one whose first N coroutines raise where ``INFLIGHT_FAULT_TASK_FAILS`` names it."""
    wanted = dict(item.split(":") for item in os.environ.get(TASK_FAILS, "").split(",") if ":" in item)
    if name not in wanted:
        return factory
    left = int(wanted[name])
    log.warning("fault injection: background task %s fails at its first %d starts", name, left)

    async def fail() -> None:
        raise RuntimeError(f"injected fault: background task {name} fails")

    def make() -> Coroutine[Any, Any, Any]:
        nonlocal left
        if left > 0:
            left -= 1
            return fail()
        return factory()

    return make
