"""Per-key budgets at a real gateway (through uvicorn, on the session's broker and Redis): synchronous
requests in flight per key, bytes of queued messages per key and per gateway (429, or 413 for one message
over the bound), stored jobs per key, each counted in ``admission_rejections_total{reason}``.

One gateway for the module and no worker, on a topic of its own: whatever it admits stays queued (its
bytes held, its streams open) until the test cancels it, on any host, with no engine to pace. No
checkpoint (it forwards text), so a prompt's size is the message's size.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from harness.servers import ServerProcess
from harness.stack import ServiceProcess
from tests.services.stack import MODEL_NAME, new_stack, wait_for

pytestmark = pytest.mark.timeout(120)

KEYS = ("alice", "bob", "carol", "dave", "erin")
PER_KEY_BYTES = 20_000
GATEWAY_BYTES = 30_000


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def gateway(
    kafka: ServerProcess,
    redis_server: ServerProcess,
    model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServiceProcess]:
    stack = new_stack(
        kafka,
        redis_server,
        model_path,
        tmp_path_factory.mktemp("budgets"),
        workers=0,
        INFLIGHT_MODEL="",
        INFLIGHT_API_KEYS=",".join(KEYS),
        INFLIGHT_MAX_CONCURRENT_PER_KEY="2",
        INFLIGHT_MAX_QUEUED_BYTES_PER_KEY=str(PER_KEY_BYTES),
        INFLIGHT_MAX_QUEUED_BYTES=str(GATEWAY_BYTES),
        INFLIGHT_MAX_JOBS_PER_KEY="3",
        INFLIGHT_MAX_STORED_JOBS_PER_KEY="4",
        INFLIGHT_MAX_MESSAGES="4",
        INFLIGHT_MAX_GRAMMAR_BYTES="2000",
    )
    assert stack.gateway is not None
    try:
        yield stack.gateway
    finally:
        stack.close()


def metric(http: httpx.Client, line: str) -> float:
    """The value of one sample of the gateway's /metrics (0 when absent)."""
    text = http.get("/metrics", headers=auth("alice")).text
    found = re.search(rf"^{re.escape(line)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def rejections(http: httpx.Client, reason: str) -> float:
    return metric(http, f'inflight:admission_rejections_total{{reason="{reason}"}}')


def job(http: httpx.Client, key: str, prompt_chars: int = 8) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "x" * prompt_chars, "max_tokens": 4}
    return http.post("/v1/jobs", json={"endpoint": "/v1/completions", "body": body}, headers=auth(key))


def cancel(http: httpx.Client, key: str, job_id: str) -> None:
    assert http.delete(f"/v1/jobs/{job_id}", headers=auth(key)).status_code == 200
    assert http.get(f"/v1/jobs/{job_id}", headers=auth(key)).json()["status"] == "cancelled"


def refused(resp: httpx.Response, status: int = 429) -> str:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == ("rate_limit_exceeded" if status == 429 else "request_too_large")
    return str(error["message"])


def test_requests_in_flight_per_key(gateway: ServiceProcess) -> None:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "stream": True}
    with httpx.Client(base_url=gateway.url, timeout=30) as http, ExitStack() as open_streams:
        before = rejections(http, "key_concurrency")
        streams = [
            open_streams.enter_context(
                http.stream("POST", "/v1/completions", json=body, headers=auth("dave"))
            )
            for _ in range(2)
        ]
        assert [s.status_code for s in streams] == [200, 200]
        # A third of dave's is refused, streamed or not, and so is a batched prompt that would pass it.
        assert "INFLIGHT_MAX_CONCURRENT_PER_KEY" in refused(
            http.post("/v1/completions", json={**body, "stream": False}, headers=auth("dave"))
        )
        refused(http.post("/v1/completions", json=body, headers=auth("dave")))
        assert rejections(http, "key_concurrency") == before + 2
        assert metric(http, "inflight:gateway_requests_in_flight") == 2
        # Another key has its own budget.
        with http.stream("POST", "/v1/completions", json=body, headers=auth("erin")) as erin:
            assert erin.status_code == 200
        # dave closes one stream: its slot comes back (the clean-up runs as the server sees the close).
        streams[0].close()
        wait_for(lambda: metric(http, "inflight:gateway_requests_in_flight") == 1, 30, message="a slot back")
        with http.stream("POST", "/v1/completions", json=body, headers=auth("dave")) as again:
            assert again.status_code == 200
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        wait_for(lambda: metric(http, "inflight:gateway_requests_in_flight") == 0, 30, message="no slot held")
        # A batched prompt of three takes three slots: refused whole, and its first two given back.
        batched = {**body, "prompt": ["a", "b", "c"], "stream": False}
        refused(http.post("/v1/completions", json=batched, headers=auth("dave")))
        wait_for(lambda: metric(http, "inflight:gateway_requests_in_flight") == 0, 30, message="none kept")


