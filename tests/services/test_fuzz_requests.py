"""A hypothesis fuzzer over the request models: unicode edge cases, type confusion and nested shapes.

schemathesis (test_schemathesis.py) draws bodies from the published schema; this draws them from what
hostile or sloppy clients send: lone surrogates, NUL, bidi overrides, template syntax, special-token
text, NaN, huge and negative numbers, objects where strings belong, deep nesting. Every answer must
be below 500, in OpenAI's error shape when it is an error, and a stream must not end in a server
error either. ``INFLIGHT_FUZZ_EXAMPLES`` sets the budget: small in ``make test``, large in ``make fuzz``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.services.conftest import ExtraGateway
from tests.services.stack import MODEL_NAME

EXAMPLES = int(os.environ.get("INFLIGHT_FUZZ_EXAMPLES", "25"))
pytestmark = pytest.mark.timeout(120 + 6 * EXAMPLES)

EDGE_CHARS = [
    "\ud800", "\udfff", "\x00", "\x7f", "\u202e", "\ufeff", "\uffff", "\u2028", "\U0001f600", "e\u0301",
    '"', "\\", "\n", "{{ x }}", "{% raw %}", "<s>", "</s>", "<|endoftext|>", "<|im_start|>", "\U0010ffff",
]  # fmt: skip
weird_text = st.lists(st.sampled_from(EDGE_CHARS) | st.text(max_size=4), max_size=6).map("".join)
weird_int = st.sampled_from([-1, 0, 1, 2**31 - 1, 2**31, 2**63, -(2**63) - 1, 10**30])
scalars = st.none() | st.booleans() | weird_int | st.floats() | weird_text
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(weird_text, inner, max_size=3),
    max_leaves=12,
)
# Deep nesting a parser or validator could recurse on.
deep = st.integers(1, 3000).map(lambda depth: json.loads("[" * depth + "1" + "]" * depth))


def field(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a value of the right type, sometimes anything at all."""
    return st.one_of(plausible, plausible, plausible, json_values)


token_ids = st.lists(st.integers(0, 1100) | weird_int, min_size=0, max_size=8)
SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": field(st.integers(1, 4)),
    "n": field(st.integers(1, 3)),
    "temperature": field(st.floats(0, 3) | st.sampled_from([float("nan"), float("inf"), -0.5])),
    "top_p": field(st.floats(0, 1)),
    "top_k": field(st.integers(-2, 50)),
    "seed": field(st.integers(-5, 2**63)),
    "stop": field(weird_text | st.lists(weird_text, max_size=20)),
    "stop_token_ids": field(token_ids),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "user": field(weird_text),
    "session_id": field(weird_text),
    "logit_bias": field(st.dictionaries(weird_text, st.floats(-100, 100), max_size=2)),
    "presence_penalty": field(st.floats(-3, 3)),
    "min_tokens": field(st.integers(0, 8)),
    "ignore_eos": field(st.booleans()),
    "priority": field(weird_int),
}
COMPLETION: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.one_of(
        weird_text,
        token_ids,
        st.lists(weird_text, max_size=2),
        st.lists(token_ids, max_size=2),
        json_values,
        deep,
    ),
    "logprobs": field(st.integers(0, 21)),
    "echo": field(st.booleans()),
    "suffix": field(weird_text),
    "best_of": field(st.integers(0, 3)),
}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]) | weird_text},
    optional={
        "content": field(
            weird_text
            | st.none()
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": weird_text}), max_size=2)
        ),
        "name": field(weird_text),
    },
)
CHAT: dict[str, st.SearchStrategy[Any]] = {
    "messages": field(st.lists(message, max_size=3)),
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(0, 21)),
    "max_completion_tokens": field(st.integers(1, 4)),
    "tools": field(st.lists(st.just({"type": "function"}), max_size=1)),
    "response_format": field(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
}


def body(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    model = st.sampled_from([MODEL_NAME] * 6) | weird_text | json_values
    return st.fixed_dictionaries({"model": model}, optional={**SAMPLING, **fields})


requests = st.one_of(
    st.tuples(st.just("/v1/completions"), body(COMPLETION)),
    st.tuples(st.just("/v1/chat/completions"), body(CHAT)),
    st.tuples(
        st.just("/v1/jobs"),
        st.fixed_dictionaries(
            {
                "endpoint": st.sampled_from(["/v1/completions", "/v1/chat/completions"]) | weird_text,
                "body": body(COMPLETION) | body(CHAT) | json_values,
            },
            optional={"metadata": field(st.dictionaries(weird_text, weird_text, max_size=3))},
        ),
    ),
    st.tuples(st.just("/v1/completions"), json_values),  # not even an object
)


@pytest.fixture(scope="module")
def gateways(extra_gateway: ExtraGateway) -> list[str]:
    # One gateway that tokenizes (context capped so valid requests finish fast), one without the model.
    tokenizing = extra_gateway(INFLIGHT_MAX_MODEL_LEN="64")
    text_only = extra_gateway(INFLIGHT_MODEL="", INFLIGHT_MAX_MODEL_LEN="64")
    return [tokenizing.url, text_only.url]


def _check_stream(text: str) -> None:
    for line in text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            error = event.get("error")
            assert error is None or error.get("type") != "server_error", line[:400]


def test_no_input_yields_a_server_error(gateways: list[str]) -> None:
    with httpx.Client(timeout=60) as http:

        @given(request=requests, which=st.integers(0, 1))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=os.environ.get("INFLIGHT_FUZZ_RANDOM") != "1",  # same cases each run unless asked
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(request: tuple[str, Any], which: int) -> None:
            path, obj = request
            raw = json.dumps(obj).encode()  # ASCII escapes: lone surrogates travel as \\ud800; NaN as NaN
            url = gateways[which]
            resp = http.post(f"{url}{path}", content=raw, headers={"Content-Type": "application/json"})
            assert resp.status_code < 500, (url, path, raw[:400], resp.status_code, resp.text[:400])
            if resp.status_code >= 400:
                assert set(resp.json()["error"]) >= {"message", "type", "param", "code"}, resp.text[:400]
            elif resp.headers.get("content-type", "").startswith("text/event-stream"):
                _check_stream(resp.text)

        check()
