"""Hostile input answers 4xx in OpenAI's error shape, at a gateway with and without the model.

Bodies are raw JSON so they can carry what a client library would refuse to send: lone UTF-16
surrogates (``"\\ud800"`` decodes to a Python str that cannot be encoded as UTF-8), negative or huge
token ids, deep nesting.
"""

from __future__ import annotations

import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from harness.stack import ServiceProcess
from services.gateway import errors
from tests.services.conftest import ExtraGateway
from tests.services.stack import MODEL_NAME, Stack

pytestmark = pytest.mark.timeout(300)

M = f'"model": "{MODEL_NAME}"'
LONE = '"a\\ud800b"'
HOSTILE: list[tuple[str, str]] = [
    ("/v1/completions", f'{{{M}, "prompt": {LONE}, "max_tokens": 1}}'),
    ("/v1/completions", f'{{"model": {LONE}, "prompt": "hi", "max_tokens": 1}}'),
    ("/v1/completions", f'{{{M}, "prompt": "hi", "user": {LONE}, "max_tokens": 1}}'),
    ("/v1/completions", f'{{{M}, "prompt": "hi", "stop": [{LONE}], "max_tokens": 1}}'),
    ("/v1/completions", f'{{{M}, "prompt": "hi", "session_id": {LONE}, "max_tokens": 1}}'),
    ("/v1/completions", f'{{{M}, "prompt": "hi", "logit_bias": {{{LONE}: 1}}, "max_tokens": 1}}'),
    ("/v1/completions", f'{{{M}, "prompt": [{LONE}], "max_tokens": 1}}'),
    ("/v1/completions", f'{{{M}, "prompt": [[-1]], "max_tokens": 1}}'),
    ("/v1/completions", f'{{{M}, "prompt": [[1, 2147483648]], "max_tokens": 1}}'),
    ("/v1/completions", f'{{{M}, "prompt": [[]], "max_tokens": 1}}'),
    ("/v1/completions", f'{{{M}, "prompt": {"[" * 50_000}1{"]" * 50_000}}}'),
    ("/v1/chat/completions", f'{{{M}, "messages": [{{"role": "user", "content": {LONE}}}]}}'),
    ("/v1/chat/completions", f'{{{M}, "messages": [{{"role": "user", "name": {LONE}, "content": "x"}}]}}'),
    (
        "/v1/chat/completions",
        f'{{{M}, "messages": [{{"role": "user", "content": [{{"type": "text", "text": {LONE}}}]}}]}}',
    ),
    ("/v1/chat/completions", f'{{{M}, "messages": [{{"role": {LONE}, "content": "x"}}]}}'),
    ("/v1/jobs", f'{{"endpoint": "/v1/completions", "body": {{{M}, "prompt": {LONE}}}}}'),
    ("/v1/jobs", f'{{"endpoint": "/v1/completions", "body": {{{M}, "prompt": [[-1]]}}}}'),
    (
        "/v1/jobs",
        f'{{"endpoint": "/v1/completions", "body": {{{M}, "prompt": "x"}}, "metadata": {{"k": {LONE}}}}}',
    ),
    ("/v1/jobs", f'{{"endpoint": {LONE}, "body": {{}}}}'),
]


@pytest.fixture(scope="module")
def text_gateway(extra_gateway: ExtraGateway) -> ServiceProcess:
    return extra_gateway(INFLIGHT_MODEL="")


def _post(url: str, path: str, body: str) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{url}{path}", content=body.encode(), headers=headers, timeout=60)


def _check(url: str, path: str, body: str) -> None:
    resp = _post(url, path, body)
    assert 400 <= resp.status_code < 500, (path, body[:200], resp.status_code, resp.text[:300])
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], resp.text[:300]


@pytest.mark.parametrize(("path", "body"), HOSTILE, ids=[f"{p}:{b[:60]}" for p, b in HOSTILE])
def test_hostile_bodies_answer_4xx(stack: Stack, text_gateway: ServiceProcess, path: str, body: str) -> None:
    _check(stack.url, path, body)
    _check(text_gateway.url, path, body)


def test_a_token_id_beyond_the_vocabulary_is_the_inputs_fault(text_gateway: ServiceProcess) -> None:
    # A gateway without the model cannot know the vocabulary: the worker's engine refuses the id, and
    # that is answered as the input's fault (400), not an engine error (500).
    resp = _post(text_gateway.url, "/v1/completions", f'{{{M}, "prompt": [1000000000], "max_tokens": 1}}')
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "invalid_value"


def test_unhandled_errors_are_openai_shaped() -> None:
    # The catch-all as installed on the gateway: an error no handler foresaw is still OpenAI's JSON.
    app = FastAPI()
    errors.install(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("not foreseen")

    resp = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert resp.status_code == 500
    assert resp.json()["error"] == {
        "message": "the server failed to handle this request",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }


def test_bodies_over_the_producer_default_are_served(stack: Stack, text_gateway: ServiceProcess) -> None:
    # 2 MiB: over aiokafka's default 1 MiB max_request_size, under the 4 MiB body limit. It used to be a
    # 503 after the 5 s produce timeout. The tokenizing gateway refuses it itself (longer than the
    # context); the other one sends it through the broker and the worker refuses it: both 400.
    body = f'{{{M}, "prompt": "{"hello " * 350_000}", "max_tokens": 1}}'
    for url in (stack.url, text_gateway.url):
        start = time.monotonic()
        resp = _post(url, "/v1/completions", body)
        assert resp.status_code == 400, resp.text[:300]
        assert "maximum context length" in resp.json()["error"]["message"]
        assert time.monotonic() - start < 30
