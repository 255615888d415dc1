"""A bad prompt gets the same answer whichever edge prepares it: the gateway that holds the tokenizer
refuses it before Kafka, a gateway without the checkpoint forwards it and the worker refuses it. Both
answer with the same OpenAI error JSON (message, type, param, code), and the gateway reads the engine's
own context rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.config import EngineArgs, EngineConfig
from engine.models.tiny import default_model_path, write_tiny_checkpoint
from harness.stack import ServiceProcess
from services.common.settings import Settings
from services.gateway.prompts import load_model_info
from tests.services.conftest import ExtraGateway
from tests.services.stack import MODEL_NAME, Stack

pytestmark = pytest.mark.timeout(180)

MAX_LEN = 2048  # the tiny model's context, as both gateways and the worker read it

# (path, body, the field to blame): each refused with a 400 at both edges.
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"prompt": "", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [5, 5000], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [7] * (MAX_LEN + 10), "max_tokens": 4}, "prompt"),
    # Fits alone, not with what it asks for: the engine's own API would run it and stop at the context;
    # every OpenAI edge refuses it.
    ("/v1/completions", {"prompt": [7] * (MAX_LEN - 50), "max_tokens": 100}, "max_tokens"),
    ("/v1/completions", {"prompt": "word " * 3000, "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 3000}]}, "prompt"),
]


@pytest.fixture(scope="module")
def text_gateway(extra_gateway: ExtraGateway) -> ServiceProcess:
    return extra_gateway(INFLIGHT_MODEL="")


@pytest.mark.parametrize(
    ("path", "body", "param"), REFUSED, ids=[f"{p}:{str(b)[:40]}" for p, b, _ in REFUSED]
)
def test_each_edge_refuses_a_prompt_with_the_same_error(
    stack: Stack, text_gateway: ServiceProcess, path: str, body: dict[str, Any], param: str
) -> None:
    answers = []
    for url in (stack.url, text_gateway.url):
        resp = httpx.post(f"{url}{path}", json={"model": MODEL_NAME, **body}, timeout=60)
        assert resp.status_code == 400, (url, resp.text[:300])
        answers.append(resp.json()["error"])
    at_gateway, at_worker = answers
    assert at_gateway == at_worker
    assert at_gateway["param"] == param and at_gateway["code"] == "invalid_value"
    assert at_gateway["type"] == "invalid_request_error"


def test_both_edges_still_serve_after_refusals(stack: Stack, text_gateway: ServiceProcess) -> None:
    for url in (stack.url, text_gateway.url):
        body = {"model": MODEL_NAME, "prompt": [7] * (MAX_LEN - 50), "max_tokens": 50, "ignore_eos": True}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text[:300]
        assert resp.json()["usage"]["completion_tokens"] == 50


def test_the_gateway_reads_the_engines_context(tmp_path: Path) -> None:
    # A sliding window shorter than the positions bounds attention, not the context: the engine serves
    # max_position_embeddings, and so does the gateway's check; both refuse more than that.
    model = write_tiny_checkpoint(
        tmp_path / "mistral", arch="mistral", sliding_window=512, max_position_embeddings=1024
    )
    engine = EngineConfig.resolve(EngineArgs(model=str(model), attention_backend="torch"))
    assert load_model_info(Settings(model=str(model))).max_model_len == engine.max_model_len == 1024
    asked = Settings(model=str(model), engine_args={"max_model_len": 2048})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        load_model_info(asked)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        EngineConfig.resolve(EngineArgs(model=str(model), max_model_len=2048, attention_backend="torch"))
    plain = load_model_info(Settings(model=str(default_model_path()), max_model_len=64))
    assert plain.max_model_len == 64  # the gateway's own, smaller bound is still honoured
