"""The gateway's edges: API keys, body limits, probes and metrics, all answered in OpenAI's error shape."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from harness.stack import ServiceProcess
from tests.services.conftest import ExtraGateway
from tests.services.stack import MODEL_NAME, Stack

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def guarded(extra_gateway: ExtraGateway) -> ServiceProcess:
    return extra_gateway(INFLIGHT_API_KEYS="key-one,key-two", INFLIGHT_MAX_BODY_BYTES="4096")


def _client(gateway: ServiceProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_api_keys(guarded: ServiceProcess) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        _client(guarded, "wrong").models.list()
    assert err.value.code == "invalid_api_key"
    resp = httpx.get(f"{guarded.url}/v1/models", timeout=10)
    assert resp.status_code == 401
    assert resp.json()["error"]["type"] == "invalid_request_error"
    for key in ("key-one", "key-two"):
        out = _client(guarded, key).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        assert out.usage is not None and out.usage.completion_tokens == 2
    # Probes stay open: the kubelet has no key.
    assert httpx.get(f"{guarded.url}/healthz", timeout=10).status_code == 200


def test_body_too_large(guarded: ServiceProcess) -> None:
    headers = {"Authorization": "Bearer key-one"}
    body = {"model": MODEL_NAME, "prompt": "x" * 5000, "max_tokens": 1}
    resp = httpx.post(f"{guarded.url}/v1/completions", json=body, headers=headers, timeout=10)
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while streaming the body
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    resp = httpx.post(f"{guarded.url}/v1/completions", content=chunks(), headers=headers, timeout=10)
    assert resp.status_code == 413


def test_validation_errors_are_openai_shaped(stack: Stack) -> None:
    resp = httpx.post(
        f"{stack.url}/v1/chat/completions", json={"model": MODEL_NAME, "messages": []}, timeout=10
    )
    assert resp.status_code == 422
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    resp = httpx.post(f"{stack.url}/v1/completions", content=b"{not json", timeout=10)
    assert resp.status_code == 422


def test_probes_and_metrics(stack: Stack) -> None:
    ready = httpx.get(f"{stack.url}/readyz", timeout=10)
    assert ready.status_code == 200
    assert ready.json() == {"ready": True, "redis": True, "kafka": True, "workers": 1, "tasks": []}
    metrics = httpx.get(f"{stack.url}/metrics", timeout=10).text
    assert "inflight:gateway_responses_total" in metrics
    worker = stack.workers[0]
    assert httpx.get(f"{worker.url}/readyz", timeout=10).status_code == 200
    worker_metrics = httpx.get(f"{worker.url}/metrics", timeout=10).text
    # The engine's gauges, exported once (the worker's own copies of them are gone).
    assert 'inflight:kv_cache_usage_perc{model_name="tiny"}' in worker_metrics
    assert "inflight_worker_kv_usage" not in worker_metrics
