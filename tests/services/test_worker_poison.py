"""A request whose engines keep dying under it is failed for good, not passed from engine to engine.

Real services: the broker, Redis, a gateway through uvicorn and worker processes with their engine cores.
A watcher SIGKILLs the engine core of whichever worker is generating the request (it has published a
token), each time. The engines are paced (``INFLIGHT_FAULT_STEP_DELAY_S``), so the request is still
running when each kill lands, whatever the host's speed. One worker more than the bound stays alive: it
would resume the request if the bound did not end it, and must never claim it.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from engine.sampling_params import SamplingParams
from harness.servers import ServerProcess
from services.common import keys
from services.common.settings import Settings
from services.common.store import Store, connect_redis
from services.common.wire import DoneEvent, RequestMessage, decode_event
from services.common.wire_sampling import WireSampling
from services.worker.publisher import Publisher
from services.worker.request_runner import Runner
from services.worker.run_state import Outcome, Run
from tests.services.engine_killer import EngineKiller, poison_stack
from tests.services.sse import events
from tests.services.stack import MODEL_NAME, REDIS_PASSWORD, Stack, wait_for, worker_stats

pytestmark = pytest.mark.timeout(300)

BOUND = 2  # INFLIGHT_MAX_ENGINE_FAILURES here; the default is 3
BODY: dict[str, Any] = {
    "model": MODEL_NAME,
    "prompt": "Once upon a time, in a small village near the sea, there lived",
    "max_tokens": 200,  # at 0.05 s a step, at least 10 s on any host: each kill finds it running
    "temperature": 0.9,
    "seed": 99,
    "ignore_eos": True,
}


@pytest.fixture
def stack(
    kafka: ServerProcess, redis_server: ServerProcess, model_path: Path, tmp_path: Path
) -> Iterator[Stack]:
    s = poison_stack(kafka, redis_server, model_path, tmp_path, BOUND)
    yield s
    s.close()


def test_a_stream_that_kills_every_engine_ends_with_engine_failed(stack: Stack) -> None:
    killer = EngineKiller(stack)
    chunks: list[dict[str, Any] | str] = []
    try:
        with httpx.stream(
            "POST", f"{stack.url}/v1/completions", json={**BODY, "stream": True}, timeout=240
        ) as resp:
            assert resp.status_code == 200
            for chunk in events(resp):
                chunks.append(chunk)
                if isinstance(chunk, dict) and "id" in chunk:
                    killer.request_id = chunk["id"]
    finally:
        killer.stop()
    request_id = killer.request_id
    assert request_id is not None
    # The stream's last event is the error, with its own code; tokens came before it (it ran twice).
    error = chunks[-1]
    assert isinstance(error, dict) and error["error"]["code"] == "engine_failed", chunks[-3:]
    assert f"{BOUND} times" in error["error"]["message"]
    assert len(killer.killed) == BOUND

    redis = stack.redis_client()
    record = redis.hgetall(keys.record(request_id))
    assert (record["status"], record["code"], record["engine_failures"]) == (
        "failed",
        "engine_failed",
        str(BOUND),
    )
    assert record["epoch"] == str(BOUND)  # claimed once per engine, never again
    log = [decode_event(raw) for raw in redis.lrange(keys.log(request_id), 0, -1)]
    assert [e.seq for e in log] == list(range(1, len(log) + 1))
    done = log[-1]
    assert isinstance(done, DoneEvent) and (done.status, done.code) == ("failed", "engine_failed")

    # The dead letter, where an operator finds it.
    last_worker, last_id = killer.killed[-1]
    assert redis.zscore(keys.DEAD_LETTERS, request_id) is not None
    dead = redis.hgetall(keys.dead_letter(request_id))
    assert (dead["id"], dead["engine_failures"], dead["worker"], dead["kind"]) == (
        request_id,
        str(BOUND),
        last_id,
        "completion",
    )
    assert 0 < redis.ttl(keys.dead_letter(request_id)) <= 86_400
    assert {"topic", "partition", "offset"} <= set(dead)
    # The metric and the log line, on the worker that failed it.
    assert f"request {request_id} failed for good" in last_worker.tail_log(50_000)
    if last_worker.proc.poll() is None:
        metrics = httpx.get(f"{last_worker.url}/metrics", timeout=10).text
        assert re.search(r'^inflight:request_engine_failures_total\{outcome="failed"\} 1\.0$', metrics, re.M)
    else:  # it left the group too slowly and exited, as the first one below may
        assert last_worker.proc.returncode == 4, last_worker.tail_log()
    first_worker = killer.killed[0][0]
    if first_worker.proc.poll() is None:
        metrics = httpx.get(f"{first_worker.url}/metrics", timeout=10).text
        assert re.search(
            r'^inflight:request_engine_failures_total\{outcome="handed_back"\} 1\.0$', metrics, re.M
        )
    else:
        # A worker whose engine died exits when leaving the consumer group hangs past its bound (code 4,
        # services/worker/main.py): on a loaded host that can happen before this line; its log counted it.
        assert first_worker.proc.returncode == 4, first_worker.tail_log()
        assert f"request {request_id}: its engine died under it (1 of {BOUND})" in first_worker.tail_log(
            50_000
        )

    # The survivor serves on and never claims the failed request.
    (survivor,) = [w for w in stack.workers if w not in {k for k, _ in killer.killed}]
    ok = httpx.post(f"{stack.url}/v1/completions", json={**BODY, "max_tokens": 3}, timeout=120)
    assert ok.status_code == 200, ok.text
    time.sleep(1.0)
    assert redis.hget(keys.record(request_id), "epoch") == str(BOUND)
    assert request_id not in worker_stats(survivor)["requests"]


def test_a_job_that_kills_every_engine_is_failed(stack: Stack) -> None:
    killer = EngineKiller(stack)
    try:
        body = {"endpoint": "/v1/completions", "body": BODY}
        resp = httpx.post(f"{stack.url}/v1/jobs", json=body, timeout=30)
        assert resp.status_code in (200, 202), resp.text
        job_id = resp.json()["id"]
        killer.request_id = job_id

        def finished() -> dict[str, Any] | None:
            view: dict[str, Any] = httpx.get(f"{stack.url}/v1/jobs/{job_id}", timeout=10).json()
            return view if view["status"] in ("completed", "failed", "cancelled") else None

        view = wait_for(finished, 200, interval_s=0.5, message="the job to end")
    finally:
        killer.stop()
    assert view["status"] == "failed", view
    assert view["error"]["code"] == "engine_failed", view
    assert len(killer.killed) == BOUND
    assert stack.redis_client().hget(keys.record(job_id), "engine_failures") == str(BOUND)


async def test_a_claim_past_the_bound_fails_it_without_an_engine(redis_server: ServerProcess) -> None:
    """The worker that counted the last engine failure died before it could fail the request: the next
    claim fails it before any engine sees it (the runner is given no engine at all here)."""
    settings = Settings(redis_url=redis_server.url, redis_password=REDIS_PASSWORD, lease_ttl_s=5)
    store = Store(connect_redis(settings))
    publisher = Publisher(store, settings, on_fenced=lambda run: None)
    publishing = asyncio.create_task(publisher.run_forever())
    try:
        params = WireSampling.from_params(SamplingParams(max_tokens=4))
        msg = RequestMessage(
            f"cmpl-{uuid.uuid4().hex[:10]}", "completion", "tiny", [5, 6, 7], params, time.time()
        )
        await store.admit_and_record(msg.id, 100, 30, {"kind": msg.kind}, 60)
        earlier = await store.start(msg.id, "dead-worker", lease_s=5, seed=1, ttl_s=60)
        assert earlier.outcome == "ok"
        await store.client.hset(keys.record(msg.id), "engine_failures", settings.max_engine_failures)
        await store.client.delete(keys.owner(msg.id))  # its lease lapsed with it
        run = Run(msg, prompt_token_ids=[5, 6, 7])
        assert await Runner(cast(Any, None), store, publisher, settings).execute(run) is Outcome.DONE
        record = await store.get_record(msg.id)
        assert record is not None and (record["status"], record["code"]) == ("failed", "engine_failed")
        assert record["epoch"] == "2"
        dead = await store.client.hgetall(keys.dead_letter(msg.id))
        assert dead["engine_failures"] == str(settings.max_engine_failures) == "3"  # the default bound
        # Never claimed again: a redelivery finds it terminal.
        again = Run(msg, prompt_token_ids=[5, 6, 7])
        assert await Runner(cast(Any, None), store, publisher, settings).execute(again) is Outcome.SKIPPED
    finally:
        publishing.cancel()
        await asyncio.gather(publishing, return_exceptions=True)
        await store.client.aclose()
