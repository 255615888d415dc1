"""A request the message broker refuses for its size is a 413 at once, not retried into a 503.

Apache Kafka refuses a message over the topic's ``max.message.bytes`` with MESSAGE_TOO_LARGE; aiokafka
raises the same ``MessageSizeTooLargeError`` when a message exceeds the producer's own limit. The test
broker (tansu) enforces no topic limit, so here the producer's limit is the smaller one: the gateway's
dispatcher, on the real broker and Redis, with a producer that takes 1 MiB while the body limit allows 4.
"""

from __future__ import annotations

import time
import uuid

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from harness.servers import ServerProcess
from services.common import keys
from services.common.kafka import client_kwargs, ensure_topic
from services.common.settings import Settings
from services.common.store import Store
from services.common.wire import RequestMessage
from services.common.wire_sampling import WireSampling
from services.gateway.dispatch import Dispatcher
from services.gateway.errors import APIError
from services.gateway.token_streams import Hub
from tests.services.stack import REDIS_PASSWORD

pytestmark = pytest.mark.timeout(60)


async def test_a_message_the_broker_refuses_is_413(kafka: ServerProcess, redis_server: ServerProcess) -> None:
    settings = Settings(
        kafka_bootstrap=kafka.address,
        kafka_topic=f"inflight.limits.{uuid.uuid4().hex[:8]}",
        kafka_idempotence=False,
        kafka_partitions=1,
        redis_url=redis_server.url,
        redis_password=REDIS_PASSWORD,
        kafka_produce_timeout_s=20.0,
    )
    client = aioredis.Redis.from_url(redis_server.url, password=REDIS_PASSWORD, decode_responses=True)
    store = Store(client)
    hub = Hub(client, store, "broker-limits", 30.0)
    dispatcher = Dispatcher(settings, store, hub)
    await ensure_topic(settings)
    await hub.start()
    await dispatcher.start()
    await dispatcher.producer.stop()
    dispatcher.producer = AIOKafkaProducer(**client_kwargs(settings), max_request_size=1024 * 1024)
    await dispatcher.producer.start()
    try:
        msg = RequestMessage(
            id=f"cmpl-{uuid.uuid4().hex}",
            kind="completion",
            model="tiny",
            prompt_token_ids=[],
            params=WireSampling(max_tokens=1),
            created=time.time(),
            prompt="word " * (2 * 1024 * 1024 // 5),  # 2 MiB: within the body limit, over the broker's
        )
        started = time.monotonic()
        with pytest.raises(APIError) as refused:
            await dispatcher.submit(msg, b"key", [], {"kind": "completion"}, subscribe=True)
        assert refused.value.status == 413 and refused.value.code == "request_too_large"
        # At once, not after retrying for the produce timeout; and nothing left behind: no reservation in
        # the pending set, no subscription, the record failed (a late copy of the message is skipped).
        assert time.monotonic() - started < settings.kafka_produce_timeout_s / 2
        assert await client.zscore(keys.PENDING, msg.id) is None
        assert hub.num_streams == 0
        assert await client.hget(keys.record(msg.id), "status") == "failed"
    finally:
        await dispatcher.stop()
        await hub.stop()
        await client.aclose()
