"""A batch survives a worker killed in the middle of it: every line completes once, and a seeded line's
text equals an uninterrupted run's. The engines are paced (each step sleeps first), so the batch is still
running when the kill lands on any host."""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path
from typing import Any

import pytest

from harness.servers import ServerProcess
from services.common import keys
from services.common.wire import DoneEvent, decode_event
from tests.services.stack import MODEL_NAME, Stack, new_stack, wait_for, worker_stats

pytestmark = pytest.mark.timeout(300)

BODY: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 60, "temperature": 0.9, "ignore_eos": True}


@pytest.fixture
def two_workers(kafka: ServerProcess, redis_server: ServerProcess, model_path: Path, tmp_path: Path) -> Any:
    stack = new_stack(
        kafka, redis_server, model_path, tmp_path, workers=2, INFLIGHT_FAULT_STEP_DELAY_S="0.02"
    )
    yield stack
    stack.close()


def test_a_worker_killed_mid_batch_loses_and_repeats_nothing(two_workers: Stack) -> None:
    stack = two_workers
    client = stack.client(timeout=120)
    prompts = [f"Tale {i}: once upon a time" for i in range(4)]
    lines = [
        json.dumps({"custom_id": f"t{i}", "method": "POST", "url": "/v1/completions",
                    "body": {**BODY, "prompt": p, "seed": 100 + i}})
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    upload = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    redis = stack.redis_client()
    job_ids = [f"job-{batch.id}-{i}" for i in range(4)]

    def running() -> str | None:
        # A job some worker owns, with tokens already out: kill that worker.
        for job_id in job_ids:
            if redis.get(keys.owner(job_id)) and redis.llen(keys.log(job_id)) >= 3:
                return str(redis.get(keys.owner(job_id)))
        return None

    owner = wait_for(running, 120, message="a batch job to be generating")
    (victim,) = [w for w in stack.workers if worker_stats(w)["worker"] == owner]
    victim.send_signal(signal.SIGKILL)

    def completed() -> Any:
        b = client.batches.retrieve(batch.id)
        return b if b.status == "completed" else None

    done = wait_for(completed, 200, interval_s=0.5, message="the batch to complete after the kill")
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (4, 0)
    output = {
        o["custom_id"]: o
        for o in map(json.loads, client.files.content(done.output_file_id).text.splitlines())
    }
    assert sorted(output) == ["t0", "t1", "t2", "t3"]
    for i, job_id in enumerate(job_ids):
        log = [decode_event(raw) for raw in redis.lrange(keys.log(job_id), 0, -1)]
        assert [e.seq for e in log] == list(range(1, len(log) + 1)), "a gap or a duplicate"
        assert isinstance(log[-1], DoneEvent) and log[-1].completion_tokens == 60
        alone = client.completions.create(
            model=MODEL_NAME, prompt=prompts[i], max_tokens=60, temperature=0.9, seed=100 + i,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert output[f"t{i}"]["response"]["body"]["choices"][0]["text"] == alone.choices[0].text
