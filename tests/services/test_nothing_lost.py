"""Nothing lost, nothing run twice: a request's offset is committed only once Redis shows it terminal.

Each test fails without its fix: a claim during a Redis outage used to commit the offset and leave the
record "queued" forever; a replayed message older than its record used to run again; a worker whose
engine died used to stay in the group and fail every request it took.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.servers import ServerProcess
from services.common import keys
from services.worker.main import EXIT_HAND_OVER
from tests.services.stack import MODEL_NAME, Stack, new_stack, wait_for, worker_stats

pytestmark = pytest.mark.timeout(240)


def _submit(stack: Stack, prompt: str, max_tokens: int = 6) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(f"{stack.url}/v1/jobs", json={"endpoint": "/v1/completions", "body": body}, timeout=30)
    assert resp.status_code == 202, resp.text
    job_id: str = resp.json()["id"]
    return job_id


def _statuses(stack: Stack, ids: list[str]) -> dict[str, str]:
    out = {}
    for job_id in ids:
        resp = httpx.get(f"{stack.url}/v1/jobs/{job_id}", timeout=30)
        out[job_id] = resp.json()["status"] if resp.status_code == 200 else f"http {resp.status_code}"
    return out


def _all_finished(stack: Stack, ids: list[str]) -> dict[str, str] | None:
    try:
        statuses = _statuses(stack, ids)
    except httpx.HTTPError:
        return None
    return statuses if all(s in ("completed", "failed", "cancelled") for s in statuses.values()) else None


@pytest.fixture
def servers(own_servers: tuple[ServerProcess, ServerProcess]) -> tuple[ServerProcess, ServerProcess]:
    return own_servers


def test_redis_down_when_a_worker_claims(servers: Any, model_path: Path, tmp_path: Path) -> None:
    kafka, redis_server = servers
    stack = new_stack(kafka, redis_server, model_path, tmp_path, workers=0)
    try:
        ids = [_submit(stack, f"job number {i}") for i in range(5)]
        r = stack.redis_client()
        r.save()  # the restarted Redis loads this snapshot: the records outlive the outage
        redis_server.stop()
        worker = stack.add_worker(wait=False)
        # The worker consumes all five while Redis is down (its claims fail), then Redis comes back.
        wait_for(lambda: _consumed(worker) >= 5, 90, interval_s=0.5, message="the worker to take all five")
        time.sleep(1.0)
        redis_server.start()
        statuses = wait_for(
            lambda: _all_finished(stack, ids), 90, interval_s=0.5, message="all jobs finished"
        )
        assert set(statuses.values()) == {"completed"}, statuses
        assert stack.redis_client().zcard(keys.PENDING) == 0
    finally:
        stack.close()


def _consumed(worker: Any) -> int:
    try:
        return len(worker_stats(worker)["requests"])
    except OSError:
        return 0


def test_a_replay_older_than_its_record_is_not_run(servers: Any, model_path: Path, tmp_path: Path) -> None:
    kafka, redis_server = servers
    stack = new_stack(kafka, redis_server, model_path, tmp_path, INFLIGHT_RECORD_TTL_S="4")
    try:
        client = stack.client()
        ids = []
        for i in range(3):
            out = client.completions.create(model=MODEL_NAME, prompt=f"replay {i}", max_tokens=4)
            ids.append(out.id)
        time.sleep(5)  # the records expire: nothing in Redis says these ever ran
        r = stack.redis_client()
        assert not any(r.exists(keys.record(i)) for i in ids)
        # A new consumer group reads the topic from the start: every message is delivered again.
        replayer = stack.add_worker(INFLIGHT_KAFKA_CONSUMER_GROUP="replay-group")
        wait_for(
            lambda: 'inflight:worker_outcomes_total{outcome="skipped"} 3.0' in _metrics(replayer),
            60,
            interval_s=0.5,
            message="the replayed messages to be skipped",
        )
        assert 'outcome="done"' not in _metrics(replayer)
        assert not any(r.exists(keys.record(i)) or r.exists(keys.log(i)) for i in ids)
    finally:
        stack.close()


def _metrics(worker: Any) -> str:
    return httpx.get(f"{worker.url}/metrics", timeout=10).text


def test_a_worker_whose_engine_died_leaves_the_group(servers: Any, model_path: Path, tmp_path: Path) -> None:
    kafka, redis_server = servers
    stack = new_stack(kafka, redis_server, model_path, tmp_path, workers=0)
    try:
        doomed = stack.add_worker(wait=False, INFLIGHT_FAULT_ENGINE_DIES_AFTER_STEPS="40")
        stack.add_worker(wait=False)
        for worker in stack.workers:
            worker.wait_ready()
        ids = [_submit(stack, f"request {i} of fifty", max_tokens=8) for i in range(50)]
        statuses = wait_for(
            lambda: _all_finished(stack, ids), 180, interval_s=1.0, message="all jobs finished"
        )
        failed = {k: v for k, v in statuses.items() if v != "completed"}
        assert not failed, failed
        try:
            ready = httpx.get(f"{doomed.url}/readyz", timeout=10)
        except httpx.ConnectError:
            # Leaving the group can hang in a rebalance the broker does not finish (a loaded host): past
            # its bound the worker exits instead, which frees its partitions just the same.
            assert doomed.proc.wait(60) == EXIT_HAND_OVER
            assert "the group could not be left" in doomed.log_path.read_text(errors="replace")
        else:
            # The doomed worker is not ready, and holds no partition.
            assert ready.status_code == 503 and ready.json()["partitions"] == []
            healthz = f"{doomed.url}/healthz"
            wait_for(lambda: httpx.get(healthz, timeout=10).status_code == 500, 60, 0.2, "healthz 500")
    finally:
        stack.close()
