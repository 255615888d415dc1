"""Crash safety with two worker processes: SIGKILL, SIGTERM drain, and a duplicated delivery.

A request's stream must complete with no gap and no duplicate, and with seeded sampling its text must
equal an uninterrupted run's, token for token.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from harness.servers import ServerProcess
from harness.stack import ServiceProcess
from services.common import keys
from services.common.wire import DeltaEvent, DoneEvent, decode_event
from tests.services.stack import MODEL_NAME, Stack, new_stack, worker_stats

pytestmark = pytest.mark.timeout(180)

PARAMS: dict[str, Any] = {
    "model": MODEL_NAME,
    "prompt": "Once upon a time, in a small village near the sea, there lived",
    "max_tokens": 400,
    "temperature": 0.9,
    "seed": 1234,
    "extra_body": {"ignore_eos": True},
}


@pytest.fixture
def two_workers(kafka: ServerProcess, redis_server: ServerProcess, model_path: Path, tmp_path: Path) -> Any:
    stack = new_stack(kafka, redis_server, model_path, tmp_path, workers=2)
    yield stack
    stack.close()


def _owner(stack: Stack, request_id: str) -> ServiceProcess:
    owner = stack.redis_client().get(keys.owner(request_id))
    (worker,) = [w for w in stack.workers if w.proc.poll() is None and worker_stats(w)["worker"] == owner]
    return worker


def _stream_with(stack: Stack, action: Any, after_chunks: int = 20) -> tuple[str, str]:
    """Stream PARAMS; after ``after_chunks`` chunks call action(request_id). Returns (id, text)."""
    chunks = []
    request_id = ""
    for i, chunk in enumerate(stack.client(timeout=120).completions.create(**PARAMS, stream=True)):
        request_id = chunk.id
        chunks.append(chunk.choices[0].text)
        if i == after_chunks:
            action(request_id)
    return request_id, "".join(chunks)


def _check_log(stack: Stack, request_id: str, num_workers: int) -> None:
    log = [decode_event(raw) for raw in stack.redis_client().lrange(keys.log(request_id), 0, -1)]
    assert [e.seq for e in log] == list(range(1, len(log) + 1)), "gap or duplicate in the sequence"
    assert isinstance(log[-1], DoneEvent) and log[-1].status == "completed"
    assert log[-1].completion_tokens == PARAMS["max_tokens"]
    assert len({e.worker for e in log if isinstance(e, DeltaEvent)}) == num_workers


def test_sigkill_mid_stream_resumes_on_the_other_worker(two_workers: Stack) -> None:
    stack = two_workers
    reference = stack.client(timeout=120).completions.create(**PARAMS).choices[0].text
    killed: list[ServiceProcess] = []

    def kill_owner(request_id: str) -> None:
        victim = _owner(stack, request_id)
        victim.kill()
        killed.append(victim)

    request_id, text = _stream_with(stack, kill_owner)
    assert killed and killed[0].proc.returncode == -9
    assert text == reference  # no gap, no duplicate, the same tokens as uninterrupted
    _check_log(stack, request_id, num_workers=2)
    record = stack.redis_client().hgetall(keys.record(request_id))
    assert int(record["resumed_tokens"]) >= 20


def test_a_killed_engine_core_hands_back_to_the_other_worker(two_workers: Stack) -> None:
    """The OOM killer picks the biggest process: the engine core, not its worker. The worker must see
    its engine gone, hand the request back and step aside; the other worker resumes it exactly."""
    stack = two_workers
    reference = stack.client(timeout=120).completions.create(**PARAMS).choices[0].text
    doomed: list[ServiceProcess] = []

    def kill_engine_core(request_id: str) -> None:
        owner = _owner(stack, request_id)
        core_pid = worker_stats(owner)["engine_pid"]
        assert core_pid != owner.proc.pid  # the core runs in a process of its own
        os.kill(core_pid, signal.SIGKILL)
        doomed.append(owner)

    request_id, text = _stream_with(stack, kill_engine_core)
    assert text == reference
    _check_log(stack, request_id, num_workers=2)
    (owner,) = doomed
    assert owner.proc.poll() is None  # the worker lives on, and says its engine is dead
    assert httpx.get(f"{owner.url}/healthz", timeout=10).status_code == 500
    ready = httpx.get(f"{owner.url}/readyz", timeout=10)
    assert ready.status_code == 503 and ready.json()["partitions"] == []
    assert owner.stop(timeout_s=15) == 0  # and SIGTERM still stops it (a dead engine stops no drain)


def test_sigterm_drain_hands_back_unfinished_work(
    kafka: ServerProcess, redis_server: ServerProcess, model_path: Path, tmp_path: Path
) -> None:
    stack = new_stack(kafka, redis_server, model_path, tmp_path, workers=2, INFLIGHT_DRAIN_TIMEOUT_S="0.5")
    try:
        reference = stack.client(timeout=120).completions.create(**PARAMS).choices[0].text
        stopped: list[int | None] = []
        request_id, text = _stream_with(
            stack, lambda rid: stopped.append(_owner(stack, rid).stop(timeout_s=20))
        )
        assert stopped == [0]  # a clean exit after handing the request back
        assert text == reference
        _check_log(stack, request_id, num_workers=2)
    finally:
        stack.close()


def test_sigterm_lets_in_flight_work_finish_within_the_grace_period(
    kafka: ServerProcess, redis_server: ServerProcess, model_path: Path, tmp_path: Path
) -> None:
    stack = new_stack(kafka, redis_server, model_path, tmp_path, workers=1, INFLIGHT_DRAIN_TIMEOUT_S="60")
    try:
        worker = stack.workers[0]
        stopped: list[int | None] = []
        request_id, _ = _stream_with(
            stack, lambda rid: stopped.append(worker.stop(timeout_s=60)), after_chunks=10
        )
        assert stopped == [0]  # exited only after its request was done, and cleanly
        _check_log(stack, request_id, num_workers=1)
    finally:
        stack.close()


async def test_a_duplicated_delivery_never_runs_twice(two_workers: Stack) -> None:
    stack = two_workers
    topic = stack.env["INFLIGHT_KAFKA_TOPIC"]
    bootstrap = stack.env["INFLIGHT_KAFKA_BOOTSTRAP"]
    params = {**PARAMS, "max_tokens": 600}

    async def duplicate(request_id: str) -> None:
        # Copy the request's message onto every partition: both workers consume a copy while it runs.
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
        await consumer.start()
        try:
            value = None
            while value is None:
                batch = await consumer.getmany(timeout_ms=1000)
                value = next(
                    (r.value for rs in batch.values() for r in rs if request_id.encode() in r.value), None
                )
        finally:
            await consumer.stop()
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=False)
        await producer.start()
        try:
            for partition in await producer.partitions_for(topic):
                await producer.send_and_wait(topic, value, partition=partition)
        finally:
            await producer.stop()

    def run() -> tuple[str, str]:
        chunks, request_id = [], ""
        stream = stack.client(timeout=120).completions.create(**params, stream=True)
        for i, chunk in enumerate(stream):
            request_id = chunk.id
            chunks.append(chunk.choices[0].text)
            if i == 10:
                asyncio.run(duplicate(request_id))
        return request_id, "".join(chunks)

    reference = (
        (await asyncio.to_thread(stack.client(timeout=120).completions.create, **params)).choices[0].text
    )
    request_id, text = await asyncio.to_thread(run)
    assert text == reference
    log = [decode_event(raw) for raw in stack.redis_client().lrange(keys.log(request_id), 0, -1)]
    assert [e.seq for e in log] == list(range(1, len(log) + 1))
    assert len({e.worker for e in log}) == 1  # one worker generated it, start to finish
