"""The Redis protocol (Lua scripts) against a real Redis: admission, leases, fencing, cancellation."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from harness.servers import ServerProcess, start_redis
from services.common import keys
from services.common.settings import Settings
from services.common.store import Store, connect_redis
from services.common.wire import DeltaEvent, DoneEvent, decode_event, encode_event

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with start_redis(workdir=tmp_path_factory.mktemp("store-redis")) as server:
        yield server


@pytest.fixture
async def store(own_redis: ServerProcess) -> AsyncIterator[Store]:
    client = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    await client.flushall()
    yield Store(client)
    await client.aclose()


def _rid() -> str:
    return f"cmpl-{uuid.uuid4().hex[:8]}"


async def _admit(store: Store, request_id: str, max_pending: int, ttl_s: float) -> bool:
    """The gateway's admission: the pending reservation and the queued record in one round trip."""
    return await store.admit_and_record(request_id, max_pending, ttl_s, {"kind": "completion"}, 60)


async def test_admission_is_bounded_and_self_heals(store: Store) -> None:
    ids = [_rid() for _ in range(4)]
    assert [await _admit(store, i, 3, ttl_s=30) for i in ids] == [True, True, True, False]
    await store.start(ids[0], "w1", lease_s=5, seed=1, ttl_s=60)  # a worker took one: room for one more
    assert await _admit(store, ids[3], 3, ttl_s=30)
    # Reservations that nobody refreshes (their gateway died) expire and free the bound.
    assert await _admit(store, _rid(), 10, ttl_s=0.2)
    assert await store.num_pending() == 4
    await asyncio.sleep(0.3)
    assert await store.num_pending() == 3
    assert await store.refresh_pending([ids[1], ids[0]], ttl_s=30) == {ids[1]}


async def test_start_claims_once_and_resumes_from_the_log(store: Store) -> None:
    rid = _rid()
    await store.create_record(rid, {"kind": "completion"}, ttl_s=60)
    first = await store.start(rid, "w1", lease_s=5, seed=42, ttl_s=60)
    assert (first.outcome, first.seed, first.epoch, first.events) == ("ok", 42, 1, [])
    # Another worker sees the live lease and must not run it.
    busy = await store.start(rid, "w2", lease_s=5, seed=7, ttl_s=60)
    assert (busy.outcome, busy.status) == ("busy", "w1")
    delta = DeltaEvent(rid, 1, 0, [5, 6], "ab", worker="w1")
    call = store.publish_call(rid, "w1", 5, 60, [encode_event(delta)], epoch=first.epoch)
    assert await store.eval_many([call]) == [1]
    # w1 dies: its lease lapses and w2 resumes with the seed fixed at first claim and the log so far.
    await store.client.delete(keys.owner(rid))
    resumed = await store.start(rid, "w2", lease_s=5, seed=7, ttl_s=60)
    assert (resumed.outcome, resumed.seed, resumed.epoch, resumed.events) == ("ok", 42, 2, [delta])
    # A fenced-off worker cannot add events any more.
    late_event = encode_event(DeltaEvent(rid, 2, 0, [9], "c"))
    late = store.publish_call(rid, "w1", 5, 60, [late_event], epoch=first.epoch)
    assert await store.eval_many([late]) == [0]
    assert await store.read_log(rid) == [delta]


async def test_finish_is_atomic_and_terminal(store: Store) -> None:
    rid = _rid()
    await store.create_record(rid, {"kind": "chat"}, ttl_s=60)
    claim = await store.start(rid, "w1", lease_s=5, seed=1, ttl_s=60)
    done = DoneEvent(rid, 1, "completed", prompt_tokens=3, completion_tokens=0)
    call = store.publish_call(
        rid, "w1", 5, 60, [encode_event(done)], epoch=claim.epoch, final=True, fields={"status": "completed"}
    )
    assert await store.eval_many([call]) == [1]
    record = await store.get_record(rid)
    assert record is not None and record["status"] == "completed"
    assert await store.owner(rid) is None
    # A redelivered copy is never run again.
    again = await store.start(rid, "w2", lease_s=5, seed=1, ttl_s=60)
    assert (again.outcome, again.status) == ("terminal", "completed")


async def test_cancel_queued_running_and_finished(store: Store) -> None:
    queued, running = _rid(), _rid()
    for rid in (queued, running):
        await store.create_record(rid, {"kind": "completion"}, ttl_s=60)
        assert await _admit(store, rid, 10, ttl_s=30)
    pubsub = store.client.pubsub()
    await pubsub.subscribe(keys.CANCEL_CHANNEL, keys.events(queued))
    # Still in Kafka: cancelled at once, with its terminal event; the worker will skip it.
    assert await store.cancel(queued, 60) == "cancelled"
    assert [e.status for e in await store.read_log(queued) if isinstance(e, DoneEvent)] == ["cancelled"]
    assert (await store.start(queued, "w", 5, 1, 60)).outcome == "terminal"
    # Running: the workers are told on the cancel channel, and a worker claiming it later sees the flag.
    await store.start(running, "w", 5, 1, 60)
    assert await store.cancel(running, 60) == "cancelling"
    assert await store.is_cancelled(running)
    assert await store.num_pending() == 0
    got = []
    for _ in range(20):
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if message:
            got.append((message["channel"], message["data"]))
        if len(got) == 2:
            break
    assert decode_event(got[0][1]).status == "cancelled"  # type: ignore[union-attr]
    assert got[1] == (keys.CANCEL_CHANNEL, f'{{"v": 1, "type": "cancel", "id": "{running}"}}')
    assert await store.cancel(queued, 60) == "cancelled"  # finished: unchanged
    assert await store.cancel(_rid(), 60) == "unknown"
    await pubsub.aclose()


