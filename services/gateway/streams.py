"""Token streams from Redis: one pub/sub connection per gateway, gap-free delivery per request.

Every stream of this gateway shares one subscriber connection (not one per request), read by one task
that routes messages to per-request queues. Pub/sub is fire-and-forget, so a stream also keeps the
contract's sequence numbers honest: a duplicate (seq seen) is dropped, a gap (seq jumps) is filled from
the request's log, and after the connection drops (Redis restart) every stream re-reads its log once
the subscription is back. The log is written in the same script as the publish, so it always holds
what was published.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common import keys
from services.common.store import REDIS_ERRORS, Store
from services.common.wire import DoneEvent, Event, WireError, decode_event

log = logging.getLogger(__name__)

_RESYNC = object()  # queue marker: re-read the log (the connection dropped, events may be lost)
_POLL_S = 5.0  # with no event for this long, look at the log anyway (a safety net, rarely used)


class StreamError(RuntimeError):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class Subscription:
    def __init__(self, hub: Hub, request_id: str) -> None:
        self.hub = hub
        self.request_id = request_id
        self.channel = keys.events(request_id)
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.next_seq = 1
        self.confirmed = asyncio.get_running_loop().create_future()

    def resync(self) -> None:
        """Read the log before anything live (a late subscriber: the events so far, then live)."""
        self.queue.put_nowait(_RESYNC)

    async def events(self, idle_timeout_s: float) -> AsyncIterator[Event | None]:
        """Events in sequence order, each once, ending with the DoneEvent; None while idle (a tick
        every few seconds, so an SSE writer can send a keep-alive and notice a gone client).

        Raises StreamError when no progress happens for ``idle_timeout_s``, or when events are lost
        for good (Redis lost them before this gateway could read them).
        """
        last_progress = time.monotonic()
        while True:
            idle = False
            try:
                item = await asyncio.wait_for(self.queue.get(), timeout=_POLL_S)
            except TimeoutError:
                item, idle = _RESYNC, True
            if item is _RESYNC:
                batch = await self._from_log()
                if idle and not batch:
                    yield None
            else:
                try:
                    event = decode_event(item)
                except WireError as exc:
                    raise StreamError(f"unreadable token event: {exc}", "wire") from None
                if event.seq < self.next_seq:
                    continue  # duplicate
                batch = [event] if event.seq == self.next_seq else await self._from_log(upto=event)
            for event in batch:
                self.next_seq = event.seq + 1
                last_progress = time.monotonic()
                yield event
                if isinstance(event, DoneEvent):
                    return
            if time.monotonic() - last_progress > idle_timeout_s:
                raise StreamError(f"no progress for {idle_timeout_s:.0f}s", "timeout")
            down_s = self.hub.down_for()
            if down_s > self.hub.outage_budget_s:
                raise StreamError(f"lost the connection to Redis {down_s:.0f}s ago", "store_unavailable")

    async def _from_log(self, upto: Event | None = None) -> list[Event]:
        """The events from next_seq on, from the log (plus ``upto``, which arrived live after a gap)."""
        try:
            logged = await self.hub.store.read_log(self.request_id)
        except REDIS_ERRORS:
            return []  # Redis is down; the hub resyncs once it is back
        found: dict[int, Event] = {e.seq: e for e in logged if e.seq >= self.next_seq}
        if upto is not None:
            found.setdefault(upto.seq, upto)
        out: list[Event] = []
        seq = self.next_seq
        while seq in found:
            out.append(found[seq])
            seq += 1
        if (found and not out) or (upto is not None and seq <= upto.seq):
            missing = min(s for s in range(self.next_seq, max(found) + 1) if s not in found)
            raise StreamError(f"token events from seq {missing} were lost (Redis restarted?)", "events_lost")
        return out


class Hub:
    def __init__(self, client: aioredis.Redis, store: Store, instance: str, outage_budget_s: float) -> None:
        self.client = client
        self.outage_budget_s = outage_budget_s
        self._down_since: float | None = None
        self.store = store
        self._subs: dict[str, Subscription] = {}
        self._pubsub = client.pubsub()
        self._home = f"{keys.PREFIX}:gateway:{instance}"  # keeps the connection subscribed when idle
        self._task: asyncio.Task[None] | None = None
        self._reconnecting = False

    async def start(self) -> None:
        await self._pubsub.subscribe(self._home)
        self._task = asyncio.create_task(self._read())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()

    def down_for(self) -> float:
        return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    @property
    def num_streams(self) -> int:
        return len(self._subs)

    async def subscribe(self, request_id: str, timeout_s: float = 5.0) -> Subscription:
        """Subscribe and wait for Redis to confirm: only then can no published event be missed."""
        sub = Subscription(self, request_id)
        self._subs[sub.channel] = sub
        try:
            await self._pubsub.subscribe(sub.channel)
            await asyncio.wait_for(asyncio.shield(sub.confirmed), timeout_s)
        except BaseException as exc:
            await self.unsubscribe(sub)
            if isinstance(exc, TimeoutError):
                raise RedisTimeoutError(f"Redis did not confirm the subscription in {timeout_s}s") from None
            raise
        return sub

    async def unsubscribe(self, sub: Subscription) -> None:
        if self._subs.get(sub.channel) is sub:
            del self._subs[sub.channel]
            with contextlib.suppress(*REDIS_ERRORS):
                await self._pubsub.unsubscribe(sub.channel)

    async def _read(self) -> None:
        while True:
            try:
                message = await self._pubsub.get_message(timeout=1.0)
            except REDIS_ERRORS as exc:
                if not self._reconnecting:
                    log.warning("token stream connection lost (%s); reconnecting", exc)
                    self._down_since = time.monotonic()
                self._reconnecting = True
                await asyncio.sleep(0.2)
                continue  # the next read reconnects and resubscribes every channel
            if message is None:
                continue
            channel = message["channel"]
            channel = channel.decode() if isinstance(channel, bytes) else channel
            sub = self._subs.get(channel)
            if message["type"] == "message":
                if sub is not None:
                    sub.queue.put_nowait(message["data"])
            elif message["type"] == "subscribe":
                if channel == self._home and self._reconnecting:
                    self._reconnecting = False
                    self._down_since = None
                    log.info("token stream connection restored; resyncing %d streams", len(self._subs))
                    for s in self._subs.values():
                        s.queue.put_nowait(_RESYNC)  # whatever was published meanwhile is in the logs
                if sub is not None and not sub.confirmed.done():
                    sub.confirmed.set_result(None)
