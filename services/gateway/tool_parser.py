"""Tool calls the model writes of its own accord (``tool_choice: "auto"``), one parser per family of chat
templates, chosen from the template (``family_of``):

- ``hermes``: Qwen2/2.5/3, Hermes and SmolLM templates (and the system message ``tools.tools_message``
  adds for a template that renders no tools) ask for each call as a tagged JSON block::

      <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>

  SmolLM2's larger models put a JSON list of such objects in one block; both are read.
- ``mistral``: ``[TOOL_CALLS]`` and then a JSON list of calls; text the model writes after the list stays
  content.
- ``llama3_json``: Llama 3.x writes a call as the whole answer, a JSON object with ``name`` and
  ``parameters``, optionally after ``<|python_tag|>``.

A block whose JSON does not parse, or is not a call, stays text: what the model wrote is never lost. A
block the model left unclosed at the end of its output counts when its JSON is whole.

Streaming holds back any tail of the text that may be the start of the family's marker (as vLLM's parsers
do), and a call's block until it closes (for the families without a closing marker: until the output
ends); text outside blocks streams as content.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field

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
    calls = assemble(pieces)
    if not calls:
        return text, []
    content = "".join(p for p in pieces if isinstance(p, str)).strip()
    return content or None, calls


@dataclass(frozen=True)
class CallDelta:
    """One streamed piece of a call, as OpenAI's ``delta.tool_calls`` entries carry it: the call's first
    piece has its name, and each piece the next fragment of its arguments' JSON text."""

    index: int  # the call's place among the choice's calls
    name: str | None  # on the call's first piece only
    arguments: str = ""


def assemble(pieces: list[str | CallDelta]) -> list[ParsedCall]:
    """The whole calls that streamed pieces add up to (arguments concatenated, in index order), with the
    arguments' JSON re-serialised as the whole-output parse writes it where it parses."""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for p in pieces:
        if isinstance(p, CallDelta):
            if p.name is not None:
                names[p.index] = p.name
            args[p.index] = args.get(p.index, "") + p.arguments
    calls = []
    for index in sorted(names):
        text = args.get(index, "")
        with contextlib.suppress(ValueError):  # else kept as written: what the model wrote is never lost
            text = json.dumps(json.loads(text), ensure_ascii=False)
        calls.append(ParsedCall(names[index], text))
    return calls


@dataclass
class ToolCallStream:
    """One choice's output, fed as it streams: text pieces to send as content and call pieces, in order.

    Inside a call block, a call streams once its header is read (``{"name": "...", "arguments": `` or
    ``"parameters": ``): its name first, then its arguments as they are written, up to the end of their
    JSON value (``_scan``). A block whose header never comes is parsed whole when it ends, and answered as
    calls or, if it holds none, as the text it is.
    """

    family: str = "hermes"
    _buffer: str = ""  # text not yet sent: a possible marker start, or an open block
    _in_block: bool = False
    _opened: str = ""  # the marker of the open block ("" for Llama's bare leading JSON object)
    _started: bool = False  # some text has gone out (Llama's bare JSON counts only as the whole answer)
    _sent: list[int] = field(default_factory=list)  # the open block's calls: argument characters sent
    calls: int = 0  # calls found so far (their delta indexes)

    def feed(self, text: str, final: bool) -> list[str | CallDelta]:
        self._buffer += text
        out: list[str | CallDelta] = []
        if self.family == "none":
            out, self._buffer = ([self._buffer] if self._buffer else []), ""
            return out
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
                        body, tail = self._buffer[start:], ""
                        if closer is None:  # the calls' JSON, then whatever the model wrote after it
                            body, tail = _split_after_value(body)
                        streamed = bool(self._sent)
                        pieces = self._block_ends(body, self._buffer)
                        out.extend(pieces)
                        if tail and (streamed or any(isinstance(p, CallDelta) for p in pieces)):
                            out.append(tail)
                        self._buffer, self._in_block = "", False
                    else:
                        out.extend(self._stream(self._buffer[start:]))
                    break
                assert closer is not None
                raw = self._buffer[: end + len(closer)]
                out.extend(self._block_ends(self._buffer[start:end], raw))
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

    def _stream(self, body: str) -> list[CallDelta]:
        """What the open block's calls add since the last feed: new headers, then argument fragments."""
        out: list[CallDelta] = []
        base = self.calls - len(self._sent)  # the index of the block's first call
        for k, call in enumerate(_scan(body)):
            name = None
            if k == len(self._sent):
                self._sent.append(0)
                self.calls += 1
                name = call.name
            fragment = call.arguments[self._sent[k] :] if call.streamable else ""
            self._sent[k] += len(fragment)
            if name is not None or fragment:
                out.append(CallDelta(base + k, name, fragment))
        return out

    def _block_ends(self, body: str, raw: str) -> list[str | CallDelta]:
        sent = self._sent
        self._sent = []
        if not sent:  # nothing of it has gone out: parsed whole, a call or the text it is
            calls = _calls_in(body.strip())
            if calls is None:
                return [raw]
            self.calls += len(calls)
            base = self.calls - len(calls)
            return [CallDelta(base + i, c.name, c.arguments) for i, c in enumerate(calls)]
        base = self.calls - len(sent)
        out: list[str | CallDelta] = []
        self._sent = sent
        out.extend(self._stream(body))  # the rest of what streams
        sent, self._sent = self._sent, []
        scanned = _scan(body)
        whole = _calls_in(body.strip()) or []
        for k, call in enumerate(whole):
            if k < len(scanned) and scanned[k].streamable:
                continue  # its arguments have streamed as written
            if k < len(sent):
                out.append(CallDelta(base + k, None, call.arguments))  # its name went out already
            else:
                self.calls += 1
                out.append(CallDelta(base + k, call.name, call.arguments))
        return out


