"""Tool calls the model writes of its own accord (``tool_choice: "auto"``), one parser per family of chat
templates, chosen from the template (``family_of``):

- ``hermes``: Qwen2/2.5/3, Hermes and SmolLM templates (and the system message ``tools.tools_message``
  adds for a template that renders no tools) ask for each call as a tagged JSON block::

      <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>

  SmolLM2's larger models put a JSON list of such objects in one block; both are read.
- ``mistral``: ``[TOOL_CALLS]`` and then a JSON list of calls to the end of the output.
- ``llama3_json``: Llama 3.x writes a call as the whole answer, a JSON object with ``name`` and
  ``parameters``, optionally after ``<|python_tag|>``.

A block whose JSON does not parse, or is not a call, stays text: what the model wrote is never lost. A
block the model left unclosed at the end of its output counts when its JSON is whole.

Streaming holds back any tail of the text that may be the start of the family's marker (as vLLM's parsers
do), and a call's block until it closes (for the families without a closing marker: until the output
ends); text outside blocks streams as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# family -> (the marker that opens a call block, the one that closes it; None: the output's end)
MARKERS: dict[str, tuple[str, str | None]] = {
    "hermes": (OPEN, CLOSE),
    "mistral": ("[TOOL_CALLS]", None),
    "llama3_json": ("<|python_tag|>", None),
}
FAMILIES = tuple(MARKERS)


def family_of(template: str | None) -> str:
    """The call format a chat template asks for: its own marker decides, else Hermes (what the gateway's
    own tools message asks for)."""
    if template and "[TOOL_CALLS]" in template:
        return "mistral"
    if template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3_json"
    return "hermes"


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


def parse_tool_calls(text: str, family: str = "hermes") -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a whole output: the text outside call blocks (None if only whitespace once
    calls were found), and the calls in order. No call: the text unchanged, []."""
    stream = ToolCallStream(family)
    pieces = stream.feed(text, final=True)
    calls = [p for p in pieces if isinstance(p, ParsedCall)]
    if not calls:
        return text, []
    content = "".join(p for p in pieces if isinstance(p, str)).strip()
    return content or None, calls


@dataclass
class ToolCallStream:
    """One choice's output, fed as it streams: text pieces to send as content and calls, in order."""

    family: str = "hermes"
    _buffer: str = ""  # text not yet sent: a possible marker start, or an open block
    _in_block: bool = False
    _opened: str = ""  # the marker of the open block ("" for Llama's bare leading JSON object)
    _started: bool = False  # some text has gone out (Llama's bare JSON counts only as the whole answer)
    calls: int = 0  # calls found so far (their delta indexes)

    def feed(self, text: str, final: bool) -> list[str | ParsedCall]:
        self._buffer += text
        out: list[str | ParsedCall] = []
        opener, closer = MARKERS[self.family]
        if self.family == "llama3_json" and not self._started and not self._in_block:
            head = self._buffer.lstrip()
            if head.startswith("{"):
                self._in_block, self._opened = True, ""
            elif not head and not final:
                return out  # only whitespace yet: whether a JSON answer follows is not known
        while True:
            if self._in_block:
                start = len(self._opened)
                end = -1 if closer is None else self._buffer.find(closer)
                if end < 0:
                    if final:  # unclosed at the end: a call if its JSON is whole, else text
                        out.extend(self._block(self._buffer[start:], self._buffer))
                        self._buffer, self._in_block = "", False
                    break
                assert closer is not None
                raw = self._buffer[: end + len(closer)]
                out.extend(self._block(self._buffer[start:end], raw))
                self._buffer, self._in_block = self._buffer[end + len(closer) :], False
                continue
            start = self._buffer.find(opener)
            if start >= 0:
                if start:
                    out.append(self._buffer[:start])
                self._buffer, self._in_block, self._opened = self._buffer[start:], True, opener
                continue
            keep = 0 if final else _marker_prefix(self._buffer, opener)
            cut = len(self._buffer) - keep
            if cut:
                out.append(self._buffer[:cut])
            self._buffer = self._buffer[cut:]
            break
        self._started = self._started or any(isinstance(p, str) and p.strip() for p in out)
        return out

    def _block(self, body: str, raw: str) -> list[str | ParsedCall]:
        calls = _calls_in(body.strip())
        if calls is None:
            return [raw]  # not a call: the model's text, as written
        self.calls += len(calls)
        return list(calls)


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
