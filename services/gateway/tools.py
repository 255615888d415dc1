"""Structured outputs and tool calls at the edge: OpenAI's ``response_format``, vLLM's
``structured_outputs`` object and its older ``guided_*`` fields, ``tools`` / ``tool_choice``, turned into
the engine's ``StructuredOutput``; and constrained tool-call text turned back into ``tool_calls``.

With ``tool_choice`` "required" or a named function the output is constrained to one JSON object
``{"name": <a tool's name>, "arguments": <its parameters>}`` (keys in that order, fixed separators), so
the name is known once ``"arguments": `` has been generated and the rest, but the final brace, is the
arguments' JSON: that is what streams as argument fragments. "auto" renders the tools and leaves the
answer unconstrained: calls the model writes in the Hermes format (``tool_parser.py``) come back as
``tool_calls``, anything else as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.structured.spec import StructuredOutput, StructuredOutputError
from engine.structured.support import check_schema, check_supported
from services.gateway.errors import APIError

_HEADER = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, code="invalid_value", param=param)


def _spec(make: Any, param: str) -> StructuredOutput:
    """The constraint ``make`` builds, refused here (a 400 naming ``param``) if it is invalid or one the
    engine's grammar library cannot enforce: nothing is queued for it."""
    try:
        spec: StructuredOutput = make()
        check_supported(spec)
    except StructuredOutputError as exc:
        raise _bad(str(exc), param) from None
    return spec


def response_format_spec(body: Any) -> StructuredOutput | None:
    """The constraint of a completions or chat body's response_format / guided_* fields (at most one)."""
    found: list[StructuredOutput] = []
    fmt = body.response_format
    if fmt is not None:
        kind = fmt.get("type", "text")
        if kind == "json_object":
            found.append(StructuredOutput("json_object"))
        elif kind == "json_schema":
            wrapper = fmt.get("json_schema")
            schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
            if not isinstance(schema, dict):
                raise _bad(
                    "response_format.json_schema.schema must be a JSON schema object", "response_format"
                )
            found.append(_spec(lambda: StructuredOutput.json_schema(schema), "response_format"))
        elif kind != "text":
            raise _bad(f"unsupported response_format type {kind!r}", "response_format")
    if body.structured_outputs is not None:
        found.append(structured_outputs_spec(body.structured_outputs))
    if body.guided_json is not None:
        schema = body.guided_json
        if isinstance(schema, str):
            found.append(_spec(lambda: StructuredOutput("json_schema", schema, "guided_json"), "guided_json"))
        else:
            found.append(_spec(lambda: StructuredOutput.json_schema(schema, "guided_json"), "guided_json"))
    if body.guided_regex is not None:
        found.append(
            _spec(lambda: StructuredOutput("regex", body.guided_regex, "guided_regex"), "guided_regex")
        )
    if body.guided_choice is not None:
        choices = json.dumps(body.guided_choice)
        found.append(_spec(lambda: StructuredOutput("choice", choices, "guided_choice"), "guided_choice"))
    if body.guided_grammar is not None:
        grammar = body.guided_grammar
        found.append(_spec(lambda: StructuredOutput("grammar", grammar, "guided_grammar"), "guided_grammar"))
    if len(found) > 1:
        raise _bad(
            "give one of response_format, structured_outputs, guided_json, guided_regex, guided_choice, "
            "guided_grammar",
            found[1].param,
        )
    return found[0] if found else None


# vLLM's StructuredOutputsParams: the constraint keys (exactly one is set) and the options.
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# Options whose default changes nothing here; any other value would change the output, so it is refused.
_OPTION_DEFAULTS: dict[str, Any] = {
    "disable_fallback": False,  # any value: there is one grammar backend, nothing to fall back to
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
}
_MAX_TEXT = 65536  # as guided_regex and guided_grammar
_MAX_CHOICES = 1024


