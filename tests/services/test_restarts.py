"""Outages: the broker and Redis restart (both lose everything: tansu keeps its log in memory, and our
Redis runs without persistence). In-flight requests finish or fail with a clear error; the system then
serves again without anyone restarting the gateway or the workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from harness.servers import ServerProcess
from tests.services.sse import events, text_of
from tests.services.stack import MODEL_NAME, Stack, new_stack, wait_for

pytestmark = pytest.mark.timeout(150)

# The outage must come while the streamed request still runs: paced at 20 ms a step, the 185 tokens
# left after chunk 15 take at least 3.7 s on any host, longer than stopping a server, seeing a request
# refused and starting the server again.
STEP_DELAY_S = "0.02"

BODY: dict[str, Any] = {
    "model": MODEL_NAME,
    "prompt": "Water boils at one hundred degrees Celsius at sea level.",
    "max_tokens": 200,
    "temperature": 0.8,
    "seed": 99,
    "ignore_eos": True,
}


@pytest.fixture
def outage_stack(own_servers: tuple[ServerProcess, ServerProcess], model_path: Path, tmp_path: Path) -> Any:
    kafka, redis_server = own_servers
    stack = new_stack(
        kafka,
        redis_server,
        model_path,
        tmp_path,
        INFLIGHT_KAFKA_PRODUCE_TIMEOUT_S="2",
        INFLIGHT_FAULT_STEP_DELAY_S=STEP_DELAY_S,
    )
    yield stack
    stack.close()


def _stream(stack: Stack, during: Any, after_chunks: int = 15) -> list[dict[str, Any] | str]:
    chunks: list[dict[str, Any] | str] = []
    with httpx.stream(
        "POST", f"{stack.url}/v1/completions", json={**BODY, "stream": True}, timeout=90
    ) as resp:
        for chunk in events(resp):
            chunks.append(chunk)
            if len(chunks) == after_chunks:
                during()
    return chunks


def _reference(stack: Stack) -> str:
    resp = httpx.post(f"{stack.url}/v1/completions", json=BODY, timeout=90)
    assert resp.status_code == 200, resp.text
    text: str = resp.json()["choices"][0]["text"]
    return text


def _serves_again(stack: Stack, timeout_s: float = 60) -> None:
    def one() -> bool:
        try:
            resp = stack.client(timeout=20).completions.create(model=MODEL_NAME, prompt="again", max_tokens=3)
        except (openai.APIStatusError, openai.APIConnectionError, openai.APITimeoutError):
            return False
        return resp.choices[0].finish_reason == "length"

    wait_for(one, timeout_s, interval_s=0.5, message="a request to succeed after the restart")


def test_broker_restart(outage_stack: Stack) -> None:
    stack = outage_stack
    expected = _reference(stack)
    outage: dict[str, Any] = {}

    def restart_broker() -> None:
        stack.kafka.stop()
        # While the broker is down a new request fails fast, with a clear error.
        with pytest.raises(openai.APIStatusError) as err:
            stack.client(timeout=20).completions.create(model=MODEL_NAME, prompt="during", max_tokens=2)
        outage["status"], outage["code"] = err.value.status_code, err.value.code
        stack.kafka.start()

    chunks = _stream(stack, restart_broker)
    # The request already in the engine does not need the broker: it finishes, whole.
    assert chunks[-1] == "[DONE]"
    assert text_of(chunks) == expected
    assert outage == {"status": 503, "code": "broker_unavailable"}
    _serves_again(stack)


def test_requests_lost_by_the_broker_are_produced_again(
    own_servers: tuple[ServerProcess, ServerProcess], model_path: Path, tmp_path: Path
) -> None:
    """Queued jobs, no worker yet; the broker restarts empty. The topic had 6 partitions and comes back
    with the broker's default (4, auto-created by the first client that asks for it): the messages on
    partitions that still exist are gone, and those on 4 and 5 are on partitions that no longer exist.
    The gateway's queue watch produces every one of them again."""
    kafka, redis_server = own_servers
    stack = new_stack(kafka, redis_server, model_path, tmp_path, workers=0, INFLIGHT_KAFKA_PARTITIONS="6")
    try:
        ids = []
        for i in range(8):  # different prompts, different keys: spread over the partitions
            body = {"model": MODEL_NAME, "prompt": f"queued when the broker died {i}", "max_tokens": 4}
            job = httpx.post(
                f"{stack.url}/v1/jobs", json={"endpoint": "/v1/completions", "body": body}, timeout=30
            )
            assert job.status_code == 202
            ids.append(job.json()["id"])
        kafka.restart()  # the queued messages are gone with the broker's memory
        stack.add_worker()

        def all_completed() -> bool:
            views = [httpx.get(f"{stack.url}/v1/jobs/{i}", timeout=30).json() for i in ids]
            return all(v["status"] == "completed" for v in views)

        wait_for(all_completed, 90, interval_s=0.5, message="every queued job to complete")
    finally:
        stack.close()


def test_redis_restart(outage_stack: Stack) -> None:
    stack = outage_stack
    expected = _reference(stack)
    outage: dict[str, Any] = {}

    def restart_redis() -> None:
        stack.redis.stop()
        with pytest.raises(openai.APIStatusError) as err:
            stack.client(timeout=20).completions.create(model=MODEL_NAME, prompt="during", max_tokens=2)
        outage["status"], outage["code"] = err.value.status_code, err.value.code
        stack.redis.start()

    chunks = _stream(stack, restart_redis)
    assert outage == {"status": 503, "code": "store_unavailable"}
    last = chunks[-1]
    if last == "[DONE]":
        # The worker held its events through the outage; the gateway resubscribed and read the rest.
        assert text_of(chunks) == expected
    else:
        # Otherwise the stream ends with an explicit error event, never silently short.
        assert isinstance(last, dict) and last["error"]["code"] in ("events_lost", "store_unavailable")
    _serves_again(stack)
