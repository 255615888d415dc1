"""Redis answering with errors (OOM under maxmemory), not just going away: nothing lost, nothing run twice.

An OOM reply is not a connection error: it used to escape the worker's handling, so a claim refused by
a full Redis committed its offset with the record still "queued" (the job never finished), and one
refused publish killed the publisher for good (every later request hung). Here a real Redis refuses
writes (``maxmemory 1``, ``noeviction``) while a worker claims one job and while it streams another.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from services.common import keys
from services.common.wire import DeltaEvent, DoneEvent, decode_event
from tests.services.stack import MODEL_NAME, Stack, new_stack, wait_for, worker_stats

if TYPE_CHECKING:
    from harness.servers import ServerProcess

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 40


def _submit(stack: Stack, prompt: str) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    resp = httpx.post(f"{stack.url}/v1/jobs", json={"endpoint": "/v1/completions", "body": body}, timeout=30)
    assert resp.status_code == 202, resp.text
    job_id: str = resp.json()["id"]
    return job_id


def _committed(stack: Stack) -> int:
    """Messages of the stack's topic its consumer group has committed past (offsets start at 0)."""

    async def read() -> int:
        topic = stack.env["INFLIGHT_KAFKA_TOPIC"]
        consumer = AIOKafkaConsumer(
            bootstrap_servers=stack.env["INFLIGHT_KAFKA_BOOTSTRAP"],
            group_id=stack.env["INFLIGHT_KAFKA_CONSUMER_GROUP"],
            enable_auto_commit=False,
        )
        await consumer.start()
        try:
            partitions = int(stack.env.get("INFLIGHT_KAFKA_PARTITIONS", "4"))
            return sum([await consumer.committed(TopicPartition(topic, p)) or 0 for p in range(partitions)])
        finally:
            await consumer.stop()

    return asyncio.run(read())


def _oom(stack: Stack, on: bool) -> None:
    r = stack.redis_client()
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", "1" if on else "0")  # 1 byte: every write command is refused


def _status(stack: Stack, job_id: str) -> str | None:
    status = stack.redis_client().hget(keys.record(job_id), "status")
    return None if status is None else str(status)


def _assert_ran_once(stack: Stack, job_id: str) -> None:
    r = stack.redis_client()
    record = r.hgetall(keys.record(job_id))
    assert record["status"] == "completed" and record["resumed_tokens"] == "0", record
    log = [decode_event(raw) for raw in r.lrange(keys.log(job_id), 0, -1)]
    assert [e.seq for e in log] == list(range(1, len(log) + 1))  # no gap, no duplicate
    assert [type(e) for e in log if isinstance(e, DoneEvent)] == [DoneEvent]  # exactly one terminal event
    assert isinstance(log[-1], DoneEvent)
    assert sum(len(e.token_ids) for e in log if isinstance(e, DeltaEvent)) == MAX_TOKENS


def _outcomes(worker: Any) -> dict[str, float]:
    text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    prefix = "inflight:worker_outcomes_total{outcome="
    return {
        line[len(prefix) + 1 :].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix) and float(line.rsplit(" ", 1)[1])
    }


def test_an_oom_spell_keeps_offsets_until_the_requests_finish(
    own_servers: tuple[ServerProcess, ServerProcess], model_path: Path, tmp_path: Path
) -> None:
    kafka, redis_server = own_servers
    # Paced steps (about 2 s for a job), so the second job is still streaming when Redis fills up.
    stack = new_stack(kafka, redis_server, model_path, tmp_path, workers=0)
    try:
        # 1. Claimed while Redis refuses writes: the claim fails, the offset stays, the record "queued".
        first = _submit(stack, "claimed while Redis is full")
        _oom(stack, True)
        worker = stack.add_worker(wait=False, INFLIGHT_FAULT_STEP_DELAY_S="0.05")
        # Taken: held by the worker (its claims refused) or, as it used to be, dropped and committed.
        wait_for(
            lambda: _holds(worker, first) or _committed(stack), 120, interval_s=0.2, message="the job taken"
        )
        time.sleep(1.5)  # several claim attempts, each refused
        assert _committed(stack) == 0
        assert _status(stack, first) == "queued" and _holds(worker, first)
        _oom(stack, False)
        wait_for(lambda: _status(stack, first) == "completed", 60, message="the first job to finish")
        wait_for(lambda: _committed(stack) == 1, 30, message="its offset to be committed")
        _assert_ran_once(stack, first)

        # 2. Redis fills up while a job streams: its events wait in the publisher; nothing is committed
        # until the job is terminal, and it finishes once Redis takes writes again.
        second = _submit(stack, "streaming while Redis fills up")
        wait_for(lambda: stack.redis_client().llen(keys.log(second)) >= 1, 60, message="the first tokens")
        _oom(stack, True)
        time.sleep(1.5)
        assert _status(stack, second) == "in_progress"
        assert _committed(stack) == 1
        _oom(stack, False)
        wait_for(lambda: _status(stack, second) == "completed", 60, message="the second job to finish")
        wait_for(lambda: _committed(stack) == 2, 30, message="its offset to be committed")
        _assert_ran_once(stack, second)
        assert _outcomes(worker) == {"done": 2.0}
        assert httpx.get(f"{worker.url}/readyz", timeout=10).status_code == 200
    finally:
        _oom(stack, False)
        stack.close()


def _holds(worker: Any, job_id: str) -> bool:
    try:
        return job_id in worker_stats(worker)["requests"]
    except OSError:
        return False
