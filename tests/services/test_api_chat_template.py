"""Tools rendered by the chat template itself and per-request ``chat_template_kwargs``, against a real
stack: a gateway on a copy of the tiny checkpoint whose template takes ``tools`` and ``enable_thinking``
(as Qwen3's does)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.tokenizer import load_tokenizer
from tests.services.conftest import ExtraGateway
from tests.services.stack import MODEL_NAME, Stack

pytestmark = pytest.mark.timeout(180)

TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t['function']['name'] }};"
    "{% endfor %}<|im_end|>\n{% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] + "
    "'\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think></think>' }}{% endif %}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def templated(model_path: Path, tmp_path_factory: pytest.TempPathFactory, extra_gateway: ExtraGateway) -> str:
    copy = tmp_path_factory.mktemp("templated") / "model"
    shutil.copytree(model_path, copy)
    (copy / "chat_template.jinja").write_text(TEMPLATE)
    return extra_gateway(INFLIGHT_MODEL=str(copy)).url


def _tokens(url: str, **body: Any) -> list[int]:
    resp = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES, **body}, timeout=30)
    assert resp.status_code == 200, resp.text
    return list(resp.json()["tokens"])


def _chat(url: str, **body: Any) -> httpx.Response:
    payload = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=60)


def test_tools_reach_a_template_that_renders_them(templated: str, model_path: Path) -> None:
    tokenizer = load_tokenizer(model_path)
    assert tokenizer is not None
    with_tools = _tokens(templated, tools=TOOLS)
    text = tokenizer.decode(with_tools, skip_special_tokens=False)
    # The template's own rendering, not the gateway's "You may call these functions" message.
    assert "TOOLS:get_weather;" in text and "You may call" not in text
    resp = _chat(templated, tools=TOOLS)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == len(with_tools)


def test_chat_template_kwargs(templated: str, stack: Stack) -> None:
    plain = _tokens(templated)
    no_think = _tokens(templated, chat_template_kwargs={"enable_thinking": False})
    assert len(no_think) > len(plain)
    resp = _chat(templated, chat_template_kwargs={"enable_thinking": False})
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == len(no_think)
    bad = _chat(templated, chat_template_kwargs={"add_generation_prompt": False})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    # The shared stack's gateway: its template ignores the variable, but applies it all the same.
    assert _chat(stack.url, chat_template_kwargs={"enable_thinking": False}).status_code == 200


def test_a_chat_template_setting_overrides_the_checkpoints(
    stack: Stack, tmp_path: Path, extra_gateway: ExtraGateway
) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}OVERRIDE {{ m['content'] }}\n{% endfor %}")
    url = extra_gateway(INFLIGHT_CHAT_TEMPLATE=str(template)).url
    tokens = _tokens(url)
    prompt = httpx.post(f"{url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert prompt == "OVERRIDE Weather in Paris?\n"
    resp = _chat(url)
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == len(tokens)
