"""SLO deadlines on the wire: optional within version 1 (absent when unset, so an older reader sees the
message it knows), typed when present; the OpenAI request accepts them as extra fields."""

from __future__ import annotations

import dataclasses
import json

import pytest
from pydantic import ValidationError

from services.common.wire import RequestMessage, WireError
from services.common.wire_sampling import WireSampling
from services.gateway.protocol import ChatCompletionRequest


def _request(**kw: float | None) -> RequestMessage:
    return RequestMessage(
        id="cmpl-1",
        kind="completion",
        model="tiny",
        prompt_token_ids=[5, 6],
        params=WireSampling(max_tokens=4),
        created=1700000000.0,
        **kw,  # type: ignore[arg-type]
    )


def test_deadlines_round_trip() -> None:
    msg = _request(slo_ttft_ms=500.0, slo_tpot_ms=40)
    back = RequestMessage.decode(msg.encode())
    assert back == dataclasses.replace(msg, slo_tpot_ms=40.0)
    assert json.loads(msg.encode())["slo_ttft_ms"] == 500.0


def test_unset_deadlines_are_not_sent_and_decode_as_none() -> None:
    raw = _request().encode()
    assert not any(k.startswith("slo_") for k in json.loads(raw))
    assert RequestMessage.decode(raw).slo_ttft_ms is None


@pytest.mark.parametrize("bad", [0, -5, "500", True])
def test_bad_deadlines_are_rejected(bad: object) -> None:
    body = json.loads(_request().encode())
    body["slo_tpot_ms"] = bad
    with pytest.raises(WireError, match="slo_tpot_ms"):
        RequestMessage.decode(json.dumps(body))


def test_openai_request_takes_the_extra_fields() -> None:
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "slo_ttft_ms": 800, "slo_tpot_ms": 50}
    )
    assert (req.slo_ttft_ms, req.slo_tpot_ms) == (800, 50)
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "slo_ttft_ms": 0}
        )
