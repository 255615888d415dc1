"""One list of sampling fields: the wire type is ``SamplingParams`` plus a codec derived from its
annotations, so a field added to the engine travels without touching the wire module."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput
from services.common import wire_sampling
from services.common.wire_sampling import SAMPLING_VERSION, SamplingWireError, WireSampling


def test_the_wire_fields_are_the_engines() -> None:
    assert WireSampling.__mro__[1] is SamplingParams
    assert [f.name for f in dataclasses.fields(WireSampling)] == [
        f.name for f in dataclasses.fields(SamplingParams)
    ]
    assert list(wire_sampling._CODECS) == [f.name for f in dataclasses.fields(SamplingParams)]


def test_every_field_round_trips_through_json() -> None:
    params = SamplingParams(
        n=2,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        min_p=0.1,
        seed=9,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        max_tokens=20,
        min_tokens=2,
        stop=["x", "yz"],
        stop_token_ids=[5, 6],
        ignore_eos=True,
        logprobs=2,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        structured=StructuredOutput("regex", "[ab]+", "response_format"),
        logit_bias={5: 1.5, 9: -100.0},
        prompt_logprobs=3,
    )
    defaults = SamplingParams()
    # Every field differs from its default here, so a field the codec dropped would show.
    assert [
        f.name for f in dataclasses.fields(params) if getattr(params, f.name) == getattr(defaults, f.name)
    ] == []
    body = json.loads(json.dumps(WireSampling.from_params(params).to_json()))
    assert body["v"] == SAMPLING_VERSION
    assert body["structured"] == {"kind": "regex", "value": "[ab]+", "param": "response_format"}
    decoded = WireSampling.from_json(body)
    assert decoded.to_params() == params and type(decoded.to_params()) is SamplingParams


def test_fields_at_their_default_stay_off_the_wire() -> None:
    """A worker of an older build refuses fields it does not know: a field added since reaches it only
    when a request sets it."""
    assert WireSampling().to_json() == {"v": SAMPLING_VERSION}
    body = WireSampling(max_tokens=7, stop=["\n"]).to_json()
    assert body == {"v": SAMPLING_VERSION, "max_tokens": 7, "stop": ["\n"]}
    assert WireSampling.from_json(body) == WireSampling(max_tokens=7, stop=["\n"])
    # max_tokens' default is 16; an explicit null (no limit) differs from it and travels.
    assert WireSampling(max_tokens=None).to_json() == {"v": SAMPLING_VERSION, "max_tokens": None}


def test_codecs_follow_the_annotation() -> None:
    # A logit_bias-like field: JSON object keys are strings, the engine's are token ids.
    bias = wire_sampling._codec(dict[int, float] | None)
    assert bias.decode("logit_bias", {"50256": -100, "7": 1.5}) == {50256: -100.0, 7: 1.5}
    assert bias.decode("logit_bias", None) is None
    assert json.loads(json.dumps(bias.encode({50256: -100.0}))) == {"50256": -100.0}
    with pytest.raises(SamplingWireError, match="wrong type"):
        bias.decode("logit_bias", {"eos": 1.0})
    with pytest.raises(SamplingWireError, match="wrong type"):
        wire_sampling._codec(int).decode("top_k", None)  # not nullable
    with pytest.raises(SamplingWireError, match="wrong type"):
        wire_sampling._codec(float).decode("temperature", True)  # a bool is no number here
    assert wire_sampling._codec(float).decode("temperature", 1) == 1.0
    with pytest.raises(TypeError, match="no wire codec"):
        wire_sampling._codec(set[int])  # an unsupported field fails the import, not a request
