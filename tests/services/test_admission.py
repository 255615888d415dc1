"""Bounded admission: 429 past the cluster-wide bound at once, and no accepted request is ever lost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from harness.servers import ServerProcess
from tests.services.stack import MODEL_NAME, new_stack, wait_for

pytestmark = pytest.mark.timeout(150)


def _post_job(url: str, prompt: str) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    return httpx.post(f"{url}/v1/jobs", json={"endpoint": "/v1/completions", "body": body}, timeout=30)


def test_429_past_the_bound_and_accepted_requests_all_finish(
    own_servers: tuple[ServerProcess, ServerProcess], model_path: Path, tmp_path: Path
) -> None:
    kafka, redis_server = own_servers
    # No worker yet: whatever is admitted waits in Kafka, counting against the bound.
    stack = new_stack(kafka, redis_server, model_path, tmp_path, workers=0, INFLIGHT_MAX_PENDING="3")
    try:
        accepted = [_post_job(stack.url, f"prompt number {i}") for i in range(3)]
        assert [r.status_code for r in accepted] == [202, 202, 202]
        rejected = _post_job(stack.url, "one too many")
        assert rejected.status_code == 429
        assert rejected.headers["retry-after"] == "1"
        assert rejected.json()["error"]["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            stack.client().completions.create(model=MODEL_NAME, prompt="sync too", max_tokens=2)

        # Cancelling a job still in Kafka frees its slot at once; the worker will skip its message.
        cancelled = accepted.pop(0).json()["id"]
        resp = httpx.delete(f"{stack.url}/v1/jobs/{cancelled}", timeout=30)
        assert resp.json()["status"] == "cancelled"
        late = _post_job(stack.url, "admitted after the cancel")
        assert late.status_code == 202
        accepted.append(late)

        stack.add_worker()
        ids = [r.json()["id"] for r in accepted]

        def statuses() -> list[Any]:
            return [httpx.get(f"{stack.url}/v1/jobs/{i}", timeout=30).json()["status"] for i in ids]

        wait_for(
            lambda: statuses() == ["completed"] * 3, 60, interval_s=0.3, message="all accepted jobs done"
        )
        job = httpx.get(f"{stack.url}/v1/jobs/{cancelled}", timeout=30).json()
        assert job["status"] == "cancelled" and job["started_at"] is None  # skipped, never run
        assert stack.redis_client().zcard("inflight:pending") == 0
        resp = stack.client().completions.create(
            model=MODEL_NAME, prompt="room again", max_tokens=2, extra_body={"ignore_eos": True}
        )  # ignore_eos: a sampled end of text would finish it "stop" (seen on a loaded host)
        assert resp.choices[0].finish_reason == "length"
    finally:
        stack.close()