@dataclass(frozen=True)
class _Scanned:
    name: str
    arguments: str  # the arguments' JSON text so far (all of it once the value has ended)
    streamable: bool  # the arguments are an object written out: they stream as written


# A call's head up to its arguments' value, keys in the order the families' templates ask for them.
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _scan(body: str) -> list[_Scanned]:
    """The calls of a block's (possibly unfinished) JSON whose heads have been read: one object, or a list
    of them. Worked example, body ``[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "argu``:

        [ {"name": "a", "arguments": {"x": 1}} , {"name": "b", "argu
          ^-- head a ---------------^------^     ^-- head b not whole yet
                                    value ends here

    gives [_Scanned("a", '{"x": 1}', True)]: b streams once its head is whole."""
    out: list[_Scanned] = []
    i = _skip_ws(body, 0)
    listed = body.startswith("[", i)
    if listed:
        i = _skip_ws(body, i + 1)
    while True:
        head = _CALL_HEAD.match(body, i)
        if head is None:
            return out
        try:
            name = json.loads(head.group(1))
        except ValueError:
            return out
        start = head.end()
        end = _value_end(body, start)
        streamable = body.startswith("{", start)
        out.append(_Scanned(name, body[start:end] if end is not None else body[start:], streamable))
        close = None if end is None else _object_end(body, end)
        if close is None or not listed:
            return out
        i = _skip_ws(body, close)
        if not body.startswith(",", i):
            return out
        i = _skip_ws(body, i + 1)


def _split_after_value(body: str) -> tuple[str, str]:
    """``body`` cut after its leading JSON value: (the value, the text after it). No whole value: (body,
    "")."""
    i = _skip_ws(body, 0)
    end = _value_end(body, i) if body.startswith(("[", "{"), i) else None
    if end is None or not body[end:].strip():
        return body, ""
    return body[:end], body[end:]


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """Where the JSON value starting at ``text[i]`` ends (one past it); None if it is not whole yet. It
    follows strings and nesting only: the arguments stream as written, checked when the block ends."""
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        ch = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return j + 1 if depth == 0 else j
        elif depth == 0 and ch in ", \t\r\n":
            return j  # the end of a number or literal
    return None


def _object_end(text: str, i: int) -> int | None:
    """One past the ``}`` that closes a call object whose arguments end at ``i`` (other keys may follow
    them); None if it is not there yet."""
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        ch = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            if depth == 0:
                return j + 1
            depth -= 1
    return None


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
