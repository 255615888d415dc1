"""Token streams from Redis: one pub/sub connection per gateway, gap-free delivery per request.

Every stream of this gateway shares one subscriber connection (not one per request), read by one task
that routes messages to per-request buffers. Pub/sub is fire-and-forget, so a stream also keeps the
contract's sequence numbers honest: a duplicate (seq seen) is dropped, a gap (seq jumps) is filled from
the request's log, and after the connection drops (Redis restart) every stream re-reads its log once
the subscription is back. The log is written in the same script as the publish, so it always holds
what was published.

Bounded, both ways:
- A stream's buffer holds what its client has not taken yet; a client that stops reading (its socket
  full) would make it grow with every token. Past ``buffer_bytes`` the buffer is dropped and the stream
  ends with a ``slow_reader`` error instead.
- The log is read in pages from the stream's own position, never whole: a stream that reconnects reads
  only what it missed, and at most ``_CONCURRENT_LOG_READS`` streams of a gateway read at once, so a
  reconnect of thousands of streams is a queue of small reads, not a storm.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, overload

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common import keys
from services.common.metrics import service_families
from services.common.store import REDIS_ERRORS, Store
from services.common.wire import DoneEvent, Event, WireError, decode_event
from services.gateway.background import Supervisor, forever

log = logging.getLogger(__name__)

_RESYNC = object()  # buffer marker: re-read the log (the connection dropped, events may be lost)
_OVERFLOW = object()  # buffer marker: the client fell too far behind; the stream ends
_POLL_S = 5.0  # with no event for this long, look at the log anyway (a safety net, rarely used)
_HEALTH_POLL_S = 1.0  # how often the hub asks whether its connection's health check is due
# What the pub/sub connection's calls raise when Redis goes away. redis-py's pub/sub connection is read by
# the hub's reader and, while it reconnects, by any SUBSCRIBE that reconnects it at the same time: the
# second reader of the handshake gets asyncio's RuntimeError ("read() called while another coroutine is
# already waiting"), the connection is dropped and both reconnect. A moment of the outage, not a bug.
_PUBSUB_ERRORS = (*REDIS_ERRORS, RuntimeError)
_SUBSCRIBE_RETRY_S = 0.05
LOG_PAGE = 256  # log entries per read: a page of token events is tens of kilobytes
_CONCURRENT_LOG_READS = 8  # per gateway: after a reconnect every stream queues for one of these
DEFAULT_BUFFER_BYTES = 1024 * 1024


class Flush:
    """Yielded by ``Subscription.events(flush=True)`` just before it waits (for Redis or for the next
    event): what a writer has gathered should go out now. Events that are already here follow without
    one, so a writer can send a backlog in one write instead of one per event."""


FLUSH = Flush()


class StreamError(RuntimeError):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class Subscription:
    def __init__(self, hub: Hub, request_id: str) -> None:
        self.hub = hub
        self.request_id = request_id
        self.channel = keys.events(request_id)
        self._buffer: collections.deque[Any] = collections.deque()  # raw events and markers
        self._ready = asyncio.Event()  # set while the buffer holds something
        self.buffered_bytes = 0
        self.overflowed = False
        # Called once when the buffer overflows (the stream's owner cancels the request: nobody reads it).
        self.on_overflow: Callable[[], None] | None = None
        # Called once when the subscription is released (the request's in-flight slot, budgets.py).
        self.on_release: Callable[[], None] | None = None
        self.next_seq = 1
        self._log_pos = 0  # the log index to read from next (everything before it has been seen)
        self.confirmed = asyncio.get_running_loop().create_future()

    def resync(self) -> None:
        """Read the log before anything live (a late subscriber: the events so far, then live)."""
        self._push(_RESYNC)

    def deliver(self, raw: Any) -> None:
        """A live message from the hub; past the byte bound the buffer is dropped (the stream ends)."""
        if self.overflowed:
            return
        size = len(raw)
        if self.buffered_bytes + size > self.hub.buffer_bytes:
            self.overflowed = True
            self.hub.buffered_bytes -= self.buffered_bytes
            self._buffer.clear()
            self.buffered_bytes = 0
            self._push(_OVERFLOW)
            service_families().gateway_streams_cut.inc()
            log.warning("stream %s: its client reads too slowly; ending it", self.request_id)
            if self.on_overflow is not None:
                self.on_overflow()
            return
        self.buffered_bytes += size
        self.hub.buffered_bytes += size
        self._push(raw)

    def _push(self, item: Any) -> None:
        self._buffer.append(item)
        self._ready.set()

    async def _take(self) -> Any:
        while not self._buffer:
            self._ready.clear()
            await self._ready.wait()
        return self._pop()

    def _pop(self) -> Any:
        item = self._buffer.popleft()
        if item is not _RESYNC and item is not _OVERFLOW:
            self.buffered_bytes -= len(item)
            self.hub.buffered_bytes -= len(item)
        return item

    def release(self) -> None:
        """Forget what is buffered (the stream is over)."""
        self.hub.buffered_bytes -= self.buffered_bytes
        self.buffered_bytes = 0
        self._buffer.clear()
        on_release, self.on_release = self.on_release, None
        if on_release is not None:
            on_release()

    @overload
    def events(
        self, idle_timeout_s: float, *, flush: Literal[False] = ...
    ) -> AsyncIterator[Event | None]: ...
    @overload
    def events(
        self, idle_timeout_s: float, *, flush: Literal[True]
    ) -> AsyncIterator[Event | Flush | None]: ...

    async def events(
        self, idle_timeout_s: float, *, flush: bool = False
    ) -> AsyncIterator[Event | Flush | None]:
        """Events in sequence order, each once, ending with the DoneEvent; None while idle (a tick
        every few seconds, so an SSE writer can send a keep-alive and notice a gone client); with
        ``flush``, FLUSH before every wait.

        Raises StreamError when no progress happens for ``idle_timeout_s``, when events are lost
        for good (Redis lost them before this gateway could read them), or when the client reads too
        slowly (its buffer overflowed).
        """
        last_progress = time.monotonic()
        more_logged = False  # the last log page was full: read the next one before anything live
        while True:
            idle = False
            if more_logged:
                item = _RESYNC
            elif self._buffer:
                # Already here: no timer to set up and cancel.
                item = self._pop()
            else:
                if flush:
                    yield FLUSH
                try:
                    # A timer, not wait_for's task per call: this wait comes once per token.
                    async with asyncio.timeout(_POLL_S):
                        item = await self._take()
                except TimeoutError:
                    item, idle = _RESYNC, True
            if item is _OVERFLOW:
                message = f"the client read too slowly: over {self.hub.buffer_bytes} bytes waited for it"
                raise StreamError(message, "slow_reader")
            if item is _RESYNC:
                if flush:
                    yield FLUSH
                batch, more_logged = await self._from_log()
                if idle and not batch:
                    yield None
            else:
                event = _decode(item)
                if event.seq < self.next_seq:
                    continue  # duplicate
                if event.seq == self.next_seq:
                    batch = [event]
                else:
                    if flush:
                        yield FLUSH
                    batch, more_logged = await self._from_log(upto=event)
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

    async def _from_log(self, upto: Event | None = None) -> tuple[list[Event], bool]:
        """The next page of events from next_seq on, from the log (plus ``upto``, which arrived live
        after a gap); and whether the page was full (more may follow).

        Where to start: the log holds each event once in seq order, except that a retried publish may
        log a few events again, which only pushes later ones further back. So the event numbered
        ``next_seq`` sits at index ``next_seq - 1`` or later, and reading from there skips nothing:

            log index   0  1  2  3  4  5        (events 2 and 3 logged twice)
            seq         1  2  3  2  3  4        next_seq 4 -> read from index 3: 2, 3 (dropped), 4
        """
        start = max(self._log_pos, self.next_seq - 1)
        name = keys.log(self.request_id)
        try:
            async with self.hub.log_reads:
                pipe = self.hub.client.pipeline(transaction=False)
                pipe.lrange(name, start, start + LOG_PAGE - 1)
                pipe.llen(name)
                raw, length = await pipe.execute()
                if not raw and 0 < length < start:
                    # Shorter than what this stream has read: Redis lost the log and it began again.
                    start = 0
                    raw = await self.hub.client.lrange(name, 0, LOG_PAGE - 1)
        except REDIS_ERRORS:
            return [], False  # Redis is down; the hub resyncs once it is back
        self._log_pos = start + len(raw)
        full = len(raw) == LOG_PAGE
        found: dict[int, Event] = {e.seq: e for e in map(_decode, raw) if e.seq >= self.next_seq}
        logged_max = max(found, default=0)
        if upto is not None:
            found.setdefault(upto.seq, upto)
        out: list[Event] = []
        seq = self.next_seq
        while seq in found:
            out.append(found[seq])
            seq += 1
        # Events are logged in seq order: one logged after a hole means the hole is lost for good. A
        # live event past the log's end is lost too, unless the page was full (the next one continues).
        if logged_max >= seq or (upto is not None and seq <= upto.seq and not full):
            missing = min(s for s in range(self.next_seq, max(found) + 1) if s not in found)
            raise StreamError(f"token events from seq {missing} were lost (Redis restarted?)", "events_lost")
        return out, full


def _decode(raw: Any) -> Event:
    try:
        return decode_event(raw)
    except WireError as exc:
        raise StreamError(f"unreadable token event: {exc}", "wire") from None


class Hub:
    def __init__(
        self,
        client: aioredis.Redis,
        store: Store,
        instance: str,
        outage_budget_s: float,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        supervisor: Supervisor | None = None,
    ) -> None:
        self.client = client
        self.outage_budget_s = outage_budget_s
        self.buffer_bytes = buffer_bytes  # per stream
        self.buffered_bytes = 0  # over all streams (exported as a gauge)
        self.log_reads = asyncio.Semaphore(_CONCURRENT_LOG_READS)
        self._down_since: float | None = None
        self.store = store
        self._subs: dict[str, Subscription] = {}
        self._pubsub = client.pubsub()
        self._home = f"{keys.PREFIX}:gateway:{instance}"  # keeps the connection subscribed when idle
        self._task: asyncio.Task[None] | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._reconnecting = False
        self._supervisor = supervisor or Supervisor()
        self._reads = 0  # starts of the reader: a restart may have missed messages

    async def start(self) -> None:
        await self._pubsub.subscribe(self._home)
        self._task = self._supervisor.start("token_hub", forever("token_hub", self._read))
        self._health_task = self._supervisor.start(
            "token_hub_health", forever("token_hub_health", self._check_health)
        )

    async def stop(self) -> None:
        for task in (self._task, self._health_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
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
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    await self._pubsub.subscribe(sub.channel)
                    break
                except RuntimeError as exc:  # reconnecting beside the reader (_PUBSUB_ERRORS): again
                    if time.monotonic() >= deadline:
                        raise RedisConnectionError(f"the subscription failed: {exc}") from None
                    await asyncio.sleep(_SUBSCRIBE_RETRY_S)
            remaining = max(0.0, deadline - time.monotonic())
            await asyncio.wait_for(asyncio.shield(sub.confirmed), remaining)
        except BaseException as exc:
            await self.unsubscribe(sub)
            if isinstance(exc, TimeoutError):
                raise RedisTimeoutError(f"Redis did not confirm the subscription in {timeout_s}s") from None
            raise
        return sub

    async def unsubscribe(self, sub: Subscription) -> None:
        sub.release()
        if self._subs.get(sub.channel) is sub:
            del self._subs[sub.channel]
            with contextlib.suppress(*_PUBSUB_ERRORS):
                await self._pubsub.unsubscribe(sub.channel)

    async def _check_health(self) -> None:
        """The client's health check of the connection (a PING once it has been idle for its
        health_check_interval), on a timer of its own: ``_read`` blocks without a timeout, where a
        timeout per read would be a timer set and cancelled per token event."""
        while True:
            await asyncio.sleep(_HEALTH_POLL_S)
            conn = self._pubsub.connection
            if conn is None or not conn.is_connected or self._reconnecting:
                continue  # the read reconnects
            # Sends only when due; the reply is read (and dropped) by _read.
            with contextlib.suppress(*_PUBSUB_ERRORS):
                await self._pubsub.check_health()

    async def _read(self) -> None:
        self._reads += 1
        if self._reads > 1:
            # Restarted after a failure: whatever was published meanwhile is in the logs.
            for s in self._subs.values():
                s.resync()
        while True:
            try:
                message = await self._pubsub.get_message(timeout=None)
            except _PUBSUB_ERRORS as exc:
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
                    sub.deliver(message["data"])
            elif message["type"] == "subscribe":
                if channel == self._home and self._reconnecting:
                    self._reconnecting = False
                    self._down_since = None
                    log.info("token stream connection restored; resyncing %d streams", len(self._subs))
                    for s in self._subs.values():
                        s.resync()  # whatever was published meanwhile is in the logs, after s's position
                if sub is not None and not sub.confirmed.done():
                    sub.confirmed.set_result(None)
                elif sub is None and channel != self._home:
                    # A stream released while the connection was down: its UNSUBSCRIBE never reached
                    # Redis, and the client, reconnecting, subscribed every channel it still had again.
                    with contextlib.suppress(*_PUBSUB_ERRORS):
                        await self._pubsub.unsubscribe(channel)
