"""Tool calls the model writes of its own accord (``tool_choice: "auto"``), in the Hermes format.

Qwen2, Hermes and SmolLM2 chat templates (and the system message ``tools.tools_message`` adds for a template
that renders no tools, as SmolLM2-135M's does not) ask for each call as a tagged JSON block::

    <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>

SmolLM2's larger models put a JSON list of such objects in one block; both are read. A block whose JSON
does not parse, or is not a call, stays text: what the model wrote is never lost. A block the model left
unclosed at the end of its output counts when its JSON is whole.

Streaming holds back any tail of the text that may be the start of ``<tool_call>`` (as vLLM's parsers do),
and a call's block until it closes; text outside blocks streams as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def _calls_in(block: str) -> list[ParsedCall] | None:
    """The calls in one block's JSON; None if it is not JSON or not calls."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string already
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ParsedCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a whole output: the text outside call blocks (None if only whitespace once
    calls were found), and the calls in order. No call: the text unchanged, []."""
    stream = ToolCallStream()
    pieces = stream.feed(text, final=True)
    calls = [p for p in pieces if isinstance(p, ParsedCall)]
    if not calls:
        return text, []
    content = "".join(p for p in pieces if isinstance(p, str)).strip()
    return content or None, calls


@dataclass
class ToolCallStream:
    """One choice's output, fed as it streams: text pieces to send as content and calls, in order."""

    _buffer: str = ""  # text not yet sent: a possible marker start, or an open block
    _in_block: bool = False
    calls: int = 0  # calls found so far (their delta indexes)

    def feed(self, text: str, final: bool) -> list[str | ParsedCall]:
        self._buffer += text
        out: list[str | ParsedCall] = []
        while True:
            if self._in_block:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    if final:  # unclosed at the end: a call if its JSON is whole, else text
                        out.extend(self._block(self._buffer[len(OPEN) :], self._buffer))
                        self._buffer, self._in_block = "", False
                    break
                raw = self._buffer[: end + len(CLOSE)]
                out.extend(self._block(self._buffer[len(OPEN) : end], raw))
                self._buffer, self._in_block = self._buffer[end + len(CLOSE) :], False
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                if start:
                    out.append(self._buffer[:start])
                self._buffer, self._in_block = self._buffer[start:], True
                continue
            keep = 0 if final else _marker_prefix(self._buffer)
            cut = len(self._buffer) - keep
            if cut:
                out.append(self._buffer[:cut])
            self._buffer = self._buffer[cut:]
            break
        return out

    def _block(self, body: str, raw: str) -> list[str | ParsedCall]:
        calls = _calls_in(body.strip())
        if calls is None:
            return [raw]  # not a call: the model's text, as written
        self.calls += len(calls)
        return list(calls)


def _marker_prefix(text: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
