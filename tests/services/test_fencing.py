"""Fencing in the Redis scripts, against a real Redis: a worker whose lease lapsed never writes again once
another claimed the request or it is terminal, and the log holds exactly one terminal event.

The lapse is made the way it happens (the owner key expires), by deleting the key: no clock involved.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest
import redis.asyncio as aioredis

from services.common import keys
from services.common.store import REDIS_ERRORS, Store
from services.common.wire import DeltaEvent, DoneEvent, Event, decode_event, encode_event
from services.gateway.token_streams import Hub
from tests.services.stack import REDIS_PASSWORD

if TYPE_CHECKING:
    from harness.servers import ServerProcess

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def store(redis_server: ServerProcess) -> AsyncIterator[Store]:
    client = aioredis.Redis.from_url(redis_server.url, password=REDIS_PASSWORD, decode_responses=True)
    yield Store(client)
    await client.aclose()


async def _request(store: Store) -> str:
    rid = f"cmpl-{uuid.uuid4().hex[:10]}"
    await store.create_record(rid, {"kind": "completion"}, ttl_s=60)
    return rid


async def _publish(
    store: Store, rid: str, worker: str, epoch: int, events: list[Event], final: bool = False
) -> int:
    fields = {"status": "completed", "worker": worker} if final else None
    encoded = [encode_event(e) for e in events]
    call = store.publish_call(rid, worker, 5, 60, encoded, epoch=epoch, final=final, fields=fields)
    (ok,) = await store.eval_many([call])
    return int(ok)


def _done(rid: str, seq: int, worker: str) -> DoneEvent:
    return DoneEvent(rid, seq, "completed", prompt_tokens=5, completion_tokens=seq - 1, worker=worker)


async def test_a_lapsed_worker_cannot_write_after_another_finished(store: Store) -> None:
    rid = await _request(store)
    first = await store.start(rid, "w1", lease_s=5, seed=1, ttl_s=60)
    assert await _publish(store, rid, "w1", first.epoch, [DeltaEvent(rid, 1, 0, [7], "a", worker="w1")]) == 1
    await store.client.delete(keys.owner(rid))  # w1 stalls (a long GC, a partition): its lease lapses
    second = await store.start(rid, "w2", lease_s=5, seed=1, ttl_s=60)
    assert (second.outcome, second.epoch) == ("ok", first.epoch + 1)
    tail: list[Event] = [DeltaEvent(rid, 2, 0, [8], "b", worker="w2"), _done(rid, 3, "w2")]
    assert await _publish(store, rid, "w2", second.epoch, tail, final=True) == 1
    record, log = await store.get_record(rid), await store.client.lrange(keys.log(rid), 0, -1)
    assert record is not None and record["status"] == "completed" and await store.owner(rid) is None

    # w1 wakes up and carries on as if it still held the request: no lease anywhere, so before fencing
    # it would have taken the lease back, logged its events after the done event and overwritten the
    # record. Every one of its writes is refused now.
    stale: list[Event] = [DeltaEvent(rid, 2, 0, [9], "c", worker="w1"), _done(rid, 3, "w1")]
    assert await _publish(store, rid, "w1", first.epoch, stale[:1]) == 0
    assert await _publish(store, rid, "w1", first.epoch, stale, final=True) == 0
    assert await store.refresh_leases([(rid, first.epoch)], "w1", 5) == {rid}
    await store.release(rid, "w1", first.epoch)
    assert await store.get_record(rid) == record
    assert await store.client.lrange(keys.log(rid), 0, -1) == log
    assert await store.owner(rid) is None
    # Even the finisher cannot write after the end: its lease keeper learns the request is done.
    assert await _publish(store, rid, "w2", second.epoch, [DeltaEvent(rid, 4, 0, [1], "x")]) == 0
    assert await store.refresh_leases([(rid, second.epoch)], "w2", 5) == {rid}
    assert await store.owner(rid) is None
    events = await store.read_log(rid)
    assert [type(e).__name__ for e in events] == ["DeltaEvent", "DeltaEvent", "DoneEvent"]
    assert [e.seq for e in events] == [1, 2, 3] and events[-1].worker == "w2"


async def test_the_epoch_fences_a_worker_after_the_next_lease_lapses_too(store: Store) -> None:
    """Both leases gone (w2 stalls as well): the owner key says nothing any more, the epoch still does."""
    rid = await _request(store)
    first = await store.start(rid, "w1", lease_s=5, seed=1, ttl_s=60)
    await store.client.delete(keys.owner(rid))
    second = await store.start(rid, "w2", lease_s=5, seed=1, ttl_s=60)
    assert await _publish(store, rid, "w2", second.epoch, [DeltaEvent(rid, 1, 0, [8], "b", worker="w2")]) == 1
    await store.client.delete(keys.owner(rid))
    assert await store.refresh_leases([(rid, first.epoch)], "w1", 5) == {rid}
    assert await _publish(store, rid, "w1", first.epoch, [DeltaEvent(rid, 1, 0, [9], "c")]) == 0
    assert await store.owner(rid) is None
    # The current claim takes its lapsed lease back (an outage longer than the lease) and carries on.
    assert await store.refresh_leases([(rid, second.epoch)], "w2", 5) == set()
    assert await store.owner(rid) == "w2"
    assert [e.worker for e in await store.read_log(rid)] == ["w2"]


async def test_a_finish_run_twice_logs_one_terminal_event(store: Store) -> None:
    """The same final call again (a pipelined batch rerun after NOSCRIPT) succeeds and writes nothing."""
    rid = await _request(store)
    claim = await store.start(rid, "w1", lease_s=5, seed=1, ttl_s=60)
    for _ in range(2):
        assert await _publish(store, rid, "w1", claim.epoch, [_done(rid, 1, "w1")], final=True) == 1
    assert [type(e).__name__ for e in await store.read_log(rid)] == ["DoneEvent"]
    # A redelivery is never claimed (no new epoch, no lease).
    again = await store.start(rid, "w2", lease_s=5, seed=1, ttl_s=60)
    assert (again.outcome, again.status) == ("terminal", "completed")
    record = await store.get_record(rid)
    assert record is not None and record["epoch"] == str(claim.epoch)


async def test_readers_see_exactly_one_terminal_event(store: Store) -> None:
    """The gateway's reader and a raw subscriber of the channel, while a stale worker keeps publishing."""
    rid = await _request(store)
    hub = Hub(store.client, store, f"test-{uuid.uuid4().hex[:6]}", outage_budget_s=30)
    await hub.start()
    raw = store.client.pubsub()
    await raw.subscribe(keys.events(rid))
    confirmed = await raw.get_message(timeout=5)  # subscribed before anything is published
    assert confirmed is not None and confirmed["type"] == "subscribe"
    try:
        sub = await hub.subscribe(rid)
        first = await store.start(rid, "w1", lease_s=5, seed=1, ttl_s=60)
        await store.client.delete(keys.owner(rid))
        second = await store.start(rid, "w2", lease_s=5, seed=1, ttl_s=60)
        assert await _publish(store, rid, "w2", second.epoch, [_done(rid, 1, "w2")], final=True) == 1
        # The stale worker's own ending, with a higher seq than the real one: it would reach readers as
        # a second terminal event if the script let it through.
        late: list[Event] = [DeltaEvent(rid, 1, 0, [9], "c", worker="w1"), _done(rid, 2, "w1")]
        assert await _publish(store, rid, "w1", first.epoch, late, final=True) == 0

        read = [e async for e in sub.events(idle_timeout_s=10) if e is not None]
        assert [(type(e).__name__, e.worker) for e in read] == [("DoneEvent", "w2")]
        heard: list[Event] = []
        while (message := await raw.get_message(ignore_subscribe_messages=True, timeout=0.5)) is not None:
            heard.append(decode_event(message["data"]))
        assert [(type(e).__name__, e.seq, e.worker) for e in heard] == [("DoneEvent", 1, "w2")]
        assert [e.worker for e in await store.read_log(rid)] == ["w2"]
    finally:
        await raw.aclose()
        await hub.stop()


