"""What a keyed gateway keeps closed and bounded: metrics and API docs behind the key, the live feed's
viewer cap and its one Redis subscription, the per-key job quota, metadata sizes, and a 2 MiB body
carried through the real broker.

One gateway for the module: API keys on, no checkpoint (it forwards text, so a large prompt reaches the
worker through Kafka instead of being refused at the gateway's tokenizer), small caps. It sits on the
paced stack, so a job of 1,500 tokens stays unfinished (at least 30 s) until the test cancels it, on any
host: the quota counts it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from harness.stack import ServiceProcess
from services.common.live_wire import LIVE_CHANNEL
from tests.services.conftest import ExtraGateway
from tests.services.stack import MODEL_NAME, Stack, wait_for

pytestmark = pytest.mark.timeout(120)

ALICE = {"Authorization": "Bearer alice-key"}
BOB = {"Authorization": "Bearer bob-key"}


@pytest.fixture(scope="module")
def gateway(paced_gateway: ExtraGateway) -> ServiceProcess:
    return paced_gateway(
        INFLIGHT_MODEL="",
        INFLIGHT_API_KEYS="alice-key,bob-key",
        INFLIGHT_MAX_LIVE_VIEWERS="2",
        INFLIGHT_MAX_JOBS_PER_KEY="2",
    )


def test_metrics_and_docs_need_the_key(gateway: ServiceProcess) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/v1/live/events"):
            resp = http.get(path)
            assert resp.status_code == 401, (path, resp.text)
            assert resp.json()["error"]["code"] == "invalid_api_key"
            assert http.get(path, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert "inflight:gateway_responses_total" in http.get("/metrics", headers=ALICE).text
        assert "/v1/chat/completions" in http.get("/openapi.json", headers=ALICE).json()["paths"]
        assert "swagger" in http.get("/docs", headers=ALICE).text.lower()
        assert "redoc" in http.get("/redoc", headers=ALICE).text.lower()
        # Probes and the page itself stay open (the kubelet and a browser's first load have no key).
        assert http.get("/healthz").status_code == 200
        assert http.get("/").status_code == 200
    # Started without a checkpoint: the model's context length is unknown here, said without a traceback.
    log = gateway.tail_log(20_000)
    assert "max_model_len unknown" in log and "Traceback" not in log


def test_live_viewers_share_one_subscription_up_to_the_cap(stack: Stack, gateway: ServiceProcess) -> None:
    redis = stack.redis_client()

    def subscribers() -> int:
        return int(redis.pubsub_numsub(LIVE_CHANNEL)[0][1])

    url = f"{gateway.url}/v1/live/events"
    before = subscribers()  # other gateways of the session with viewers of their own: none expected
    with ExitStack() as viewers:
        streams = [
            viewers.enter_context(httpx.stream("GET", url, headers=ALICE, timeout=60)) for _ in range(2)
        ]
        lines = [resp.iter_lines() for resp in streams]
        assert [resp.status_code for resp in streams] == [200, 200]
        assert [next(it) for it in lines] == [": live", ": live"]
        # Two viewers, one Redis subscription between them.
        wait_for(lambda: subscribers() == before + 1, 30, message="one live subscription")
        over = httpx.get(url, headers=ALICE, timeout=30)
        assert over.status_code == 429
        assert over.json()["error"]["code"] == "rate_limit_exceeded" and over.headers["retry-after"]
        # Both viewers see what a worker publishes (the shared stack's worker publishes too: skip those).
        steps = '{"v":1,"worker":"w-limits","t":1.0,"running":0,"waiting":0,"kv_usage":0.0,"steps":[]}'
        got: list[str] = []

        def read(it: Iterator[str]) -> None:
            with contextlib.suppress(httpx.HTTPError):  # closed when the test leaves the block
                for line in it:
                    if line.startswith("data: ") and "w-limits" in line:
                        got.append(line)
                        return

        for it in lines:
            threading.Thread(target=read, args=(it,), daemon=True).start()
        wait_for(lambda: redis.publish(LIVE_CHANNEL, steps) >= 0 and len(got) >= 2, 30, interval_s=0.5)
    # The viewers left: the subscription ends, and a new viewer is welcome again.
    wait_for(lambda: subscribers() == before, 30, message="the live subscription to end")
    with httpx.stream("GET", url, headers=ALICE, timeout=30) as again:
        assert again.status_code == 200


def _job(http: httpx.Client, headers: dict[str, str], **extra: object) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "Count slowly:", "max_tokens": 1500, "ignore_eos": True}
    return http.post("/v1/jobs", json={"endpoint": "/v1/completions", "body": body, **extra}, headers=headers)


def _cancel(http: httpx.Client, headers: dict[str, str], job_id: str) -> None:
    """Cancels a job and waits until it counts as finished: the per-key quota counts a job until its
    record says so, and the next test of this module starts from a free quota."""
    assert http.delete(f"/v1/jobs/{job_id}", headers=headers).status_code == 200
    wait_for(
        lambda: http.get(f"/v1/jobs/{job_id}", headers=headers).json()["status"] == "cancelled",
        30,
        message=f"job {job_id} cancelled",
    )


def test_unfinished_jobs_per_key_are_capped(gateway: ServiceProcess) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        first = [_job(http, ALICE) for _ in range(2)]
        assert [r.status_code for r in first] == [202, 202], first[-1].text
        refused = _job(http, ALICE)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        bob = _job(http, BOB)  # another key has its own quota
        assert bob.status_code == 202
        # Finished jobs (here: cancelled) leave the quota.
        _cancel(http, ALICE, first[0].json()["id"])
        _cancel(http, BOB, bob.json()["id"])
        again = _job(http, ALICE)
        assert again.status_code == 202, again.text
        for resp in (first[1], again):
            _cancel(http, ALICE, resp.json()["id"])


def test_metadata_values_are_bounded(gateway: ServiceProcess) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        resp = _job(http, ALICE, metadata={"note": "x" * 513})
        assert resp.status_code == 422
        error = resp.json()["error"]
        assert error["code"] == "invalid_value" and error["param"].startswith("metadata")
        assert _job(http, ALICE, metadata={"k" * 65: "v"}).status_code == 422
        ok = _job(http, ALICE, metadata={"note": "x" * 512})
        assert ok.status_code == 202
        assert http.get(f"/v1/jobs/{ok.json()['id']}", headers=ALICE).json()["metadata"] == {
            "note": "x" * 512
        }
        _cancel(http, ALICE, ok.json()["id"])


def test_a_2_mib_body_goes_through_the_broker(gateway: ServiceProcess) -> None:
    # 2 MiB of prompt text: over Kafka's usual 1 MiB message default, under the 4 MiB body limit. This
    # gateway has no tokenizer, so the text travels in the Kafka message and the worker tokenizes it: its
    # answer (too long for the tiny model) proves the message was produced and consumed, not refused.
    body = {"model": MODEL_NAME, "prompt": "word " * (2 * 1024 * 1024 // 5), "max_tokens": 4}
    resp = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=ALICE, timeout=90)
    assert resp.status_code == 400, resp.text
    assert "maximum context length" in resp.json()["error"]["message"]
