"""Async jobs: submit, poll, follow the events (so far, then live), cancel; and cancel by disconnect.

The tests that act on a job while it runs use the paced stack: at PACED_STEP_DELAY_S a step, a request of
N tokens runs at least N x 20 ms on any host, so it is still running when the test follows, cancels or
leaves it within a second or two, and the test ends as soon as it is cancelled.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.services.sse import events, text_of
from tests.services.stack import MODEL_NAME, Stack, wait_for, worker_stats

pytestmark = pytest.mark.timeout(120)

PROMPT = "The quick brown fox jumps over the lazy dog."


def _job(stack: Stack, **body: Any) -> dict[str, Any]:
    payload = {"endpoint": "/v1/completions", "body": {"model": MODEL_NAME, "prompt": PROMPT, **body}}
    resp = httpx.post(f"{stack.url}/v1/jobs", json=payload, timeout=30)
    assert resp.status_code == 202, resp.text
    job: dict[str, Any] = resp.json()
    assert resp.headers["location"] == f"/v1/jobs/{job['id']}"
    return job


def _get(stack: Stack, job_id: str) -> dict[str, Any]:
    resp = httpx.get(f"{stack.url}/v1/jobs/{job_id}", timeout=30)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def test_job_lifecycle_matches_a_synchronous_request(stack: Stack) -> None:
    job = _job(stack, max_tokens=10, seed=5, temperature=0.7)
    # The 202 shows the record as it is: a fast worker may already have claimed the job.
    assert job["status"] in ("queued", "in_progress") and job["object"] == "job"
    done = wait_for(
        lambda: (j := _get(stack, job["id"]))["status"] == "completed" and j, 30, message="job done"
    )
    sync = stack.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=10, seed=5, temperature=0.7
    )
    assert done["result"]["choices"][0]["text"] == sync.choices[0].text
    assert done["usage"]["completion_tokens"] == 10
    timings = done["timings"]
    assert 0 <= timings["queue_s"] <= timings["total_s"]
    # Events of a finished job: every token from the log, then [DONE].
    with httpx.stream("GET", f"{stack.url}/v1/jobs/{job['id']}/events", timeout=30) as resp:
        chunks = list(events(resp))
    assert chunks[-1] == "[DONE]"
    assert text_of(chunks) == sync.choices[0].text


def test_job_events_so_far_then_live(paced_stack: Stack) -> None:
    # 150 paced tokens: at least 3 s, so the events begin with the log so far and go on live.
    stack = paced_stack
    job = _job(stack, max_tokens=150, ignore_eos=True, temperature=0)
    wait_for(lambda: _get(stack, job["id"])["status"] == "in_progress", 30, message="job running")
    with httpx.stream("GET", f"{stack.url}/v1/jobs/{job['id']}/events", timeout=60) as resp:
        chunks = list(events(resp))
    final = _get(stack, job["id"])
    assert final["status"] == "completed"
    assert chunks[-1] == "[DONE]"
    assert text_of(chunks) == final["result"]["choices"][0]["text"]
    usage = [c["usage"] for c in chunks if isinstance(c, dict) and c.get("usage")]
    assert usage == [final["usage"]]


def test_cancel_a_running_job_frees_its_kv_blocks(paced_stack: Stack) -> None:
    # 1,800 paced tokens run at least 36 s: the cancel, within a second of the claim, finds it running.
    stack = paced_stack
    worker = stack.workers[0]
    job = _job(stack, max_tokens=1800, ignore_eos=True)
    wait_for(lambda: _get(stack, job["id"])["status"] == "in_progress", 30, message="job running")
    resp = httpx.delete(f"{stack.url}/v1/jobs/{job['id']}", timeout=30)
    assert resp.status_code == 200
    assert resp.json()["status"] in ("cancelling", "cancelled")
    final = wait_for(
        lambda: (j := _get(stack, job["id"]))["status"] == "cancelled" and j, 30, message="cancelled"
    )
    assert final["result"]["choices"][0]["finish_reason"] == "abort"
    assert final["usage"]["completion_tokens"] < 1800
    _assert_kv_all_free(worker)
    # Cancelling a finished job changes nothing.
    assert httpx.delete(f"{stack.url}/v1/jobs/{job['id']}", timeout=30).json()["status"] == "cancelled"


def test_client_disconnect_cancels_mid_stream(paced_stack: Stack) -> None:
    # 1,800 paced tokens run at least 36 s: the client leaves after 5 of them, mid-stream on any host.
    stack = paced_stack
    worker = stack.workers[0]
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1800, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=30) as resp:
        got: list[dict[str, Any]] = []
        for chunk in events(resp):
            assert isinstance(chunk, dict)
            got.append(chunk)
            if len(got) == 5:
                break  # leaving the block closes the connection mid-stream
    request_id = got[0]["id"]
    wait_for(lambda: stack.redis_client().hget(f"inflight:req:{{{request_id}}}", "status") == "cancelled", 30)
    _assert_kv_all_free(worker)


def _assert_kv_all_free(worker: Any) -> None:
    def all_free() -> bool:
        stats = worker_stats(worker)
        kv = stats["kv"]
        return (
            not stats["requests"]
            and stats["num_running"] == 0
            and kv["num_free_blocks"] == kv["num_total_blocks"]
        )

    wait_for(all_free, 15, message="the worker's KV blocks all free")


def test_events_of_a_job_whose_log_expired_come_from_its_record(stack: Stack) -> None:
    job = _job(stack, max_tokens=6, temperature=0)
    done = wait_for(
        lambda: (j := _get(stack, job["id"]))["status"] == "completed" and j, 30, message="job done"
    )
    stack.redis_client().delete(f"inflight:req:{{{job['id']}}}:log")
    with httpx.stream("GET", f"{stack.url}/v1/jobs/{job['id']}/events", timeout=30) as resp:
        chunks = list(events(resp))
    assert chunks[-1] == "[DONE]"
    assert text_of(chunks) == done["result"]["choices"][0]["text"]


def test_unknown_job_is_404(stack: Stack) -> None:
    for method in ("GET", "DELETE"):
        resp = httpx.request(method, f"{stack.url}/v1/jobs/job-nope", timeout=30)
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == "not_found"