async def test_an_oom_refusal_writes_nothing(own_servers: tuple[ServerProcess, ServerProcess]) -> None:
    """Redis over maxmemory refuses every script's first write; the scripts read first, so nothing is half
    written, and the error is one the services treat as an outage (REDIS_ERRORS)."""
    _, redis_proc = own_servers
    client = aioredis.Redis.from_url(redis_proc.url, password=REDIS_PASSWORD, decode_responses=True)
    store = Store(client)
    try:
        rid, fresh = await _request(store), await _request(store)
        claim = await store.start(rid, "w1", lease_s=5, seed=1, ttl_s=60)
        await _publish(store, rid, "w1", claim.epoch, [DeltaEvent(rid, 1, 0, [7], "a", worker="w1")])
        before = {k: await client.dump(k) for k in sorted(await client.keys("*"))}
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", "1")
        attempts = [
            store.start(fresh, "w1", lease_s=5, seed=1, ttl_s=60),
            _publish(store, rid, "w1", claim.epoch, [_done(rid, 2, "w1")], final=True),
            store.refresh_leases([(rid, claim.epoch)], "w1", 5),
            store.cancel(fresh, 60),
        ]
        for attempt in attempts:
            with pytest.raises(REDIS_ERRORS) as caught:
                await attempt
            assert "OOM" in repr(caught.value) or "maxmemory" in str(caught.value)
        await client.config_set("maxmemory", "0")
        assert {k: await client.dump(k) for k in sorted(await client.keys("*"))} == before
        # Recovered: the same claim finishes where it was.
        assert await _publish(store, rid, "w1", claim.epoch, [_done(rid, 2, "w1")], final=True) == 1
        assert [e.seq for e in await store.read_log(rid)] == [1, 2]
    finally:
        await client.aclose()
