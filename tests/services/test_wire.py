"""Wire messages: exact round trips, and loud rejection of what this build cannot read."""

from __future__ import annotations

import json

import pytest

from services.common.wire import (
    WIRE_VERSION,
    CancelMessage,
    DeltaEvent,
    DoneEvent,
    RequestMessage,
    WireError,
    decode_event,
    encode_event,
)


def _request() -> RequestMessage:
    return RequestMessage(
        id="cmpl-1",
        kind="chat",
        model="tiny",
        prompt_token_ids=[0, 5, 9],
        params={"n": 1, "temperature": 0.0, "max_tokens": 4},
        created=1700000000.5,
        priority=2,
        job=True,
    )


def test_request_round_trip() -> None:
    msg = _request()
    raw = msg.encode()
    assert json.loads(raw)["v"] == WIRE_VERSION
    assert RequestMessage.decode(raw) == msg


def test_text_request_round_trip() -> None:
    msg = RequestMessage("c", "completion", "m", [], {}, 1.0, prompt="hello")
    assert RequestMessage.decode(msg.encode()) == msg


def test_events_round_trip() -> None:
    delta = DeltaEvent("r", 3, 1, [7, 8], "ab", "stop", "</s>", [[[7, -0.1], [2, -2.5]]], "w1")
    done = DoneEvent("r", 4, "completed", prompt_tokens=3, completion_tokens=2, worker="w1")
    assert decode_event(encode_event(delta)) == delta
    assert decode_event(encode_event(done)) == done
    assert CancelMessage.decode(CancelMessage("r").encode()) == CancelMessage("r")


@pytest.mark.parametrize("version", [0, 2, "1", None])
def test_unknown_versions_are_rejected(version: object) -> None:
    body = json.loads(_request().encode())
    body["v"] = version
    with pytest.raises(WireError, match="unsupported wire version"):
        RequestMessage.decode(json.dumps(body))
    event = json.loads(encode_event(DoneEvent("r", 1, "completed")))
    event["v"] = version
    with pytest.raises(WireError, match="unsupported wire version"):
        decode_event(json.dumps(event))


@pytest.mark.parametrize(
    "mutation",
    [
        {"type": "delta"},
        {"kind": "embedding"},
        {"prompt_token_ids": ["a"]},
        {"prompt_token_ids": [True]},
        {"id": 5},
        {"params": []},
    ],
)
def test_malformed_requests_are_rejected(mutation: dict[str, object]) -> None:
    body = {**json.loads(_request().encode()), **mutation}
    with pytest.raises(WireError):
        RequestMessage.decode(json.dumps(body))


def test_garbage_is_rejected() -> None:
    for raw in (b"", b"\xff\xfe", b"[1, 2]", b"not json"):
        with pytest.raises(WireError):
            RequestMessage.decode(raw)
    with pytest.raises(WireError, match="non-terminal"):
        decode_event(json.dumps({"v": 1, "type": "done", "id": "r", "seq": 1, "status": "queued"}))
