"""Which workers consume a topic, as the gateways' /readyz reports it.

A worker with partitions of the topic assigned (and not draining) beats every second into the sorted
set ``keys.workers(topic)``: its id, scored with the time its beat expires. A gateway counts the
members whose beat has not expired. Redis, not the broker's group membership: every broker the stack
runs on answers this the same way (the tansu test broker does not describe groups), and a worker
whose engine died stops beating at once (the task stops with its consumer) rather than when the group
notices its session lapsed.

    ZADD inflight:workers:inflight.requests  <now + 5000 ms>  worker-a
    ZCOUNT inflight:workers:inflight.requests  <now>  +inf        -> 1 (worker-a beat in the last 5 s)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from services.common import keys
from services.common.store import REDIS_ERRORS

BEAT_S = 1.0
BEAT_TTL_S = 5.0  # a few missed beats (a busy host) before a worker stops counting


async def beat_forever(
    client: aioredis.Redis, topic: str, worker_id: str, consuming: Callable[[], bool]
) -> None:
    """The worker's side: a beat every BEAT_S while ``consuming()``, its entry removed when not."""
    name = keys.workers(topic)
    while True:
        with contextlib.suppress(*REDIS_ERRORS):
            now_ms = int(time.time() * 1000)
            pipe = client.pipeline(transaction=False)
            if consuming():
                pipe.zadd(name, {worker_id: now_ms + int(BEAT_TTL_S * 1000)})
            else:
                pipe.zrem(name, worker_id)
            pipe.zremrangebyscore(name, "-inf", now_ms)  # the beats of workers gone for good
            pipe.expire(name, int(BEAT_TTL_S) + 1)  # the set outlives its last worker by seconds only
            await pipe.execute()
        await asyncio.sleep(BEAT_S)


async def num_consuming(client: aioredis.Redis, topic: str) -> int:
    """The gateway's side: workers whose last beat has not expired."""
    return int(await client.zcount(keys.workers(topic), int(time.time() * 1000), "+inf"))