def structured_outputs_spec(obj: dict[str, Any]) -> StructuredOutput:
    """vLLM's ``structured_outputs`` object as the engine's constraint: ``{"json": schema or its text}``,
    ``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": ...}`` or ``{"json_object": true}``, compiled
    by the same path as ``response_format``. ``structural_tag`` and the options that would loosen or
    reshape the JSON grammar are refused (400), as is any key vLLM does not define."""
    param = "structured_outputs"
    for key, value in obj.items():
        if key not in _CONSTRAINTS and key not in _OPTION_DEFAULTS:
            raise _bad(f"structured_outputs has no field {key!r}", param)
        if key in _OPTION_DEFAULTS and key != "disable_fallback" and value != _OPTION_DEFAULTS[key]:
            raise _bad(f"structured_outputs.{key} is not supported", param)
    given = [k for k in _CONSTRAINTS if obj.get(k) not in (None, False)]
    if len(given) != 1:
        raise _bad(f"structured_outputs needs exactly one of {', '.join(_CONSTRAINTS)}", param)
    (key,) = given
    value = obj[key]
    if key == "structural_tag":
        raise _bad("structured_outputs.structural_tag is not supported", param)
    if key == "json_object":
        if value is not True:
            raise _bad("structured_outputs.json_object must be true", param)
        return _spec(lambda: StructuredOutput("json_object", "", param), param)
    if key == "json":
        if isinstance(value, dict):
            return _spec(lambda: StructuredOutput.json_schema(value, param), param)
        if not isinstance(value, str) or len(value) > _MAX_TEXT:
            raise _bad("structured_outputs.json must be a JSON schema (an object or its text)", param)
        return _spec(lambda: StructuredOutput("json_schema", value, param), param)
    if key == "choice":
        if (
            not isinstance(value, list)
            or not 0 < len(value) <= _MAX_CHOICES
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise _bad(f"structured_outputs.choice must be 1 to {_MAX_CHOICES} non-empty strings", param)
        return _spec(lambda: StructuredOutput("choice", json.dumps(value), param), param)
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_TEXT:
        raise _bad(f"structured_outputs.{key} must be a non-empty string of at most {_MAX_TEXT}", param)
    return _spec(lambda: StructuredOutput(key, value, param), param)


@dataclass(frozen=True)
class ToolPlan:
    spec: StructuredOutput | None  # the constraint (required / named), None for auto or none
    render: list[dict[str, Any]] = field(default_factory=list)  # the tools the prompt lists
    calls: bool = False  # the answer is a tool call: the response carries tool_calls


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> ToolPlan:
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise _bad("tool_choice needs tools", "tool_choice")
        return ToolPlan(None)
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if tool.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}] must be a function with a name", "tools")
        params = fn.get("parameters") if isinstance(fn, dict) else None
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions[name] = params
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(None)
    if choice == "auto":
        return ToolPlan(None, tools)
    if choice == "required":
        names = list(functions)
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise _bad(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        names = [name]
    else:
        raise _bad("tool_choice must be none, auto, required or a named function", "tool_choice")
    for i, tool in enumerate(tools):
        if tool["function"]["name"] in names:
            try:
                check_schema(functions[tool["function"]["name"]], "tools")
            except StructuredOutputError as exc:
                raise _bad(f"tools[{i}].function.parameters: {exc}", "tools") from None
    shapes = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, "arguments": functions[n]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for n in names
    ]
    schema = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
    spec = _spec(lambda: StructuredOutput.json_schema(schema, "tools"), "tools")
    return ToolPlan(spec, [t for t in tools if t["function"]["name"] in names], calls=True)


def tools_message(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A system message listing the tools, for chat templates that do not render ``tools`` themselves.
    It asks for calls in the Hermes format, which ``tool_parser.py`` reads back under "auto" (a forced
    call's constraint writes the bare object instead)."""
    listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return {
        "role": "system",
        "content": "You may call these functions:\n<tools>\n" + listing + "\n</tools>\nTo call one, "
        'answer with <tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>.',
    }


# How a chat answer's tools come back: "forced" (required or a named function: the constrained text is
# one call), "auto" (calls the model wrote in the Hermes format are parsed out), None (text only).
ToolMode = Literal["forced", "auto"] | None


def tool_mode(tools: list[dict[str, Any]] | None, tool_choice: Any, forced: bool) -> ToolMode:
    if forced:
        return "forced"
    return "auto" if tools and tool_choice in (None, "auto") else None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a complete constrained tool call; None if it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    return obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)


class CallStream:
    """One choice's streamed tool call: the header (id, name) once known, then argument fragments."""

    def __init__(self) -> None:
        self.id = new_call_id()
        self._text = ""
        self._name: str | None = None
        self._start = 0  # where the arguments begin in the text
        self._sent = 0  # characters of the arguments already sent

    def feed(self, text: str, final: bool) -> dict[str, Any] | None:
        """The tool_calls delta entry for this much more text; None while there is nothing to send."""
        self._text += text
        entry: dict[str, Any] = {"index": 0}
        if self._name is None:
            m = _HEADER.match(self._text)
            if m is None:
                return None
            self._name = json.loads(m.group(1))
            self._start = m.end()
            entry.update(id=self.id, type="function", function={"name": self._name, "arguments": ""})
        # The wrapper's closing brace is the last character: hold one back until the end.
        args = self._text[self._start :] if final else self._text[self._start : -1]
        fragment = args[self._sent :]
        if final and fragment.endswith("}"):
            fragment = fragment[:-1]
        self._sent += len(fragment)
        if fragment:
            entry.setdefault("function", {})["arguments"] = fragment
        return entry if len(entry) > 1 else None
