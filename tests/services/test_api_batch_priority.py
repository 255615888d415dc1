"""A running batch does not queue ahead of interactive traffic (fcfs, the default policy): its lines wait
in the engine behind interactive requests, and the broker holds at most INFLIGHT_BATCH_MAX_QUEUED of them.

A stack of its own, paced (every engine step sleeps 50 ms) with 2 seats and 8 waiting places: the batch's
40-token lines run for at least 2 s each, so lines pile up waiting in the engine whatever the host's speed.
Once 6 wait there, an interactive job is sent; it must start (first token) before all but the few batch
lines that were ahead of it in the broker, where without the background band it would start after every
line already waiting in the engine.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.servers import ServerProcess
from services.common import keys
from services.gateway.batches import line_job_id
from tests.services.stack import MODEL_NAME, Stack, new_stack, wait_for

pytestmark = pytest.mark.timeout(400)

MAX_QUEUED = 2
FETCH_MAX_WAITING = 8
NUM_LINES = 16


@pytest.fixture(scope="module")
def seats(
    kafka: ServerProcess,
    redis_server: ServerProcess,
    model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    stack = new_stack(
        kafka,
        redis_server,
        model_path,
        tmp_path_factory.mktemp("batch-priority"),
        INFLIGHT_FAULT_STEP_DELAY_S="0.05",
        INFLIGHT_ENGINE_ARGS=json.dumps({"max_num_seqs": 2}),
        INFLIGHT_FETCH_MAX_WAITING=str(FETCH_MAX_WAITING),
        INFLIGHT_BATCH_MAX_QUEUED=str(MAX_QUEUED),
    )
    yield stack
    stack.close()


def _first_token_at(record: dict[str, Any]) -> float:
    """When a job's first token came: its claim time plus the worker's time to first token."""
    return float(record["started"]) + float(record["ttft_worker_s"])


def test_an_interactive_request_starts_before_the_waiting_batch_lines(seats: Stack) -> None:
    client = seats.client()
    redis = seats.redis_client()
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True}
    lines = [
        json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": body})
        for i in range(NUM_LINES)
    ]
    upload = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    job_ids = [line_job_id(batch.id, i) for i in range(NUM_LINES)]

    def statuses() -> list[str]:
        return [str(redis.hget(keys.record(j), "status") or "") for j in job_ids]

    def queued_in_broker() -> int:
        return statuses().count("queued")

    # Taken by the worker and not finished: 2 running, the rest waiting in the engine.
    wait_for(lambda: statuses().count("in_progress") >= 2 + 6, 240, 0.1, "batch lines waiting in the engine")
    assert queued_in_broker() <= MAX_QUEUED  # the batch tops the broker up, never fills it
    sent = time.time()
    resp = httpx.post(
        f"{seats.url}/v1/jobs",
        json={"endpoint": "/v1/completions", "body": {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}},
        timeout=30,
    )
    assert resp.status_code in (200, 201, 202), resp.text
    job_id = resp.json()["id"]
    done = wait_for(
        lambda: redis.hget(keys.record(job_id), "status") == "completed", 240, 0.2, "the interactive job"
    )
    assert done
    interactive = _first_token_at(redis.hgetall(keys.record(job_id)))

    def batch_done() -> Any:
        b = client.batches.retrieve(batch.id)
        return b if b.status == "completed" else None

    finished = wait_for(batch_done, 300, 0.5, "the batch to complete")
    assert finished.request_counts is not None and finished.request_counts.completed == NUM_LINES
    starts = [_first_token_at(redis.hgetall(keys.record(j))) for j in job_ids]
    remaining = [t for t in starts if t > sent]  # the lines that had not started when it was sent
    ahead = sum(1 for t in remaining if t < interactive)
    # Only lines already in the broker ahead of it (at most MAX_QUEUED), and one admitted while it was being
    # fetched, may start first; without the band, the 6 or more waiting in the engine all would.
    assert len(remaining) >= 6
    assert ahead <= MAX_QUEUED + 1, (ahead, len(remaining))
