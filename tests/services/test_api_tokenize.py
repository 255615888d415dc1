"""``/tokenize`` and ``/detokenize`` in vLLM's shapes, and the checkpoint's generation_config.json sampling
defaults, against a real stack."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.tokenizer import load_tokenizer
from tests.services.conftest import ExtraGateway
from tests.services.stack import MODEL_NAME, Stack

pytestmark = pytest.mark.timeout(180)


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=30)


def test_tokenize_and_detokenize(stack: Stack, model_path: Path) -> None:
    tokenizer = load_tokenizer(model_path)
    assert tokenizer is not None
    text = "Hello there, tokenizer!"
    resp = _post(stack.url, "/tokenize", {"model": MODEL_NAME, "prompt": text, "return_token_strs": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] > 0
    assert body["token_strs"] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    bare = _post(stack.url, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert "token_strs" not in bare
    # A chat counts as the request would: the template's rendering, with the assistant's opening.
    messages = [{"role": "user", "content": "Hi"}]
    chat = _post(stack.url, "/tokenize", {"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    completion = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": messages, "max_tokens": 1},
        timeout=30,
    ).json()
    assert completion["usage"]["prompt_tokens"] == chat["count"]
    back = _post(stack.url, "/detokenize", {"model": MODEL_NAME, "tokens": bare["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
        ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
        ("/detokenize", {"tokens": [10**8]}, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "other"}, "model"),
    ],
)
def test_tokenize_refusals(stack: Stack, path: str, body: dict[str, Any], param: str) -> None:
    resp = _post(stack.url, path, body)
    assert resp.status_code in (400, 404, 422) and resp.json()["error"]["param"] == param


def test_generation_config_defaults_apply_unless_the_request_sets_them(
    stack: Stack, model_path: Path, tmp_path: Path, extra_gateway: ExtraGateway
) -> None:
    # The same checkpoint with a greedy default: every request that leaves temperature unset is greedy.
    copy = tmp_path / "model"
    shutil.copytree(model_path, copy)
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "top_k": 5}))
    gateway = extra_gateway(INFLIGHT_MODEL=str(copy))
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8}

    def text(url: str, **fields: Any) -> str:
        resp = _post(url, "/v1/completions", {**body, **fields})
        assert resp.status_code == 200, resp.text
        return str(resp.json()["choices"][0]["text"])

    greedy = text(stack.url, temperature=0)
    assert [text(gateway.url, seed=s) for s in (1, 2, 3)] == [greedy] * 3
    sampled = {text(gateway.url, seed=s, temperature=1.0, top_k=-1) for s in (1, 2, 3)}
    assert sampled != {greedy}
