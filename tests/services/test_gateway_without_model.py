"""A gateway without the checkpoint (the chart's default): it forwards text, the worker tokenizes.

Results must be the same as through a gateway that tokenizes itself, and a prompt too long for the
model is still refused with a 400, by the worker this time.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from harness.stack import ServiceProcess
from tests.services.conftest import ExtraGateway
from tests.services.stack import MODEL_NAME, Stack

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def text_gateway(extra_gateway: ExtraGateway) -> ServiceProcess:
    return extra_gateway(INFLIGHT_MODEL="")


def test_same_results_as_a_tokenizing_gateway(stack: Stack, text_gateway: ServiceProcess) -> None:
    plain = openai.OpenAI(base_url=f"{text_gateway.url}/v1", api_key="x", max_retries=0, timeout=60)
    tokenizing = stack.client()
    kwargs = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}
    a, b = plain.completions.create(**kwargs), tokenizing.completions.create(**kwargs)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage == b.usage  # the worker reports the prompt's token count
    messages = [{"role": "user", "content": "Hello"}]
    chat_a = plain.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, seed=1)
    chat_b = tokenizing.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, seed=1)
    assert chat_a.choices[0].message.content == chat_b.choices[0].message.content


def test_too_long_prompt_is_refused_by_the_worker(text_gateway: ServiceProcess) -> None:
    body = {"model": MODEL_NAME, "prompt": "word " * 3000, "max_tokens": 10}
    resp = httpx.post(f"{text_gateway.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400
    assert "maximum context length" in resp.json()["error"]["message"]
