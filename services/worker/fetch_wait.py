"""How long the worker's fetches wait at the broker: a bounded long poll while it has work, a longer one
once it has been idle.

A fetch asks the broker to hold the request until data arrives or ``fetch_max_wait`` passes. Apache Kafka
answers as soon as a message arrives, so the wait costs a new arrival nothing and only spaces out the
fetches that find nothing: while requests run the worker waits ``kafka_fetch_max_wait_ms`` (100 ms by
default; the loopback tansu broker, which answers late in the wait, runs with 5). After
``IDLE_AFTER_S`` with no run in flight and nothing fetched, fetches wait ``kafka_idle_fetch_wait_ms``
instead, and the next fetch that finds a record is short again.

    busy (runs or records)  ->  100 ms  ... idle 2 s ...  ->  500 ms  ... a record arrives ...  ->  100 ms
"""

from __future__ import annotations

import time
from collections.abc import Callable

# Long enough that a burst's gaps (between a request's end and the next arrival) never switch to the long
# wait, short enough that an idle worker stops its fast polling within a couple of seconds.
IDLE_AFTER_S = 2.0


class FetchWait:
    """The fetch wait to use now, from whether the worker has work. ``idle_ms`` 0: never the long wait."""

    def __init__(
        self,
        busy_ms: int,
        idle_ms: int,
        idle_after_s: float = IDLE_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.busy_ms = busy_ms
        self.idle_ms = idle_ms
        self.idle_after_s = idle_after_s
        self._clock = clock
        self._last_busy = clock()

    def update(self, busy: bool) -> int:
        """``busy``: a run is in flight or the last fetch returned records. Returns the wait in ms."""
        now = self._clock()
        if busy:
            self._last_busy = now
        if self.idle_ms > 0 and now - self._last_busy >= self.idle_after_s:
            return self.idle_ms
        return self.busy_ms
