"""Quarantine: a request an engine already died under runs alone on its engine.

When an engine dies, every request it held counts an engine failure (poison.py): the one that killed it
and its batch neighbours cannot be told apart. Handed back together, they would resume together on the
next engine, and a neighbour would follow the culprit through every death until the bound fails it too.
So a request with an engine failure on its record (a *suspect*) enters the engine only when nothing else
of this worker is in it, and nothing else enters until it leaves: if the next engine dies, only the
culprit is there to count it, and an innocent suspect simply completes.

    shared runs  --(a suspect waits: no new shared run enters)-->  engine empty  -->  the suspect alone
    -->  it leaves (completed, failed, handed back)  -->  the next suspect, or the shared runs again

While a suspect waits or runs the worker fetches nothing more (intake.py), so new requests go to the
other workers instead of queueing behind it. The wait for the engine to empty is bounded
(``MAX_WAIT_S``): a long request already running must not stall the worker's partitions for its whole
length, so past the bound the suspect goes in beside the shared runs there (logged), and the worker
fetches again. Another suspect running alone is waited for whole.

State changes are plain assignments on the event loop, never behind an await, so a run cancelled at
any point cannot leave a count behind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

log = logging.getLogger(__name__)

MAX_WAIT_S = 30.0


class Quarantine:
    def __init__(self, max_wait_s: float = MAX_WAIT_S) -> None:
        self.max_wait_s = max_wait_s
        self._shared = 0  # runs in the engine that are not suspects
        self._alone = False  # a suspect holds the engine alone
        self._holding = 0  # suspects waiting within their bound: shared runs wait behind them
        self._changed = asyncio.Event()  # replaced at every change: waiters re-check

    @property
    def active(self) -> bool:
        """A suspect waits for the engine (within its bound) or holds it: take no new work."""
        return self._alone or self._holding > 0

    @property
    def num_shared(self) -> int:
        return self._shared

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _until(self, ready: Callable[[], bool], deadline: float | None = None) -> bool:
        """Wait until ``ready()``; False when ``deadline`` (monotonic) passes first."""
        while not ready():
            changed = self._changed
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return False
            try:
                await asyncio.wait_for(changed.wait(), timeout)
            except TimeoutError:
                return ready()
        return True

    @asynccontextmanager
    async def enter(self, suspect: bool) -> AsyncIterator[None]:
        """Hold a place in the engine for the body: a suspect's alone, anyone else's beside the others.
        Suspects go first: a shared run waits while one waits, so new requests cannot keep it out."""
        if not suspect:
            await self._until(lambda: not self.active)
            self._shared += 1
            try:
                yield
            finally:
                self._shared -= 1
                self._notify()
            return
        self._holding += 1
        try:
            alone = await self._until(
                lambda: self._shared == 0 and not self._alone, time.monotonic() + self.max_wait_s
            )
        finally:
            self._holding -= 1
            self._notify()  # a suspect that gave up (cancelled, past its bound) may hold others back
        if not alone:
            # The bound is on waiting for shared runs; another suspect alone is waited for whole (it
            # runs alone, so putting this one beside it would blame both for one death).
            await self._until(lambda: not self._alone)
            alone = self._shared == 0
        if not alone:
            log.warning(
                "a suspect request waited %.0fs for its engine to empty: it runs beside %d others",
                self.max_wait_s,
                self._shared,
            )
            async with self.enter(False):
                yield
            return
        self._alone = True
        try:
            yield
        finally:
            self._alone = False
            self._notify()