async def test_fail_queued_only_before_a_worker_starts(store: Store) -> None:
    lost, started = _rid(), _rid()
    for rid in (lost, started):
        await store.create_record(rid, {"kind": "completion"}, ttl_s=60)
    await store.start(started, "w", 5, 1, 60)
    assert await store.fail_queued(lost, "gone", "lost_by_broker")
    assert not await store.fail_queued(started, "gone", "lost_by_broker")
    (done,) = await store.read_log(lost)
    assert isinstance(done, DoneEvent) and (done.status, done.code) == ("failed", "lost_by_broker")
    assert (await store.get_record(lost) or {})["code"] == "lost_by_broker"  # the record says it too


async def test_status_writes_are_fenced(store: Store) -> None:
    """The gateway's own record writes: never over a terminal status, never creating a record (a key
    without a TTL), and a record found without a TTL gets its own back."""
    queued, finished, cancelled, missing, bare = (_rid() for _ in range(5))
    for rid in (queued, finished, cancelled):
        await store.create_record(rid, {"kind": "completion"}, ttl_s=60)
    await store.start(finished, "w", 5, 1, 60)
    call = store.publish_call(finished, "w", 5, 60, [], epoch=1, final=True, fields={"status": "completed"})
    assert await store.eval_many([call]) == [1]
    assert await store.cancel(cancelled, 60) == "cancelled"

    assert await store.set_fields(queued, {"status": "failed", "error": "never enqueued"})
    record = await store.get_record(queued) or {}
    assert (record["status"], record["error"]) == ("failed", "never enqueued")
    assert 0 < await store.client.ttl(keys.record(queued)) <= 60
    for rid, status in ((finished, "completed"), (cancelled, "cancelled"), (queued, "failed")):
        assert not await store.set_fields(rid, {"status": "failed", "error": "late"})
        record = await store.get_record(rid) or {}
        assert record["status"] == status and record.get("error") != "late", rid
    assert not await store.set_fields(missing, {"status": "failed"})
    assert not await store.client.exists(keys.record(missing))
    # A record without a TTL (written by hand, or by an older gateway): the write restores its own.
    await store.client.hset(keys.record(bare), mapping={"status": "queued", "ttl": 120})
    assert await store.client.ttl(keys.record(bare)) == -1
    assert await store.set_fields(bare, {"error": "x"}, default_ttl_s=30)
    assert 30 < await store.client.ttl(keys.record(bare)) <= 120  # its own, not the default


async def test_scripts_survive_a_script_flush(store: Store) -> None:
    # A restarted Redis has no scripts cached: the store reloads them transparently.
    assert await _admit(store, _rid(), 5, 30)
    await store.client.script_flush()
    assert await _admit(store, _rid(), 5, 30)


async def test_a_burst_past_the_pool_waits_its_turn(own_redis: ServerProcess) -> None:
    """More concurrent commands than the pool has connections queue for one; none fails. redis-py's
    default pool raised at its 100th concurrent command, and the gateway answered that burst with 503s
    while Redis was healthy."""
    client = connect_redis(Settings(redis_url=own_redis.url, redis_max_connections=4))
    checker = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    try:
        await checker.flushall()
        store = Store(client)
        ids = [_rid() for _ in range(150)]
        admitted = await asyncio.gather(*(_admit(store, i, 1000, ttl_s=30) for i in ids))
        assert admitted == [True] * 150
        assert await store.num_pending() == 150
        me = await checker.client_id()
        others = [c for c in await checker.client_list() if int(c["id"]) != me]
        assert 1 <= len(others) <= 4, others
    finally:
        await client.aclose()
        await checker.aclose()


async def test_update_existing_never_recreates_a_hash(store: Store) -> None:
    """A batch record's progress writes: into the record while it lives (its TTL kept), never re-creating
    one that expired (it would have no TTL and live for good)."""
    await store.client.hset("inflight:batch:live", mapping={"status": "in_progress"})
    await store.client.expire("inflight:batch:live", 60)
    assert await store.update_existing("inflight:batch:live", {"cursor": 3, "status": "cancelling"})
    assert await store.client.hgetall("inflight:batch:live") == {"status": "cancelling", "cursor": "3"}
    assert 0 < await store.client.ttl("inflight:batch:live") <= 60
    assert not await store.update_existing("inflight:batch:gone", {"cursor": 3})
    assert not await store.client.exists("inflight:batch:gone")
    # In a transaction beside other writes, as the batch's submit round does.
    pipe = store.client.pipeline(transaction=True)
    script, keys_, args = store.update_existing_call("inflight:batch:gone", {"cursor": 4})
    pipe.eval(script, len(keys_), *keys_, *args)
    assert await pipe.execute() == [0]
    assert not await store.client.exists("inflight:batch:gone")
