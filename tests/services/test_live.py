"""The live view's feed: a real engine's steps, compacted by the worker's publisher, through a real Redis."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from engine import LLM, SamplingParams
from harness.servers import ServerProcess
from services.common.live_wire import LIVE_CHANNEL, LiveSteps, short_id
from services.worker.live_publisher import LivePublisher, stop
from tests.services.stack import REDIS_PASSWORD


def test_short_ids_keep_kind_first_hex_digits_and_index() -> None:
    assert short_id("chatcmpl-1a2b3c4d5e6f7a8b9c0d#0") == "chatcmpl-1a2b3c4d#0"
    assert short_id("job-ffeeddccbbaa#2") == "job-ffeeddcc#2"
    assert short_id("llm-7") == "llm-7"


def test_message_round_trips_and_refuses_other_versions() -> None:
    message = LiveSteps("w", 1.5, 2, 1, 0.25, steps=[], dropped=3)
    assert LiveSteps.decode(message.encode()) == message
    with pytest.raises(ValueError, match="version"):
        LiveSteps.decode(json.dumps({**json.loads(message.encode()), "v": 99}))


def test_publisher_compacts_the_engines_steps(model_path: Path) -> None:
    llm = LLM(model=str(model_path), dtype="float32", max_num_batched_tokens=64, max_num_seqs=4)
    publisher = LivePublisher("w-1", max_steps=8)
    publisher.attach(llm.engine)
    prompts = [list(range(10, 90)), list(range(5, 12))]  # 80 tokens: two chunks; 7 tokens: one
    llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    message = publisher.take()
    assert message is not None and publisher.take() is None  # taken once
    # 2 steps of prefill (the long prompt's 64-token chunk, then its last 16 with the short prompt's 7),
    # then 19 of decodes for both: 21 steps, of which the newest 8 fit in a message.
    total = message.dropped + len(message.steps)
    assert len(message.steps) == 8 and total == 21 and message.steps[-1].n == 21
    last = message.steps[-1]
    assert sorted((scheduled, computed) for _, scheduled, computed in last.batch) == [(1, 25), (1, 98)]
    assert message.running == 0 and message.waiting == 0  # after the final step everyone has finished


def test_publisher_prefill_chunks_then_decodes(model_path: Path) -> None:
    llm = LLM(model=str(model_path), dtype="float32", max_num_batched_tokens=64, max_num_seqs=4)
    publisher = LivePublisher("w-1", max_steps=64)
    publisher.attach(llm.engine)
    llm.generate([list(range(10, 90)), list(range(5, 12))], SamplingParams(max_tokens=3, ignore_eos=True))
    message = publisher.take()
    assert message is not None and message.dropped == 0
    first, second = message.steps[0], message.steps[1]
    # First come, first served: the long prompt's first chunk fills the 64-token budget; the short one
    # joins in the next step beside the long one's last chunk; then both decode, one token each.
    assert first.batch == [("llm-0", 64, 0)] and first.tokens == 64
    assert sorted(second.batch) == [("llm-0", 16, 64), ("llm-1", 7, 0)] and second.tokens == 23
    assert sorted(message.steps[2].batch) == [("llm-0", 1, 80), ("llm-1", 1, 7)]


async def test_published_to_redis_with_an_idle_heartbeat(
    redis_server: ServerProcess, model_path: Path
) -> None:
    client = aioredis.Redis.from_url(redis_server.url, password=REDIS_PASSWORD)
    listener = aioredis.Redis.from_url(redis_server.url, password=REDIS_PASSWORD)
    pubsub = listener.pubsub()
    await pubsub.subscribe(LIVE_CHANNEL)
    llm = LLM(model=str(model_path), dtype="float32")
    publisher = LivePublisher("w-redis", interval_s=0.05)
    publisher.attach(llm.engine)
    task = asyncio.create_task(publisher.run_forever(client))
    try:
        await asyncio.to_thread(llm.generate, [[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
        received: list[LiveSteps] = []
        deadline = asyncio.get_running_loop().time() + 10
        while not received or received[-1].steps:  # the steps (maybe in parts), then a heartbeat
            assert asyncio.get_running_loop().time() < deadline, received
            # None also for the (ignored) subscribe confirmation: keep reading until the deadline.
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            # The session's Redis is shared: workers other tests left running publish here too.
            if message is not None and (decoded := LiveSteps.decode(message["data"])).worker == "w-redis":
                received.append(decoded)
        assert [s.n for m in received for s in m.steps] == [1, 2, 3, 4]  # a prefill and 3 decodes
        assert received[-1].running == 0 and received[-1].kv_usage == 0.0
    finally:
        await stop(task)
        await pubsub.aclose()
        await client.aclose()
        await listener.aclose()
