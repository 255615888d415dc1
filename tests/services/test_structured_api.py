"""Structured outputs and tool calls through the whole service path, with the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from aiokafka.structs import TopicPartition

from harness.stack import TANSU_FETCH_WAIT_MS
from services.common.kafka import make_probe
from services.common.settings import Settings
from tests.services.stack import MODEL_NAME, Stack, wait_for

pytestmark = pytest.mark.timeout(180)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "coastal": {"type": "boolean"}},
            "required": ["lat", "coastal"],
        },
    },
    "required": ["city", "unit", "where"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": SCHEMA},
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
PROMPTS = ["What is the weather like?", "Tell me about Paris", "Give me JSON", "Numbers please"]


def _chat(prompt: str) -> list[Any]:
    return [{"role": "user", "content": prompt}]


def test_json_schema_and_json_object_always_validate(stack: Stack) -> None:
    client = stack.client()
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    finished = 0
    for i, prompt in enumerate(PROMPTS):
        resp = client.chat.completions.create(
            model=MODEL_NAME,
            messages=_chat(prompt),
            response_format=fmt,
            temperature=1.0,
            n=2,
            max_tokens=300,
            seed=i,
        )
        for c in resp.choices:
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.message.content or ""), SCHEMA)
                finished += 1
    assert finished >= 6
    resp = client.chat.completions.create(
        model=MODEL_NAME,
        messages=_chat("hi"),
        response_format={"type": "json_object"},
        max_tokens=300,
        seed=1,
    )
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content or ""), dict)
    # Completions take the same field, and vLLM's guided_* ones.
    comp = client.completions.create(
        model=MODEL_NAME, prompt="Weather:", max_tokens=300, seed=2, extra_body={"response_format": fmt}
    )
    if comp.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(comp.choices[0].text), SCHEMA)
    comp = client.completions.create(
        model=MODEL_NAME, prompt="Pick:", max_tokens=20, extra_body={"guided_choice": ["left", "right"]}
    )
    assert comp.choices[0].text in ("left", "right")
    comp = client.completions.create(
        model=MODEL_NAME, prompt="Code:", max_tokens=20, extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"}
    )
    assert len(comp.choices[0].text) == 6 and comp.choices[0].text[2] == "-"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_tool_calls_parse_and_match_the_schema(stack: Stack, choice: Any) -> None:
    client = stack.client()
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    calls = 0
    for i, prompt in enumerate(PROMPTS[:3]):
        resp = client.chat.completions.create(
            model=MODEL_NAME, messages=_chat(prompt), tools=TOOLS, tool_choice=choice, max_tokens=300, seed=i
        )
        c = resp.choices[0]
        if c.finish_reason == "length":
            continue
        assert c.finish_reason == "tool_calls"
        (call,) = c.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(choice, dict):
            assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
        calls += 1
    assert calls >= 2


def test_streamed_tool_call_reassembles_into_the_whole_one(stack: Stack) -> None:
    client = stack.client()
    kwargs: Any = dict(
        model=MODEL_NAME,
        messages=_chat("weather?"),
        tools=TOOLS,
        tool_choice="required",
        max_tokens=300,
        seed=5,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    name, args, ids, finish = "", "", set(), None
    for chunk in chunks:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                assert d.index == 0
                ids.add(d.id) if d.id else None
                if d.function is not None:
                    name += d.function.name or ""
                    args += d.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls or []
    assert (name, json.loads(args)) == (call.function.name, json.loads(call.function.arguments))
    assert len(ids) == 1
    assert sum(1 for ch in chunks for c in ch.choices for _ in c.delta.tool_calls or []) > 2  # fragments


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_regex": "((("}, "guided_regex"),
        # Past the gateway's check (EBNF syntax is the worker's): the engine's compile refuses it, off its
        # step loop, and the worker answers the same 400.
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, "tools"),
    ],
)
def test_bad_constraints_are_400_with_their_param(stack: Stack, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        stack.client().chat.completions.create(
            model=MODEL_NAME, messages=_chat("hi"), max_tokens=5, extra_body=extra
        )
    body: Any = err.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error"
    # Nothing harmed: the next request is served.
    ok = stack.client().chat.completions.create(model=MODEL_NAME, messages=_chat("hi"), max_tokens=3)
    assert ok.choices[0].finish_reason in ("length", "stop")


def _topic_ends(stack: Stack) -> dict[int, int]:
    """The end offset of each partition of the stack's request topic: what the gateway has produced."""

    async def ends() -> dict[int, int]:
        probe = make_probe(
            Settings(kafka_bootstrap=stack.kafka.address, kafka_fetch_max_wait_ms=TANSU_FETCH_WAIT_MS)
        )
        await probe.start()
        try:
            topic = stack.env["INFLIGHT_KAFKA_TOPIC"]
            parts = [TopicPartition(topic, p) for p in range(int(stack.env["INFLIGHT_KAFKA_PARTITIONS"]))]
            return {tp.partition: end for tp, end in (await probe.end_offsets(parts)).items()}
        finally:
            await probe.stop()

    return asyncio.run(ends())


