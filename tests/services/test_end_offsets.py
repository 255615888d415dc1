"""An end offset that lags a record batch is not a lost log (gateway requeue, worker commit).

tansu answers ListOffsets with the base offset of the partition's last record batch plus one, so a
message produced in one batch behind another looks past the end. Before the log was read to confirm,
the worker refused to commit past such a message ("the broker lost its log") and the gateway produced
a queued request again. A real broker restart (an empty log) must still be caught.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.structs import TopicPartition

from harness.servers import ServerProcess, start_kafka
from harness.stack import TANSU_FETCH_WAIT_MS
from services.common.kafka import log_holds, make_consumer, make_probe
from services.common.settings import Settings
from services.worker.commits import Committer
from services.worker.offsets import OffsetTracker

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def broker(tmp_path: Path) -> ServerProcess:
    with start_kafka(workdir=tmp_path / "kafka") as server:
        yield server


async def _batch(producer: AIOKafkaProducer, topic: str, keys: list[bytes]) -> list[int]:
    """Send the messages together, so the client packs them into one record batch."""
    futures = [await producer.send(topic, b"{}", key=key, partition=0) for key in keys]
    return [(await f).offset for f in futures]


async def test_a_message_behind_a_batch_is_still_in_the_log(broker: ServerProcess) -> None:
    settings = Settings(kafka_bootstrap=broker.address, kafka_fetch_max_wait_ms=TANSU_FETCH_WAIT_MS)
    tp = TopicPartition("batches", 0)
    producer = AIOKafkaProducer(bootstrap_servers=broker.address, enable_idempotence=False)
    probe = make_probe(settings)
    await producer.start()
    await probe.start()
    try:
        offsets = await _batch(producer, tp.topic, [b"a", b"b", b"c"])
        end = (await probe.end_offsets([tp]))[tp]
        # What made both checks misfire: the broker's end is not past every message it holds.
        assert end <= offsets[-1]
        assert all(
            [await log_holds(probe, tp, o, k) for o, k in zip(offsets, [b"a", b"b", b"c"], strict=True)]
        )
        assert not await log_holds(probe, tp, offsets[-1], b"another request")
        assert not await log_holds(probe, tp, offsets[-1] + 5, None, timeout_s=0.5)
    finally:
        await producer.stop()
        await probe.stop()


async def test_the_worker_commits_past_a_batch_but_not_past_a_lost_log(broker: ServerProcess) -> None:
    settings = Settings(
        kafka_bootstrap=broker.address,
        kafka_fetch_max_wait_ms=TANSU_FETCH_WAIT_MS,
        kafka_consumer_group="commits",
    )
    tp = TopicPartition("commits", 0)
    producer = AIOKafkaProducer(bootstrap_servers=broker.address, enable_idempotence=False)
    await producer.start()
    offsets = await _batch(producer, tp.topic, [b"r1", b"r2", b"r3"])
    consumer = make_consumer(settings)
    consumer.assign([tp])
    await consumer.start()
    tracker = OffsetTracker()
    committer = Committer(tracker, lambda: make_probe(settings))
    committer.consumer = consumer
    try:
        seen = 0
        while seen < 3:
            for record in (await consumer.getmany(tp, timeout_ms=1000)).get(tp, []):
                tracker.done(tp, record.offset, tracker.add(tp, record.offset, record.key))
                seen += 1
        await committer.commit_now()
        assert await consumer.committed(tp) == offsets[-1] + 1  # committed, not taken for a lost log

        await _batch(producer, tp.topic, [b"r4"])
        record = (await consumer.getmany(tp, timeout_ms=2000))[tp][0]
        tracker.done(tp, record.offset, tracker.add(tp, record.offset, record.key))
        broker.restart()  # tansu keeps its log in memory: the restart loses it
        await asyncio.sleep(1.0)
        await committer.commit_now()
        assert tracker.last_finished(tp) is None  # forgotten: its offsets belong to a log that is gone
    finally:
        await committer.close()
        await consumer.stop()
        await producer.stop()


async def test_a_stopped_consumer_ends_the_fetch_task_instead_of_failing(broker: ServerProcess) -> None:
    """A drain (or a dead engine) stops the consumer; the fetch loop then ends (it is not a failure for
    the supervisor to restart and log as an error)."""
    from services.worker.intake import Intake

    settings = Settings(
        kafka_bootstrap=broker.address,
        kafka_fetch_max_wait_ms=TANSU_FETCH_WAIT_MS,
        kafka_consumer_group="stopped",
    )
    consumer = make_consumer(settings)
    await consumer.start()
    await consumer.stop()
    intake = Intake(settings, None, None, OffsetTracker(), {}, lambda run: None, lambda coro: None)  # type: ignore[arg-type]
    intake.stopped = True  # draining: room() is not asked
    await asyncio.wait_for(intake.fetch_forever(consumer), 10)
