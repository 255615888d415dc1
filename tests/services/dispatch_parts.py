"""A gateway's dispatcher and token hub on the real broker and Redis, without the HTTP app around them."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis

from harness.servers import ServerProcess
from harness.stack import TANSU_FETCH_WAIT_MS
from services.common.kafka import ensure_topic
from services.common.settings import Settings
from services.common.store import Store
from services.gateway.dispatch import Dispatcher
from services.gateway.token_streams import Hub
from tests.services.stack import REDIS_PASSWORD


@contextlib.asynccontextmanager
async def dispatcher_parts(
    kafka: ServerProcess, redis_server: ServerProcess, name: str, **settings: Any
) -> AsyncIterator[tuple[aioredis.Redis, Hub, Dispatcher]]:
    """A started hub and dispatcher on a topic of their own (``settings`` on top of the defaults)."""
    config = Settings(
        kafka_bootstrap=kafka.address,
        kafka_topic=f"inflight.{name}.{uuid.uuid4().hex[:8]}",
        kafka_idempotence=False,
        kafka_partitions=1,
        kafka_fetch_max_wait_ms=TANSU_FETCH_WAIT_MS,
        redis_url=redis_server.url,
        redis_password=REDIS_PASSWORD,
        **settings,
    )
    client = aioredis.Redis.from_url(redis_server.url, password=REDIS_PASSWORD, decode_responses=True)
    store = Store(client)
    hub = Hub(client, store, f"{name}-{uuid.uuid4().hex[:6]}", 30.0)
    dispatcher = Dispatcher(config, store, hub)
    await ensure_topic(config)
    await hub.start()
    await dispatcher.start()
    try:
        yield client, hub, dispatcher
    finally:
        await dispatcher.stop()
        await hub.stop()
        await client.aclose()
