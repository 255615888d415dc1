"""The request topic is created with the configured partitions, and an existing one is left as it is.

On the real broker (tansu, whose metadata requests auto-create a missing topic with its own partition
count): describing a missing topic first would create it with the broker's count instead of
``INFLIGHT_KAFKA_PARTITIONS``.
"""

from __future__ import annotations

import dataclasses
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from harness.servers import ServerProcess
from services.common.kafka import client_kwargs, ensure_topic, make_admin
from services.common.settings import Settings

pytestmark = pytest.mark.timeout(60)


async def _partitions(settings: Settings) -> int:
    admin = make_admin(settings)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([settings.kafka_topic])
        return len(described["partitions"])
    finally:
        await admin.close()


async def test_a_missing_topic_gets_the_configured_partitions(kafka: ServerProcess) -> None:
    for partitions in (1, 3):
        settings = Settings(
            kafka_bootstrap=kafka.address,
            kafka_topic=f"inflight.topic-setup.{uuid.uuid4().hex[:8]}",
            kafka_partitions=partitions,
        )
        await ensure_topic(settings)
        assert await _partitions(settings) == partitions
        await ensure_topic(settings)  # a second replica starting: nothing changes
        assert await _partitions(settings) == partitions


async def test_an_existing_topic_keeps_its_partitions_and_messages(kafka: ServerProcess) -> None:
    settings = Settings(
        kafka_bootstrap=kafka.address,
        kafka_topic=f"inflight.topic-setup.{uuid.uuid4().hex[:8]}",
        kafka_partitions=2,
    )
    await ensure_topic(settings)
    producer = AIOKafkaProducer(**client_kwargs(settings))
    await producer.start()
    try:
        await producer.send_and_wait(settings.kafka_topic, b"kept", partition=1)
    finally:
        await producer.stop()
    await ensure_topic(dataclasses.replace(settings, kafka_partitions=5))  # another count: ignored
    assert await _partitions(settings) == 2
    consumer = AIOKafkaConsumer(
        settings.kafka_topic,
        **client_kwargs(settings),
        group_id=f"topic-setup-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        batch = await consumer.getmany(timeout_ms=5000)
    finally:
        await consumer.stop()
    assert [r.value for records in batch.values() for r in records] == [b"kept"]
