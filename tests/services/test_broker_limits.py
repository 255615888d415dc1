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
from aiokafka import AIOKafkaProducer

from harness.servers import ServerProcess
from services.common import keys
from services.common.kafka import client_kwargs
from services.common.wire import RequestMessage
from services.common.wire_sampling import WireSampling
from services.gateway.errors import APIError
from tests.services.dispatch_parts import dispatcher_parts

pytestmark = pytest.mark.timeout(60)


async def test_a_message_the_broker_refuses_is_413(kafka: ServerProcess, redis_server: ServerProcess) -> None:
    async with dispatcher_parts(kafka, redis_server, "limits", kafka_produce_timeout_s=20.0) as parts:
        client, hub, dispatcher = parts
        settings = dispatcher.settings
        await dispatcher.producer.stop()
        dispatcher.producer = AIOKafkaProducer(**client_kwargs(settings), max_request_size=1024 * 1024)
        await dispatcher.producer.start()
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
