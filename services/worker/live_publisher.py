"""Publishes the engine's recent steps for the live page, rate-limited.

The engine calls ``on_step`` on its own thread after every step; that only appends a compact row to a
bounded deque (thread-safe for one producer and one consumer), so a slow or absent Redis never slows a
step. An asyncio task drains the deque every ``interval_s`` and publishes one ``LiveSteps`` message:
at most ``max_steps`` steps in it, the rest counted as dropped, and while the engine is idle one
heartbeat a second, so the page shows "idle" rather than the last busy step forever. A fast engine
runs far more steps than that in an interval (a tiny model: about a hundred), so the steps where
the batch changed (a request joined or left) are kept first and the newest fill the rest: those
are what the page exists to show.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from services.common.live_wire import LIVE_CHANNEL, LiveStep, LiveSteps, short_id
from services.common.store import REDIS_ERRORS

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from engine.metrics import EngineStatsSource, StepRecord

log = logging.getLogger(__name__)

_IDLE_HEARTBEAT_S = 1.0


class LivePublisher:
    def __init__(self, worker_id: str, interval_s: float = 0.25, max_steps: int = 32) -> None:
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.max_steps = max_steps
        # Engine thread appends, the publishing task pops: a bounded buffer between them.
        self._pending: deque[tuple[LiveStep, int, int, float]] = deque(maxlen=max_steps)
        self._changes: deque[tuple[LiveStep, int, int, float]] = deque(maxlen=max_steps)
        self._members: frozenset[str] = frozenset()  # the last step's requests (engine thread)
        self._num_steps = 0  # written by the engine thread only
        self._num_seen = 0  # steps the publisher has accounted for

    def attach(self, engine: EngineStatsSource) -> None:
        engine.metrics.step_listeners.append(self.on_step)

    def on_step(self, record: StepRecord) -> None:
        stats = record.stats
        step = LiveStep(
            n=record.step,
            ms=round(record.duration * 1000, 2),
            tokens=stats.num_scheduled_tokens,
            batch=[(short_id(rid), scheduled, computed) for rid, scheduled, computed in record.batch],
        )
        entry = (step, stats.num_running, stats.num_waiting, stats.kv_usage)
        self._pending.append(entry)
        members = frozenset(rid for rid, _, _ in step.batch)
        if members != self._members:
            self._changes.append(entry)
            self._members = members
        self._num_steps += 1

    def take(self) -> LiveSteps | None:
        """The message for the steps since the last call; None when there were none."""
        newest, changes = [], []
        while self._pending:
            newest.append(self._pending.popleft())
        while self._changes:
            changes.append(self._changes.popleft())
        # Batch changes first (up to half the message), then the newest steps, in step order.
        keep = {e[0].n: e for e in changes[-(self.max_steps // 2) :]}
        for e in reversed(newest):
            if len(keep) >= self.max_steps:
                break
            keep.setdefault(e[0].n, e)
        taken = [keep[n] for n in sorted(keep)]
        total = self._num_steps
        new = total - self._num_seen
        self._num_seen = total
        if not taken:
            return None
        _, running, waiting, kv_usage = newest[-1] if newest else taken[-1]
        return LiveSteps(
            worker=self.worker_id,
            t=time.time(),
            running=running,
            waiting=waiting,
            kv_usage=round(kv_usage, 4),
            steps=[s for s, *_ in taken],
            dropped=max(0, new - len(taken)),
        )

    async def run_forever(self, client: aioredis.Redis) -> None:
        last_sent = 0.0
        while True:
            await asyncio.sleep(self.interval_s)
            message = self.take()
            now = time.monotonic()
            if message is None:
                if now - last_sent < _IDLE_HEARTBEAT_S:
                    continue
                # No step ran: the engine has nothing scheduled (it steps whenever it has work).
                message = LiveSteps(self.worker_id, time.time(), running=0, waiting=0, kv_usage=0.0)
            try:
                await client.publish(LIVE_CHANNEL, message.encode())
                last_sent = now
            except REDIS_ERRORS as exc:  # the view is best effort: serving goes on without it
                log.debug("live view publish failed: %r", exc)


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
