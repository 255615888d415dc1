"""A request whose admission fails after its subscription completed leaves no subscription behind.

The gateway subscribes to a request's token channel and admits it (a Redis round trip each) at once.
When the admission fails, or the route is cancelled while it waits, the subscription that finished
beside it must be released: otherwise the gateway's hub keeps the channel subscribed for as long as it
lives. On the real broker and Redis; the admission is wrapped to fail once the subscription is confirmed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from harness.servers import ServerProcess
from services.common import keys
from services.common.wire import RequestMessage
from services.common.wire_sampling import WireSampling
from services.gateway.dispatch import Dispatcher
from services.gateway.token_streams import Hub
from tests.services.dispatch_parts import dispatcher_parts

pytestmark = pytest.mark.timeout(60)


class Parts:
    def __init__(self, client: aioredis.Redis, hub: Hub, dispatcher: Dispatcher) -> None:
        self.client, self.hub, self.dispatcher = client, hub, dispatcher

    async def subscribed(self, request_id: str) -> None:
        """Wait until Redis counts a subscriber on the request's channel."""
        channel = keys.events(request_id)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if dict(await self.client.pubsub_numsub(channel)).get(channel, 0):
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the subscription never reached Redis")

    async def channels_left(self, request_id: str) -> int:
        channel = keys.events(request_id)
        return int(dict(await self.client.pubsub_numsub(channel)).get(channel, 0))


@pytest.fixture
async def parts(kafka: ServerProcess, redis_server: ServerProcess) -> AsyncIterator[Parts]:
    async with dispatcher_parts(kafka, redis_server, "abandon") as (client, hub, dispatcher):
        yield Parts(client, hub, dispatcher)


def _message() -> RequestMessage:
    return RequestMessage(
        id=f"cmpl-{uuid.uuid4().hex}",
        kind="completion",
        model="tiny",
        prompt_token_ids=[1, 2, 3],
        params=WireSampling(max_tokens=1),
        created=time.time(),
    )


async def test_a_failed_admission_releases_the_subscription_made_beside_it(parts: Parts) -> None:
    msg = _message()
    admit = parts.dispatcher.store.admit_and_record

    async def admit_then_fail(*args: Any, **kwargs: Any) -> bool:
        await parts.subscribed(msg.id)  # the subscription finished first
        await admit(*args, **kwargs)
        raise RedisConnectionError("Redis went away mid-admission")

    parts.dispatcher.store.admit_and_record = admit_then_fail  # type: ignore[method-assign]
    with pytest.raises(RedisConnectionError):
        await parts.dispatcher.submit(msg, b"key", [], {"kind": "completion"}, subscribe=True)
    assert parts.hub.num_streams == 0
    assert await parts.channels_left(msg.id) == 0
    assert await parts.client.zscore(keys.PENDING, msg.id) is None


async def test_a_route_cancelled_during_admission_releases_its_subscription(parts: Parts) -> None:
    msg = _message()
    held = asyncio.Event()

    async def admit_forever(*args: Any, **kwargs: Any) -> bool:
        await parts.subscribed(msg.id)
        held.set()
        await asyncio.Event().wait()  # the client leaves while this waits
        return True

    parts.dispatcher.store.admit_and_record = admit_forever  # type: ignore[method-assign]
    route = asyncio.ensure_future(
        parts.dispatcher.submit(msg, b"key", [], {"kind": "completion"}, subscribe=True)
    )
    await asyncio.wait_for(held.wait(), 10)
    route.cancel()
    with pytest.raises(asyncio.CancelledError):
        await route
    assert parts.hub.num_streams == 0
    assert await parts.channels_left(msg.id) == 0