UNSUPPORTED = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": UNSUPPORTED}}},
            "response_format",
            "uniqueItems",
        ),
        ({"guided_json": {"oneOf": [{"type": "integer"}, {"type": "string"}]}}, "guided_json", "oneOf"),
        ({"guided_regex": "(?=a)b"}, "guided_regex", "lookahead"),
        ({"guided_grammar": 'start ::= "a"'}, "guided_grammar", "root"),
        (
            {
                "tools": [
                    TOOLS[1],
                    {"type": "function", "function": {"name": "f", "parameters": UNSUPPORTED}},
                ],
                "tool_choice": "required",
            },
            "tools",
            "tools[1].function.parameters",
        ),
    ],
)
def test_unsupported_constraints_are_refused_before_anything_is_queued(
    stack: Stack, extra: dict[str, Any], param: str, says: str
) -> None:
    before = _topic_ends(stack)
    with pytest.raises(openai.BadRequestError) as err:
        stack.client().chat.completions.create(
            model=MODEL_NAME, messages=_chat("hi"), max_tokens=5, extra_body=extra
        )
    body: Any = err.value.body
    assert body["param"] == param and says in body["message"], body
    assert _topic_ends(stack) == before  # nothing was produced for it: no worker ever saw it
    # ... where an accepted request is produced (the check above can see one).
    stack.client().chat.completions.create(model=MODEL_NAME, messages=_chat("hi"), max_tokens=1)
    assert _topic_ends(stack) != before


def test_jobs_take_the_same_fields(stack: Stack) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": _chat("Numbers please"),
        "max_tokens": 300,
        "seed": 3,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "add"}},
    }
    resp = httpx.post(
        f"{stack.url}/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body}, timeout=30
    )
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]
    done = wait_for(
        lambda: (
            (j := httpx.get(f"{stack.url}/v1/jobs/{job_id}", timeout=30).json())["status"] == "completed"
            and j
        ),
        60,
        message="job done",
    )
    choice = done["result"]["choices"][0]
    # As the synchronous response answers it: tool_calls, no content, finish_reason tool_calls.
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "add"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOLS[1]["function"]["parameters"])
    # Its event stream, replayed, carries the same call.
    with httpx.stream("GET", f"{stack.url}/v1/jobs/{job_id}/events", timeout=30) as events:
        lines = [ln[6:] for ln in events.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    chunks = [json.loads(ln) for ln in lines]
    finish = [c["finish_reason"] for ch in chunks for c in ch["choices"] if c.get("finish_reason")]
    assert finish == ["tool_calls"]
    args = "".join(
        t["function"].get("arguments") or ""
        for ch in chunks
        for c in ch["choices"]
        for t in c["delta"].get("tool_calls") or []
    )
    assert json.loads(args) == json.loads(call["function"]["arguments"])
    bad = {"model": MODEL_NAME, "messages": _chat("hi"), "response_format": {"type": "yaml"}}
    resp = httpx.post(
        f"{stack.url}/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": bad}, timeout=30
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "response_format"


def test_auto_and_none_answer_text_and_a_call_round_trip_is_accepted(stack: Stack) -> None:
    client = stack.client()
    prompt_tokens = {}
    for choice in ("auto", "none"):
        resp = client.chat.completions.create(
            model=MODEL_NAME, messages=_chat("hi"), tools=TOOLS, tool_choice=choice, max_tokens=4, seed=1
        )
        c = resp.choices[0]
        assert c.message.tool_calls is None and c.finish_reason in ("length", "stop")
        assert resp.usage is not None
        prompt_tokens[choice] = resp.usage.prompt_tokens
    assert prompt_tokens["auto"] > prompt_tokens["none"] + 50  # auto lists the tools in the prompt
    # The conversation after a call: the assistant's tool_calls and the tool's answer go back in.
    history: Any = [
        {"role": "user", "content": "add 2 and 3"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=4)
    assert resp.choices[0].finish_reason in ("length", "stop")


# Under auto the model's text is free; a regex makes it write a Hermes call, so the parser's path is
# exercised whatever the tiny model would say.
HERMES_CALL = r'<tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'


def test_auto_answers_a_hermes_call_as_tool_calls(stack: Stack) -> None:
    client = stack.client()
    kwargs: Any = {
        "model": MODEL_NAME,
        "messages": _chat("add two numbers"),
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 60,
        "seed": 5,
        "extra_body": {"guided_regex": r"Sure\. " + HERMES_CALL},
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure."
    (call,) = whole.message.tool_calls or []
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])
    content, args, finish, names = "", "", None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                # The call's first delta names it; the next ones carry fragments of its arguments.
                assert d.function is not None and d.index == 0
                names += [d.function.name] if d.function.name else []
                args += d.function.arguments or ""
            assert "<tool" not in (c.delta.content or "")  # the marker never leaks as content
    assert finish == "tool_calls" and content.strip() == "Sure." and names == ["add"]
    assert json.loads(args) == json.loads(call.function.arguments)  # same seed: the same call
