"""The Hermes tool-call parser (services/gateway/tool_parser.py) whole and streamed, and the response builder
over it: a streamed answer reassembles into the whole one, whatever the chunking."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from services.common.wire import COMPLETED, DeltaEvent, DoneEvent
from services.gateway.responses import ResponseBuilder, chat_message
from services.gateway.tool_parser import CallDelta, ParsedCall, ToolCallStream, assemble, parse_tool_calls

ADD = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def test_a_whole_call_and_the_text_around_it() -> None:
    assert parse_tool_calls(ADD) == (None, [ParsedCall("add", '{"a": 1, "b": 2}')])
    content, calls = parse_tool_calls(f"Let me add.\n{ADD}\n{ADD.replace('add', 'sum')} done")
    assert content == "Let me add.\n\n done" and [c.name for c in calls] == ["add", "sum"]
    # SmolLM2's list form, string arguments, "parameters", an unclosed block whose JSON is whole.
    listed = (
        '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": "{\\"x\\": 1}"}]</tool_call>'
    )
    assert [(c.name, c.arguments) for c in parse_tool_calls(listed)[1]] == [("a", "{}"), ("b", '{"x": 1}')]
    assert parse_tool_calls('<tool_call>{"name": "p", "parameters": {"y": 2}}')[1] == [
        ParsedCall("p", '{"y": 2}')
    ]


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',  # malformed JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>["x"]</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a"',  # cut off mid-call
        "a < b and <tool_cal",
    ],
)
def test_what_is_not_a_call_stays_text(text: str) -> None:
    assert parse_tool_calls(text) == (text, [])


def _chunked(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(
    "text",
    [
        f"Sure. {ADD} anything else?",
        f"{ADD}{ADD}",
        "plain text with a < sign and <tool and <tool_cal",
        '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call> after',  # no head: parsed whole
    ],
)
def test_streamed_pieces_add_up_to_the_whole_parse(text: str) -> None:
    rng = random.Random(0)
    for _ in range(50):
        stream = ToolCallStream()
        pieces: list[str | CallDelta] = []
        chunks = _chunked(text, rng)
        for i, chunk in enumerate(chunks):
            pieces += stream.feed(chunk, final=i == len(chunks) - 1)
        streamed_calls = assemble(pieces)
        content, calls = parse_tool_calls(text)
        assert streamed_calls == calls
        text_pieces = "".join(p for p in pieces if isinstance(p, str))
        assert text_pieces == text if not calls else text_pieces.strip() == (content or "")


def test_a_marker_is_held_back_until_decided() -> None:
    stream = ToolCallStream()
    assert stream.feed("Hi <tool", final=False) == ["Hi "]
    assert stream.feed('_call>{"name": "f", ', final=False) == []
    assert stream.feed('"arguments": {}}</tool_call>', final=False) == [CallDelta(0, "f", "{}")]
    assert stream.feed(" <b>", final=False) == [" <b>"]


def test_a_call_streams_its_name_then_its_arguments_as_written() -> None:
    stream = ToolCallStream()
    assert stream.feed('Hi <tool_call>{"name": "add", "argu', final=False) == ["Hi "]
    assert stream.feed('ments": {"a": ', final=False) == [CallDelta(0, "add", '{"a": ')]
    assert stream.feed('1, "b": 2', final=False) == [CallDelta(0, None, '1, "b": 2')]
    assert stream.feed("}}</tool", final=False) == [CallDelta(0, None, "}")]
    assert stream.feed("_call> ok", final=True) == [" ok"]
    # Once its head is read a block is a call: arguments that turn out malformed stream as written.
    stream = ToolCallStream()
    pieces = stream.feed('<tool_call>{"name": "add", "arguments": {b', final=False)
    pieces += stream.feed("ad}}</tool_call>", final=True)
    assert assemble(pieces) == [ParsedCall("add", "{bad}")]


def _events(text: str, rng: random.Random) -> list[DeltaEvent]:
    chunks = _chunked(text, rng)
    return [
        DeltaEvent("r", i, 0, [i], c, "stop" if i == len(chunks) - 1 else None) for i, c in enumerate(chunks)
    ]


def test_auto_stream_reassembles_into_the_whole_response() -> None:
    text = f"Checking. {ADD}"
    rng = random.Random(1)
    for _ in range(20):
        whole_builder = ResponseBuilder("chat", "r", "m", 0, 1, None, tools="auto")
        streamed = ResponseBuilder("chat", "r", "m", 0, 1, None, tools="auto")
        content, finish = "", None
        calls: list[dict[str, Any]] = []
        for ev in _events(text, rng):
            whole_builder.add(ev)
            choice: Any = streamed.chunk(ev)["choices"][0]
            content += choice["delta"].get("content") or ""
            calls += choice["delta"].get("tool_calls") or []
            finish = choice["finish_reason"] or finish
        whole = whole_builder.response(DoneEvent("r", 99, COMPLETED))["choices"][0]
        assert finish == whole["finish_reason"] == "tool_calls"
        assert content.strip() == whole["message"]["content"] == "Checking."
        # The first entry names the call; the arguments come in fragments that add up to its JSON.
        assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"]
        assert all(c["index"] == 0 and "id" not in c for c in calls[1:])
        arguments = "".join(c["function"]["arguments"] for c in calls)
        (whole_call,) = whole["message"]["tool_calls"]
        assert calls[0]["function"]["name"] == whole_call["function"]["name"] == "add"
        assert json.loads(arguments) == json.loads(whole_call["function"]["arguments"]) == {"a": 1, "b": 2}


def test_the_one_message_builder() -> None:
    # Free text under auto stays content; a forced call's JSON becomes tool_calls; no tools: text.
    assert chat_message("hello", "stop", "auto") == ({"role": "assistant", "content": "hello"}, "stop")
    message, finish = chat_message('{"name": "add", "arguments": {"a": 1}}', "stop", "forced")
    assert finish == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert chat_message(ADD, "stop", None) == ({"role": "assistant", "content": ADD}, "stop")
    # A call the model finished before running out of tokens is still a call; the finish stays length.
    message, finish = chat_message(ADD + " and", "length", "auto")
    assert finish == "length" and message["tool_calls"][0]["function"]["name"] == "add"


def test_an_earlier_call_goes_back_to_the_model_in_the_format_it_is_asked_for() -> None:
    from services.gateway.prompts import ModelInfo, prepare_chat
    from services.gateway.protocol import ChatCompletionRequest

    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "add"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "2"},
            ],
            "tools": [{"type": "function", "function": {"name": "add"}}],
        }
    )
    prepared = prepare_chat(body, ModelInfo("m", None, None, None))
    messages = prepared.messages or []
    assert "<tool_call>" in messages[0]["content"]  # the system message asks for the Hermes format
    assert parse_tool_calls(messages[2]["content"]) == (None, [ParsedCall("add", '{"a": 2}')])
