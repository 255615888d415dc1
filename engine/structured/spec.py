"""What a request's output must match: a JSON object, a JSON schema, a regex, one of a list, or a grammar.

Plain data (a frozen dataclass of two strings), so it rides in ``SamplingParams`` through the engine core's
msgspec pipe and on the Kafka wire unchanged, and its hash keys the compiled-grammar cache.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


class StructuredOutputError(ValueError):
    """A constraint the engine cannot compile: the client's fault, reported as a 400 naming ``param``."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[StructuredOutputError], tuple[str, str]]:
        return type(self), (str(self), self.param)


@dataclass(frozen=True)
class StructuredOutput:
    """``kind`` is one of KINDS; ``value`` is the schema as JSON text (json_schema), the regex, the
    choices as a JSON list of strings, or the grammar in EBNF (GBNF); "" for json_object.
    ``param`` names the request field it came from, for the error a bad one gets."""

    kind: str
    value: str = ""
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"unknown structured output kind {self.kind!r}", self.param)
        if self.kind == "json_schema":
            schema = _loads(self.value, self.param)
            if not isinstance(schema, dict):
                raise StructuredOutputError("a JSON schema must be an object", self.param)
        elif self.kind == "choice":
            choices = _loads(self.value, self.param)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise StructuredOutputError("choices must be a non-empty list of strings", self.param)
        elif self.kind in ("regex", "grammar") and not self.value:
            raise StructuredOutputError(f"the {self.kind} is empty", self.param)

    @classmethod
    def json_schema(cls, schema: dict[str, Any], param: str = "response_format") -> StructuredOutput:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), param)

    @property
    def key(self) -> str:
        """The compiled-grammar cache key: the same constraint from any request compiles once."""
        return hashlib.sha256(f"{self.kind}\0{self.value}".encode()).hexdigest()


def _loads(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise StructuredOutputError(f"not valid JSON: {exc}", param) from None
    except RecursionError:
        raise StructuredOutputError("the JSON is nested too deeply", param) from None
