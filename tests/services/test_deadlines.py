"""Request deadlines: a request no engine has started by its deadline is failed with code ``timeout``,
never prefilled; the gateway fails one still waiting in Kafka, the worker one it takes too late.

One stack without a worker at first: whatever is admitted waits in Kafka, so deadlines pass on their own
(no race with an engine, whatever the host's speed).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from harness.servers import ServerProcess
from tests.services.sse import events
from tests.services.stack import MODEL_NAME, new_stack, wait_for

pytestmark = pytest.mark.timeout(240)

BODY = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}


def _prompt_tokens_total(worker_url: str) -> float:
    text = httpx.get(f"{worker_url}/metrics", timeout=10).text
    match = re.search(r'^inflight:prompt_tokens_total\{model_name="tiny"\} (\S+)$', text, re.M)
    assert match is not None, "the worker exports inflight:prompt_tokens_total"
    return float(match.group(1))


def test_expired_requests_are_failed_not_prefilled(
    kafka: ServerProcess, redis_server: ServerProcess, model_path: Path, tmp_path: Path
) -> None:
    stack = new_stack(kafka, redis_server, model_path, tmp_path, workers=0)
    try:
        url = stack.url
        # A client that will wait one second: the gateway fails it once that passes (no worker yet).
        resp = httpx.post(f"{url}/v1/completions", json=BODY, headers={"X-Request-Timeout": "1"}, timeout=30)
        assert resp.status_code == 504, resp.text
        assert resp.json()["error"]["code"] == "timeout"
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "stream": True},
            headers={"X-Request-Timeout": "0.5"},
            timeout=30,
        ) as streamed:
            chunks = list(events(streamed))
        assert len(chunks) == 1 and isinstance(chunks[0], dict), chunks
        assert chunks[0]["error"]["code"] == "timeout"
        bad = httpx.post(
            f"{url}/v1/completions", json=BODY, headers={"X-Request-Timeout": "soon"}, timeout=30
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Timeout"

        # Jobs with a deadline, and one without; their gateway stops before the deadlines pass, so the
        # worker that arrives afterwards is the one to find them expired in Kafka.
        def job(headers: dict[str, str]) -> str:
            body = {"endpoint": "/v1/completions", "body": BODY}
            created = httpx.post(f"{url}/v1/jobs", json=body, headers=headers, timeout=30)
            assert created.status_code == 202, created.text
            return str(created.json()["id"])

        expiring = [job({"X-Request-Timeout": "1"}) for _ in range(2)]
        lasting = job({})
        assert stack.gateway is not None
        stack.gateway.stop()
        time.sleep(1.5)
        worker = stack.add_worker()
        redis = stack.redis_client()

        def record(job_id: str) -> dict[str, str]:
            return dict(redis.hgetall(f"inflight:req:{{{job_id}}}"))

        wait_for(lambda: record(lasting).get("status") == "completed", 60, message="the lasting job done")
        for job_id in expiring:
            failed = wait_for(lambda j=job_id: (r := record(j)).get("status") == "failed" and r, 30)
            assert failed["code"] == "timeout", failed
            assert "deadline" in failed["error"]
        # Only the lasting job was prefilled: the engine counted its prompt and no other.
        used = json.loads(record(lasting)["usage"])["prompt_tokens"]
        assert _prompt_tokens_total(worker.url) == used
    finally:
        stack.close()
