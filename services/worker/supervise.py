"""Supervised background tasks: one that raises is logged and started again, after a capped backoff.

Each of the worker's loops (publisher, lease keeper, cancel listener, commit loop, ...) handles the
errors it expects; anything else would end its task for good, silently, and the worker would go on
without it: no tokens reaching Redis, leases lapsing, cancels unheard. Here such a task is restarted
after 0.2 s, 0.4 s, ... up to ``cap_s`` while it keeps failing, and counts as a problem (the worker's
/readyz answers 503) from the failure until it has run ``stable_s`` without failing again, so a task
that fails at every start reads as down, not as flickering.

A task that returns has done its job (a watcher that saw what it waited for) and is not restarted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

TaskFactory = Callable[[], Coroutine[Any, Any, Any]]  # a fresh coroutine for every (re)start


@dataclass
class _Child:
    name: str
    factory: TaskFactory
    failures: int = 0  # in a row: the backoff's exponent
    error: str | None = None  # the last failure
    down_since: float | None = None  # failed, waiting to be restarted
    restarted: float | None = None  # when it was last started again after a failure


class Supervisor:
    def __init__(
        self,
        *,
        base_s: float = 0.2,
        cap_s: float = 10.0,
        stable_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # cap_s: a task failing on every start (a persistent cause) costs a log line every 10 s, not a
        # busy loop; stable_s: a restarted task that lives this long has recovered (backoff starts over).
        self.base_s, self.cap_s, self.stable_s = base_s, cap_s, stable_s
        self._clock = clock
        self._children: list[_Child] = []
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, name: str, factory: TaskFactory) -> asyncio.Task[None]:
        """Run ``factory()`` as a supervised task; cancelling the returned task stops it for good."""
        child = _Child(name, factory)
        self._children.append(child)
        task = asyncio.create_task(self._supervise(child), name=name)
        self._tasks.append(task)
        task.add_done_callback(lambda _: self._children.remove(child))
        return task

    async def _supervise(self, child: _Child) -> None:
        while True:
            began = self._clock()
            try:
                await child.factory()
                return
            except Exception as exc:
                now = self._clock()
                if now - began >= self.stable_s:
                    child.failures = 0  # it had recovered: this is a new spell, not the same one
                child.failures += 1
                # (The exponent is bounded too: a task failing for days must not overflow a float.)
                delay = min(self.cap_s, self.base_s * 2 ** min(child.failures - 1, 32))
                child.error, child.down_since = repr(exc), now
                log.error(
                    "background task %s failed (%d in a row); restarting in %.1fs",
                    child.name,
                    child.failures,
                    delay,
                    exc_info=exc,
                )
            await asyncio.sleep(delay)
            child.down_since, child.restarted = None, self._clock()
            log.info("background task %s restarted", child.name)

    def problems(self) -> list[str]:
        """One line for each task that is down, or was restarted less than ``stable_s`` ago."""
        now = self._clock()
        out = []
        for child in self._children:
            if child.down_since is not None:
                out.append(f"{child.name}: down for {now - child.down_since:.1f}s after {child.error}")
            elif child.restarted is not None and now - child.restarted < self.stable_s:
                out.append(f"{child.name}: restarted {now - child.restarted:.1f}s ago after {child.error}")
        return out

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        return list(self._tasks)
