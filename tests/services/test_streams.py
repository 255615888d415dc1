"""The gateway's token streams on a real Redis: bounded buffers, paged log reads, and a reconnect that
reads each log only from the stream's own position.

Events are written as the worker's publish script writes them (appended to the request's log and
published on its channel in one step), so the hub sees exactly what it sees in service.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from harness.servers import ServerProcess, start_redis
from services.common import keys
from services.common.store import Store
from services.common.wire import COMPLETED, DeltaEvent, DoneEvent, Event, encode_event
from services.gateway.token_streams import LOG_PAGE, Hub, StreamError, Subscription
from tests.services.stack import REDIS_PASSWORD

pytestmark = pytest.mark.timeout(60)


class Bench:
    def __init__(self, url: str, buffer_bytes: int = 1 << 20) -> None:
        self.name = f"streams-{uuid.uuid4().hex[:8]}"
        # Named, so the test can find (and kill) the hub's own pub/sub connection among the session's.
        self.client = aioredis.Redis.from_url(
            url, password=REDIS_PASSWORD, decode_responses=True, client_name=self.name
        )
        self.admin = aioredis.Redis.from_url(url, password=REDIS_PASSWORD, decode_responses=True)
        self.hub = Hub(self.client, Store(self.client), self.name, 30.0, buffer_bytes)

    async def publish(self, request_id: str, events: list[Event]) -> None:
        raw = [encode_event(e) for e in events]
        pipe = self.admin.pipeline(transaction=True)
        pipe.rpush(keys.log(request_id), *raw)
        for one in raw:
            pipe.publish(keys.events(request_id), one)
        await pipe.execute()

    async def close(self) -> None:
        await self.hub.stop()
        await self.client.aclose()
        await self.admin.aclose()


@pytest.fixture
async def bench(redis_server: ServerProcess) -> AsyncIterator[Bench]:
    b = Bench(redis_server.url)
    await b.hub.start()
    yield b
    await b.close()


def _deltas(request_id: str, first: int, last: int) -> list[Event]:
    return [DeltaEvent(request_id, seq, 0, [seq], f"t{seq} ") for seq in range(first, last + 1)]


async def _log_reads(admin: aioredis.Redis, key: str, into: list[int], watching: asyncio.Event) -> None:
    """The start index of every LRANGE on ``key``, as Redis executed them (MONITOR), until an ECHO of
    ``key`` (``_stop_reads``). ``watching`` is set once Redis has said OK to MONITOR: from then on it
    reports every command, in the order it ran them, however slow the host."""
    async with admin.monitor() as monitor:
        watching.set()
        async for command in monitor.listen():
            words = str(command.get("command", "")).split()
            if len(words) >= 2 and words[0].upper() == "ECHO" and words[1] == key:
                return
            if len(words) >= 3 and words[0].upper() == "LRANGE" and words[1] == key:
                into.append(int(words[2]))


async def _watch_reads(admin: aioredis.Redis, key: str, into: list[int]) -> asyncio.Task[None]:
    watching = asyncio.Event()
    monitor = asyncio.create_task(_log_reads(admin, key, into, watching))
    await asyncio.wait_for(watching.wait(), 10)
    return monitor


async def _stop_reads(admin: aioredis.Redis, key: str, monitor: asyncio.Task[None]) -> None:
    # The ECHO runs after every read the caller has seen answered, so the monitor has seen those first.
    await admin.echo(key)
    await asyncio.wait_for(monitor, 10)


async def _take(events: AsyncIterator[Event | None], count: int) -> list[Event]:
    out: list[Event] = []
    while len(out) < count:
        event = await anext(events)
        if event is not None:
            out.append(event)
    return out


async def test_a_late_subscriber_reads_the_log_in_pages(bench: Bench) -> None:
    request_id = f"cmpl-{uuid.uuid4().hex}"
    total = 2 * LOG_PAGE + 40
    await bench.publish(
        request_id, [*_deltas(request_id, 1, total), DoneEvent(request_id, total + 1, COMPLETED)]
    )
    starts: list[int] = []
    monitor = await _watch_reads(bench.admin, keys.log(request_id), starts)
    sub = await bench.hub.subscribe(request_id)
    sub.resync()
    got = await _take(sub.events(30), total + 1)
    await bench.hub.unsubscribe(sub)
    await _stop_reads(bench.admin, keys.log(request_id), monitor)
    assert [e.seq for e in got] == list(range(1, total + 2)) and isinstance(got[-1], DoneEvent)
    # Page by page, each read once: never the whole log at once.
    assert starts == [0, LOG_PAGE, 2 * LOG_PAGE]


async def test_a_reconnect_reads_only_what_the_stream_missed(bench: Bench) -> None:
    request_id = f"cmpl-{uuid.uuid4().hex}"
    sub = await bench.hub.subscribe(request_id)
    events = sub.events(30)
    await bench.publish(request_id, _deltas(request_id, 1, 300))
    assert [e.seq for e in await _take(events, 300)] == list(range(1, 301))

    starts: list[int] = []
    monitor = await _watch_reads(bench.admin, keys.log(request_id), starts)
    # Cut the hub's pub/sub connection (as a Redis restart or a network blip would), and publish while
    # it is down: those events reach the stream only through its log.
    clients = await bench.admin.client_list()
    pubsub = [c for c in clients if c.get("name") == bench.name and "P" in c.get("flags", "")]
    assert len(pubsub) == 1, clients
    await bench.admin.client_kill_filter(_id=pubsub[0]["id"])
    await bench.publish(request_id, [*_deltas(request_id, 301, 305), DoneEvent(request_id, 306, COMPLETED)])
    rest = await _take(events, 6)
    await _stop_reads(bench.admin, keys.log(request_id), monitor)
    assert [e.seq for e in rest] == list(range(301, 307)) and isinstance(rest[-1], DoneEvent)
    # The resync read from seq 301's place in the log on (index 300), not the 300 events it had.
    assert starts and min(starts) == 300, starts
    await bench.hub.unsubscribe(sub)


async def test_a_client_that_stops_reading_is_cut_off(redis_server: ServerProcess) -> None:
    bound = 8 * 1024
    bench = Bench(redis_server.url, buffer_bytes=bound)
    await bench.hub.start()
    try:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        sub: Subscription = await bench.hub.subscribe(request_id)
        overflowed: list[str] = []
        sub.on_overflow = lambda: overflowed.append(request_id)
        events = sub.events(30)
        await bench.publish(request_id, _deltas(request_id, 1, 1))
        assert [e.seq for e in await _take(events, 1)] == [1]  # one chunk read, then the client stalls
        peak = 0
        for first in range(2, 400, 20):
            await bench.publish(request_id, _deltas(request_id, first, first + 19))
            await asyncio.sleep(0.01)
            peak = max(peak, bench.hub.buffered_bytes)
        # The hub reads pub/sub at its own pace: wait until it has reached the bound (a loaded host's
        # reader may be behind the publishes above), not a fixed while.
        for _ in range(300):
            if overflowed:
                break
            await asyncio.sleep(0.05)
        # Never more than the bound held for it; once over, the buffer is dropped and the owner told.
        assert peak <= bound and bench.hub.buffered_bytes == 0
        assert overflowed == [request_id]
        with pytest.raises(StreamError) as cut:
            await anext(events)
        assert cut.value.code == "slow_reader"
        await bench.hub.unsubscribe(sub)
    finally:
        with contextlib.suppress(Exception):
            await bench.close()


async def test_a_stream_released_while_redis_is_down_is_not_subscribed_again(tmp_path: Path) -> None:
    """Its UNSUBSCRIBE fails against the stopped server; the client's reconnect subscribes every channel
    it still has again, and the hub must drop this one, or the subscription stays for good."""
    with start_redis(workdir=tmp_path / "redis") as server:
        client = aioredis.Redis.from_url(server.url, decode_responses=True)
        admin = aioredis.Redis.from_url(server.url, decode_responses=True)
        hub = Hub(client, Store(client), "streams-outage", 30.0)
        await hub.start()
        try:
            kept = await hub.subscribe("cmpl-kept")
            released = await hub.subscribe("cmpl-released")
            server.stop()
            await hub.unsubscribe(released)
            server.start()
            wanted = {f"{keys.PREFIX}:gateway:streams-outage", keys.events("cmpl-kept")}
            channels: set[str] = set()
            for _ in range(100):  # the reconnect, then the hub's answer to the resubscription
                channels = set(await admin.pubsub_channels())
                if channels == wanted:
                    break
                await asyncio.sleep(0.1)
            assert channels == wanted
            await hub.unsubscribe(kept)
        finally:
            await hub.stop()
            await client.aclose()
            await admin.aclose()


async def test_a_subscribe_that_races_the_readers_reconnect_is_tried_again(
    bench: Bench, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SUBSCRIBE that reconnects the pub/sub connection while the hub's reader reconnects it too reads
    the handshake beside it, and asyncio raises RuntimeError. The race cannot be set up on demand, so the
    connection's subscribe is made to raise that error (the real one, seen in a Redis restart) once: the
    subscription still completes and delivers; raised for good, it is a Redis error (503 at the edge)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    real = bench.hub._pubsub.subscribe
    raised: list[str] = []

    async def racing(*channels: str) -> Any:
        if not raised:
            raised.append(channels[0])
            raise RuntimeError("read() called while another coroutine is already waiting for incoming data")
        return await real(*channels)

    monkeypatch.setattr(bench.hub._pubsub, "subscribe", racing)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    sub = await bench.hub.subscribe(request_id)
    assert raised == [keys.events(request_id)]
    await bench.publish(request_id, _deltas(request_id, 1, 3))
    assert [e.seq for e in await _take(sub.events(30), 3)] == [1, 2, 3]
    await bench.hub.unsubscribe(sub)

    async def always(*channels: str) -> Any:
        raise RuntimeError("read() called while another coroutine is already waiting for incoming data")

    monkeypatch.setattr(bench.hub._pubsub, "subscribe", always)
    failed = f"cmpl-{uuid.uuid4().hex}"
    with pytest.raises(RedisConnectionError):
        await bench.hub.subscribe(failed, timeout_s=0.3)
    assert keys.events(failed) not in bench.hub._subs  # nothing held for it
