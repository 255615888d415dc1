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
other workers instead of queueing behind it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Quarantine:
    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._shared = 0  # runs in the engine that are not suspects
        self._alone = False  # a suspect is in the engine
        self._suspects_waiting = 0

    @property
    def active(self) -> bool:
        """A suspect waits for the engine or holds it: take no new work."""
        return self._alone or self._suspects_waiting > 0

    @property
    def num_shared(self) -> int:
        return self._shared

    @asynccontextmanager
    async def enter(self, suspect: bool) -> AsyncIterator[None]:
        """Hold a place in the engine for the body: a suspect's alone, anyone else's beside the others.
        Suspects go first: a shared run waits while one waits, so a stream of new requests cannot keep a
        suspect out for ever."""
        async with self._changed:
            if suspect:
                self._suspects_waiting += 1
                try:
                    await self._changed.wait_for(lambda: self._shared == 0 and not self._alone)
                finally:
                    self._suspects_waiting -= 1
                    # A suspect that gave up waiting (cancelled) may be what held the shared runs back.
                    self._changed.notify_all()
                self._alone = True
            else:
                await self._changed.wait_for(lambda: not self.active)
                self._shared += 1
        try:
            yield
        finally:
            async with self._changed:
                if suspect:
                    self._alone = False
                else:
                    self._shared -= 1
                self._changed.notify_all()
