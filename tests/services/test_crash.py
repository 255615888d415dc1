"""Crash safety with two worker processes: SIGKILL, SIGTERM drain, and a duplicated delivery.

A request's stream must complete with no gap and no duplicate, and with seeded sampling its text must
equal an uninterrupted run's, token for token.

Every test here needs its request still running when the fault lands, so the engines are paced
(``INFLIGHT_FAULT_STEP_DELAY_S``): a request of N tokens takes at least N steps of STEP_DELAY_S on any
host, and a fast machine can no longer finish it before the kill, the drain or the duplicate.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from harness.servers import ServerProcess
from harness.stack import ServiceProcess
from services.common import keys
from services.common.kafka import heartbeat_interval_ms
from services.common.settings import Settings
from services.common.wire import DeltaEvent, DoneEvent, decode_event
from tests.services.stack import MODEL_NAME, Stack, new_stack, wait_for, worker_stats

pytestmark = pytest.mark.timeout(180)

# Each engine step sleeps this long first: PARAMS's request takes at least 150 x 0.02 = 3 s.
STEP_DELAY_S = "0.02"

PARAMS: dict[str, Any] = {
    "model": MODEL_NAME,
    "prompt": "Once upon a time, in a small village near the sea, there lived",
    "max_tokens": 150,
    "temperature": 0.9,
    "seed": 1234,
    "extra_body": {"ignore_eos": True},
}


@pytest.fixture
def two_workers(kafka: ServerProcess, redis_server: ServerProcess, model_path: Path, tmp_path: Path) -> Any:
    stack = new_stack(
        kafka, redis_server, model_path, tmp_path, workers=2, INFLIGHT_FAULT_STEP_DELAY_S=STEP_DELAY_S
    )
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


# tansu (the test broker) answers the survivor's rejoin after a member's death only after a while
# (measured: half to two thirds of the session), which Apache Kafka does not: bounded here by a whole
# session. Then the rest: sync, the offset and message fetch, the claim, a prefill and one paced step,
# on a loaded two-core host.
RESUME_MARGIN_S = 2.0


def test_a_killed_workers_request_resumes_within_its_session(
    kafka: ServerProcess, redis_server: ServerProcess, model_path: Path, tmp_path: Path
) -> None:
    """SIGKILL says no goodbye to the consumer group: the dead worker's partitions wait out its session,
    a survivor learns of the rebalance at its next heartbeat, finds the lease lapsed (it is shorter than
    the session) and resumes. So the wait is bounded by construction, not by the host's speed."""
    defaults = Settings()  # what a deployment gets (the test stacks' own are longer)
    session_ms, lease_s = defaults.kafka_session_timeout_ms, defaults.lease_ttl_s
    heartbeat_s = heartbeat_interval_ms(session_ms) / 1e3
    # The target: on Apache Kafka a dead worker's requests move on a session and a heartbeat after its
    # last beat, and its lease has lapsed by then: within 5 s.
    assert session_ms / 1e3 + heartbeat_s < 5 and lease_s <= session_ms / 1e3
    stack = new_stack(
        kafka,
        redis_server,
        model_path,
        tmp_path,
        workers=2,
        INFLIGHT_KAFKA_SESSION_TIMEOUT_MS=str(session_ms),
        INFLIGHT_LEASE_TTL_S=str(lease_s),
        # 1,000 tokens of at least 50 ms each: the request outlives the kill and the bound below.
        INFLIGHT_FAULT_STEP_DELAY_S="0.05",
    )
    body = {**PARAMS, "max_tokens": 1000, "stream": True}
    body.update(body.pop("extra_body"))
    request_ids: list[str] = []
    hang_up = threading.Event()

    def read() -> None:
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {") and not request_ids:
                    request_ids.append(json.loads(line[6:])["id"])
                if hang_up.is_set():
                    return  # the gateway cancels the rest

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        r = stack.redis_client()
        request_id = wait_for(lambda: request_ids and request_ids[0], 60, message="the first chunk")
        events = r.pubsub(ignore_subscribe_messages=True)
        events.subscribe(keys.events(request_id))
        wait_for(lambda: r.llen(keys.log(request_id)) >= 5, 30, interval_s=0.02, message="five events")
        victim = _owner(stack, request_id)
        victim_id = worker_stats(victim)["worker"]
        victim.kill()
        killed = time.monotonic()
        bound = 2 * session_ms / 1e3 + 2 * heartbeat_s + RESUME_MARGIN_S
        resumed_by = None
        while resumed_by is None and time.monotonic() - killed < bound + 10:
            msg = events.get_message(timeout=0.2)
            event = decode_event(msg["data"]) if msg else None
            if isinstance(event, DeltaEvent) and event.worker != victim_id:
                resumed_by = event.worker
        waited = time.monotonic() - killed
        events.close()
        assert resumed_by is not None, f"not resumed {waited:.1f}s after the kill\n{stack.logs()}"
        assert waited < bound, f"resumed after {waited:.1f}s, bound {bound:.1f}s"
        # Not before the broker could give up on the dead worker (its last heartbeat may precede the kill
        # by one interval), nor before its lease could lapse.
        assert waited > max(session_ms / 1e3 - heartbeat_s, lease_s * 2 / 3)
    finally:
        hang_up.set()
        reader.join(timeout=30)
        stack.close()


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
    # Once its requests are handed back and the group left (not before: poison.py's count comes first).
    wait_for(lambda: httpx.get(f"{owner.url}/healthz", timeout=10).status_code == 500, 60, 0.2, "healthz 500")
    ready = httpx.get(f"{owner.url}/readyz", timeout=10)
    assert ready.status_code == 503 and ready.json()["partitions"] == []
    assert owner.stop(timeout_s=15) == 0  # and SIGTERM still stops it (a dead engine stops no drain)


def test_sigterm_drain_hands_back_unfinished_work(
    kafka: ServerProcess, redis_server: ServerProcess, model_path: Path, tmp_path: Path
) -> None:
    # Paced, the 130 tokens left after chunk 20 take at least 2.6 s: more than the 0.5 s drain on any
    # host, so the request is certainly handed back (a fast host used to finish it inside the drain).
    stack = new_stack(
        kafka,
        redis_server,
        model_path,
        tmp_path,
        workers=2,
        INFLIGHT_DRAIN_TIMEOUT_S="0.5",
        INFLIGHT_FAULT_STEP_DELAY_S=STEP_DELAY_S,
    )
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
    # Paced, so the request is still running at the SIGTERM (the drain has something to wait for).
    stack = new_stack(
        kafka,
        redis_server,
        model_path,
        tmp_path,
        workers=1,
        INFLIGHT_DRAIN_TIMEOUT_S="60",
        INFLIGHT_FAULT_STEP_DELAY_S=STEP_DELAY_S,
    )
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
    # Paced: 190 tokens (at least 3.8 s) are left after chunk 10, while copying the message takes about
    # a second, so both workers consume a copy while the request still runs.
    params = {**PARAMS, "max_tokens": 200}

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
