"""The live view's fan-out: one Redis subscription per gateway, relayed to every viewer.

Each browser on the live page follows ``/v1/live/events``. A Redis connection per viewer would let
viewers exhaust Redis's connections; here the gateway holds one subscription while anyone watches, and
each viewer gets a small queue of its own. The view is a sliding picture, so a viewer that falls
behind loses its oldest messages, never the gateway's memory. At most ``INFLIGHT_MAX_LIVE_VIEWERS``
viewers per gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis

from services.common.live_wire import LIVE_CHANNEL, LiveSteps
from services.common.store import REDIS_ERRORS
from services.gateway.background import Supervisor, forever

log = logging.getLogger(__name__)

VIEWER_QUEUE = 16  # messages: a few seconds of every worker's steps


class Viewer:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[str] = asyncio.Queue(VIEWER_QUEUE)
        self.dropped = 0

    def offer(self, data: str) -> None:
        if self.queue.full():
            self.queue.get_nowait()  # the oldest goes: the newest steps are what the page shows
            self.dropped += 1
        self.queue.put_nowait(data)


class LiveFeed:
    def __init__(
        self, client: aioredis.Redis, max_viewers: int, supervisor: Supervisor | None = None
    ) -> None:
        self.client = client
        self._supervisor = supervisor or Supervisor()
        self.max_viewers = max_viewers
        self._viewers: set[Viewer] = set()
        self._task: asyncio.Task[None] | None = None

    @property
    def num_viewers(self) -> int:
        return len(self._viewers)

    @property
    def full(self) -> bool:
        return len(self._viewers) >= self.max_viewers

    def join(self) -> Viewer | None:
        """A new viewer, or None at the cap. The subscription starts with the first viewer."""
        if self.full:
            return None
        viewer = Viewer()
        self._viewers.add(viewer)
        if self._task is None:
            self._task = self._supervisor.start("live_feed", forever("live_feed", self._relay))
        return viewer

    def leave(self, viewer: Viewer) -> None:
        """The subscription ends with the last viewer (nobody watching costs Redis nothing)."""
        self._viewers.discard(viewer)
        if not self._viewers and self._task is not None:
            self._task.cancel()
            self._task = None

    async def stop(self) -> None:
        self._viewers.clear()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _relay(self) -> None:
        pubsub = self.client.pubsub()
        try:
            while True:
                try:
                    if not pubsub.subscribed:
                        await pubsub.subscribe(LIVE_CHANNEL)
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                except REDIS_ERRORS as exc:
                    log.debug("live feed: %r; subscribing again", exc)
                    await asyncio.sleep(0.5)  # the next read reconnects and subscribes again
                    continue
                if message is not None:
                    self._fan_out(message["data"])
        finally:
            with contextlib.suppress(Exception):  # a dead connection is closed by the pool anyway
                await asyncio.shield(pubsub.aclose())

    def _fan_out(self, data: bytes | str) -> None:
        text = data.decode() if isinstance(data, bytes) else str(data)
        try:
            LiveSteps.decode(text)  # a message from a newer or older worker is dropped, loudly
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("dropping a live message: %s", exc)
            return
        for viewer in self._viewers:
            viewer.offer(text)