def test_queued_bytes_per_key_and_per_gateway(gateway: ServiceProcess) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        # One message larger than a key may queue could never be admitted: 413, nothing held.
        assert "20000" in refused(job(http, "alice", PER_KEY_BYTES + 1000), 413)
        alice = [job(http, "alice", 8000) for _ in range(2)]
        assert [r.status_code for r in alice] == [202, 202], alice[-1].text
        held = metric(http, "inflight:gateway_queued_bytes")
        assert 16_000 < held <= PER_KEY_BYTES
        # A third of alice's would pass her 20,000 bytes; bob still has room, until the gateway's 30,000.
        before = rejections(http, "key_queued_bytes"), rejections(http, "queued_bytes")
        refused(job(http, "alice", 8000))
        bob = job(http, "bob", 8000)
        assert bob.status_code == 202, bob.text
        refused(job(http, "bob", 8000))
        assert (rejections(http, "key_queued_bytes"), rejections(http, "queued_bytes")) == (
            before[0] + 1,
            before[1] + 1,
        )
        # Cancelled, their bytes are free at once, and alice may queue again.
        for key, resp in (("alice", alice[0]), ("alice", alice[1]), ("bob", bob)):
            cancel(http, key, resp.json()["id"])
        assert metric(http, "inflight:gateway_queued_bytes") == 0
        again = job(http, "alice", 8000)
        assert again.status_code == 202, again.text
        cancel(http, "alice", again.json()["id"])


def test_stored_jobs_per_key(gateway: ServiceProcess) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        before = rejections(http, "key_stored_jobs")
        ids = []
        for _ in range(4):  # at most 3 unfinished at once: cancelled (finished) one by one
            resp = job(http, "carol")
            assert resp.status_code == 202, resp.text
            ids.append(resp.json()["id"])
            cancel(http, "carol", ids[-1])
        # Four finished jobs are kept for carol (until they expire): a fifth is refused, though none runs.
        assert "4 jobs whose results are kept" in refused(job(http, "carol"))
        assert rejections(http, "key_stored_jobs") == before + 1
        for job_id in ids:  # and what is kept stays readable
            assert http.get(f"/v1/jobs/{job_id}", headers=auth("carol")).json()["status"] == "cancelled"
        erin = job(http, "erin")  # another key's storage is its own
        assert erin.status_code == 202, erin.text
        cancel(http, "erin", erin.json()["id"])


def test_more_messages_than_the_bound_are_refused_before_any_render(gateway: ServiceProcess) -> None:
    # This gateway has no chat template: the count is still checked here, before the message is queued.
    messages = [{"role": "user", "content": ""}] * 5
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1}
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        resp = http.post("/v1/chat/completions", json=body, headers=auth("erin"))
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "messages" and "5 messages, more than the 4" in error["message"]
        assert metric(http, "inflight:gateway_queued_bytes") == 0


def test_a_constraint_over_the_byte_bound_is_refused(gateway: ServiceProcess) -> None:
    properties = {f"field_{i}": {"type": "string"} for i in range(100)}  # about 2,900 bytes of schema
    schema = {"type": "object", "properties": properties}
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}},
    }
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        resp = http.post("/v1/chat/completions", json=body, headers=auth("erin"))
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "response_format" and "over the 2000" in error["message"], error
        small = {
            **body,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}},
        }
        small["stream"] = True
        with http.stream("POST", "/v1/chat/completions", json=small, headers=auth("erin")) as ok:
            assert ok.status_code == 200
