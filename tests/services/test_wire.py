"""Wire messages: exact round trips, and loud rejection of what this build cannot read."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine.sampling_params import SamplingParams
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
from services.common.wire_sampling import SAMPLING_VERSION, WireSampling


def _request() -> RequestMessage:
    return RequestMessage(
        id="cmpl-1",
        kind="chat",
        model="tiny",
        prompt_token_ids=[0, 5, 9],
        params=WireSampling(n=2, temperature=0.0, max_tokens=4, stop=["\n"], seed=7, logprobs=3),
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
    msg = RequestMessage("c", "completion", "m", [], WireSampling(), 1.0, prompt="hello")
    assert RequestMessage.decode(msg.encode()) == msg
    chat = RequestMessage(
        "c", "chat", "m", [], WireSampling(), 1.0, messages=[{"role": "user", "content": "hi"}]
    )
    for add in (True, False):
        again = RequestMessage.decode(dataclasses.replace(chat, add_generation_prompt=add).encode())
        assert again.add_generation_prompt is add


def test_stream_flag_round_trips_and_defaults_to_streaming() -> None:
    msg = _request()
    for stream in (True, False):
        assert RequestMessage.decode(dataclasses.replace(msg, stream=stream).encode()).stream is stream
    older = json.loads(msg.encode())
    del older["stream"]  # a message from a gateway that predates the field
    assert RequestMessage.decode(json.dumps(older)).stream is True  # token by token, as it was


def test_every_sampling_field_is_named_on_the_wire() -> None:
    """A field added to SamplingParams must be added to the wire schema on purpose (and the version
    bumped if old readers would misread it): this fails until it is."""
    engine_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert {f.name for f in dataclasses.fields(WireSampling)} == engine_fields
    params = SamplingParams(n=3, temperature=0.5, top_k=4, seed=9, stop=["x"], stop_token_ids=[5], logprobs=2)
    assert WireSampling.from_params(params).to_params() == params


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"v": SAMPLING_VERSION + 1}, "sampling schema version"),
        ({"v": SAMPLING_VERSION, "best_of": 2}, "unknown sampling fields"),
        ({"v": SAMPLING_VERSION, "n": True}, "wrong type"),
        ({"v": SAMPLING_VERSION, "max_tokens": 1.5}, "wrong type"),
        ({"v": SAMPLING_VERSION, "stop": ["ok", 3]}, "wrong type"),
        ({"v": SAMPLING_VERSION, "temperature": -1}, "temperature must be non-negative"),
        ({"n": 1}, "sampling schema version"),
    ],
)
def test_bad_sampling_settings_are_rejected(params: dict[str, object], match: str) -> None:
    body = {**json.loads(_request().encode()), "params": params}
    with pytest.raises(WireError, match=match):
        RequestMessage.decode(json.dumps(body))


def test_events_round_trip() -> None:
    delta = DeltaEvent("r", 3, 1, [7, 8], "ab", "stop", "</s>", [[[7, -0.1], [2, -2.5]]], "w1")
    done = DoneEvent("r", 4, "completed", prompt_tokens=3, completion_tokens=2, worker="w1")
    assert decode_event(encode_event(delta)) == delta
    assert decode_event(encode_event(done)) == done
    assert CancelMessage.decode(CancelMessage("r").encode()) == CancelMessage("r")


@pytest.mark.parametrize(
    "event",
    [
        DeltaEvent("r", 1, 0, [7], 'é 😀 "q" \\ \n\x00', worker="w1"),
        DeltaEvent("r", 1, 0, [7], "a\ud800b"),  # a lone surrogate: only json's escapes carry it
        DeltaEvent("r", 1, 0, [7], "x", logprobs=[[[7, float("-inf")], [2, -0.5]]]),  # -Infinity stays
        DoneEvent("r", 2, "failed", error="ü broke", code="engine_error", param="messages"),
    ],
)
def test_events_round_trip_whichever_encoder_wrote_them(event: DeltaEvent | DoneEvent) -> None:
    assert decode_event(encode_event(event)) == event
    # What json writes (ASCII escapes) reads the same: a worker and gateway of other encoders agree.
    as_json = json.dumps({"v": 1, "type": event.type, **vars(event)}, separators=(",", ":"))
    assert decode_event(as_json) == event
    assert json.loads(encode_event(event)) == json.loads(as_json)


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


def test_deadline_round_trips_and_is_optional_both_ways() -> None:
    with_deadline = dataclasses.replace(_request(), deadline=1700000030.25)
    assert RequestMessage.decode(with_deadline.encode()) == with_deadline
    # Without one the field is left out, so a worker of an older build reads the message as before;
    # and a message from an older gateway decodes as "no deadline".
    assert "deadline" not in json.loads(_request().encode())
    assert RequestMessage.decode(_request().encode()).deadline is None


@pytest.mark.parametrize("value", [0, -5, "soon", True, [1]])
def test_a_malformed_deadline_is_rejected(value: object) -> None:
    body = {**json.loads(_request().encode()), "deadline": value}
    with pytest.raises(WireError, match="deadline"):
        RequestMessage.decode(json.dumps(body))
