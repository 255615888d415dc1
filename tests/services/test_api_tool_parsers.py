"""Tool-call parsers per template family (Hermes/Qwen, Mistral, Llama 3 JSON), whole and streamed in
pieces, the family read from the template, and parallel_tool_calls: false."""

from __future__ import annotations

import json

import pytest

from services.gateway.responses import chat_message
from services.gateway.tool_parser import (
    CallDelta,
    ParsedCall,
    ToolCallStream,
    assemble,
    family_of,
    parse_tool_calls,
)

ADD = ParsedCall("add", json.dumps({"a": 1, "b": 2}))
MUL = ParsedCall("mul", json.dumps({"x": 3}))

OUTPUTS = {
    "hermes": 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    '<tool_call>{"name": "mul", "arguments": {"x": 3}}</tool_call>',
    "mistral": 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
    '{"name": "mul", "arguments": {"x": 3}}]',
    "llama3_json": '<|python_tag|>[{"name": "add", "parameters": {"a": 1, "b": 2}}, '
    '{"name": "mul", "parameters": {"x": 3}}]',
}


@pytest.mark.parametrize("family", list(OUTPUTS))
def test_whole_and_streamed_outputs_give_the_same_calls(family: str) -> None:
    text = OUTPUTS[family]
    content, calls = parse_tool_calls(text, family)
    assert calls == [ADD, MUL]
    assert content == ("Sure." if family != "llama3_json" else None)
    for size in (1, 3, 7):
        stream = ToolCallStream(family)
        pieces: list[str | CallDelta] = []
        for i in range(0, len(text), size):
            pieces += stream.feed(text[i : i + size], final=i + size >= len(text))
        assert assemble(pieces) == [ADD, MUL]
        # Each call's name comes in its first piece, before any of its arguments are complete.
        named = [p for p in pieces if isinstance(p, CallDelta) and p.name is not None]
        assert [(p.index, p.name) for p in named] == [(0, "add"), (1, "mul")]
        if size == 1:
            assert sum(1 for p in pieces if isinstance(p, CallDelta) and p.index == 0) > 5
        assert "".join(p for p in pieces if isinstance(p, str)).strip() == (content or "")


def test_llama_bare_json_answer_is_a_call_and_other_text_is_not() -> None:
    assert parse_tool_calls('  {"name": "add", "parameters": {"a": 1, "b": 2}}', "llama3_json") == (
        None,
        [ADD],
    )
    text = 'The answer is {"name": "add"} as JSON.'
    assert parse_tool_calls(text, "llama3_json") == (text, [])
    assert parse_tool_calls("[TOOL_CALLS]not json", "mistral") == ("[TOOL_CALLS]not json", [])


def test_family_from_the_template() -> None:
    assert family_of("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") == "mistral"
    assert family_of("<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert family_of("{% for tool in tools %}<tool_call>{% endfor %}") == "hermes"
    assert family_of(None) == "hermes"


def test_parallel_tool_calls_false_answers_the_first_call_only() -> None:
    message, finish = chat_message(OUTPUTS["hermes"], "stop", "auto", "hermes", parallel=False)
    assert finish == "tool_calls"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["add"]
    message, _ = chat_message(OUTPUTS["mistral"], "stop", "auto", "mistral")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["add", "mul"]


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_text_after_a_mistral_list_stays_content_and_the_calls_count(size: int) -> None:
    text = OUTPUTS["mistral"] + " Done."
    assert parse_tool_calls(text, "mistral") == ("Sure.  Done.", [ADD, MUL])
    stream = ToolCallStream("mistral")
    pieces: list[str | CallDelta] = []
    for i in range(0, len(text), size):
        pieces += stream.feed(text[i : i + size], final=i + size >= len(text))
    assert assemble(pieces) == [ADD, MUL]
    assert "".join(p for p in pieces if isinstance(p, str)) == "Sure.  Done."
    # A list that is not calls stays text, all of it.
    odd = "[TOOL_CALLS][1, 2] and more"
    assert parse_tool_calls(odd, "mistral") == (odd, [])
