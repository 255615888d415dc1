"""Is the engine core still stepping? A stalled core is treated like a dead one.

Only EOF on the pipe or a dead process says a core has died; a core that stops stepping (SIGSTOP, a
wedged driver, a livelock) would keep its requests until their leases and records expire. While the core
has work (its last message said it steps again at once, or a command waits for its answer), the client
expects its next message within a bound; past it, the client kills the core and fails its streams
with ``EngineStalled``, so its requests are handed back and resume elsewhere.

The bound follows the measured steps: ``max(floor_s, factor x the quantile of the recent step
intervals)`` (arrival to arrival of two consecutive messages of a busy core: the step, its encoding and
the pipe), so a model whose steps take seconds is not killed for being slow. For the first
``warmup_steps`` steps it is at least ``warmup_s``: they compile kernels and capture graphs, and no
step time has been measured yet.

How long detection takes: the bound (``floor_s``, 10 s by default, unless the core's own steps are
slower than a tenth of it), plus up to one watch interval (``tick_s``: a tenth of the floor, at most
0.5 s), plus the SIGKILL. The floor is seconds, not a multiple of a step, because a step shares its host
with everything else on it: a 2-core machine under load has stretched healthy steps of milliseconds to
seconds, and a false stall costs every running request a resume. It is well under a lease (10 s by
default) plus the requests' time to resume, which is what a missed stall would otherwise cost.

The limit of a bound learned from past steps: one step far longer than any before it (the first prefill
of a full token budget on a slow host, after the warm-up allowance) reads as a stall. Where a step can
take longer than the floor, raise it (``INFLIGHT_ENGINE_STALL_TIMEOUT_S``) above the longest step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from engine.metrics import percentile


class EngineStalled(RuntimeError):
    """The engine core had work and sent nothing within its bound: it was killed."""


@dataclass(frozen=True)
class StallPolicy:
    floor_s: float = 10.0  # never less: a loaded host stretches healthy steps (see the module docstring)
    factor: float = 10.0  # times the quantile of recent step intervals
    quantile: float = 0.99
    window: int = 512  # step intervals remembered (a few seconds of a fast model's steps)
    warmup_s: float = 300.0  # the first steps compile kernels and capture graphs
    warmup_steps: int = 16

    def __post_init__(self) -> None:
        if not (self.floor_s > 0 and self.factor > 0 and self.warmup_s >= 0 and self.window > 0):
            raise ValueError(f"invalid stall policy {self}")
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"the stall quantile must be in (0, 1], got {self.quantile}")

    @property
    def tick_s(self) -> float:
        """How often the watchdog looks: a tenth of the floor, at most 0.5 s."""
        return min(0.5, self.floor_s / 10)


class StepClock:
    """When the core last showed progress, whether it has work, and how long its steps take.

    Fed by the client's reader thread (every message from the core) and sender thread (commands that
    wait for an answer); read by the watchdog thread. All times are ``time.monotonic()``.
    """

    def __init__(self, policy: StallPolicy) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._intervals: deque[float] = deque(maxlen=policy.window)
        self._last_progress = time.monotonic()
        self._last_step: float | None = None  # arrival of the previous Step, if the core was busy after it
        self._core_busy = False  # the core's last message said another step follows at once
        self._awaiting = 0  # commands sent that the core has not answered yet
        self._paused = False  # the reader is not reading (its consumer is behind): not the core's fault
        self.num_steps = 0

    # ---- writers -------------------------------------------------------------------------------
    def on_sent(self, now: float) -> None:
        """A command that waits for an answer went to the core."""
        with self._lock:
            if not self._busy():
                self._last_progress = now  # the core has work from now on
            self._awaiting += 1

    def on_answer(self, now: float, core_busy: bool | None) -> None:
        """The core answered a command (``core_busy`` None: the answer says nothing about its work)."""
        with self._lock:
            self._awaiting = max(0, self._awaiting - 1)
            if core_busy is not None:
                self._core_busy = core_busy
            self._last_progress = now

    def on_step(self, now: float, num_steps: int, core_busy: bool) -> None:
        with self._lock:
            if self._last_step is not None and num_steps:
                self._intervals.append(now - self._last_step)
            self._last_step = now if core_busy else None
            self._core_busy = core_busy
            self._last_progress = now
            self.num_steps += num_steps

    def pause(self, paused: bool) -> None:
        """The reader stops (or resumes) reading because the event loop is behind."""
        with self._lock:
            self._paused = paused
            now = time.monotonic()
            self._last_progress = now
            if self._last_step is not None:
                self._last_step = now  # the wait was the reader's, not a step

    # ---- the watchdog's question ---------------------------------------------------------------
    def bound(self) -> float:
        with self._lock:
            return self._bound()

    def overdue(self, now: float) -> float | None:
        """Seconds since the last progress if the core has work and is past its bound, else None."""
        with self._lock:
            if self._paused or not self._busy():
                return None
            waited = now - self._last_progress
            return waited if waited > self._bound() else None

    def _busy(self) -> bool:
        return self._core_busy or self._awaiting > 0

    def _bound(self) -> float:
        p = self.policy
        bound = p.floor_s
        if self._intervals:
            bound = max(bound, p.factor * percentile(self._intervals, 100 * p.quantile))
        if self.num_steps < p.warmup_steps:
            bound = max(bound, p.warmup_s)
        return bound
