"""The sampling settings of a request on the wire: a typed schema with its own version.

Every field is named here and checked on decode, so a field added to the engine's ``SamplingParams``
changes nothing on the wire until it is added here too (``tests/services/test_wire.py`` fails until
then), and a message from a build with another sampling schema is refused loudly, not misread.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput, StructuredOutputError

SAMPLING_VERSION = 1


class SamplingWireError(ValueError):
    """Sampling settings that this build cannot read (``wire.WireError`` wraps it)."""


@dataclass(frozen=True)
class WireSampling:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # on the wire: {"kind", "value", "param"}
    logit_bias: dict[int, float] | None = None  # on the wire: {"<token id>": bias}

    @classmethod
    def from_params(cls, params: SamplingParams) -> WireSampling:
        return cls(**{name: getattr(params, name) for name in _NAMES})

    def to_params(self) -> SamplingParams:
        return SamplingParams(**{name: getattr(self, name) for name in _NAMES})

    def to_json(self) -> dict[str, Any]:
        body = {"v": SAMPLING_VERSION, **{name: getattr(self, name) for name in _NAMES}}
        spec = self.structured
        body["structured"] = (
            None if spec is None else {"kind": spec.kind, "value": spec.value, "param": spec.param}
        )
        return body

    @classmethod
    def from_json(cls, obj: object) -> WireSampling:
        if not isinstance(obj, dict):
            raise SamplingWireError("params must be an object")
        if obj.get("v") != SAMPLING_VERSION:
            raise SamplingWireError(
                f"unsupported sampling schema version {obj.get('v')!r}: this build reads {SAMPLING_VERSION}"
            )
        unknown = set(obj) - set(_NAMES) - {"v"}
        if unknown:
            raise SamplingWireError(f"unknown sampling fields {sorted(unknown)}")
        values = {name: _check(name, obj[name]) for name in _NAMES if name in obj}
        sampling = cls(**values)
        try:
            sampling.to_params()  # the engine's own range checks, so a bad value fails here, not later
        except ValueError as exc:
            raise SamplingWireError(str(exc)) from None
        return sampling


# name -> (accepted JSON types, element type for lists, whether null is allowed)
_INT, _NUM = (int,), (int, float)
_SCHEMA: dict[str, tuple[tuple[type, ...], type | None, bool]] = {
    "n": (_INT, None, False),
    "temperature": (_NUM, None, False),
    "top_p": (_NUM, None, False),
    "top_k": (_INT, None, False),
    "min_p": (_NUM, None, False),
    "seed": (_INT, None, True),
    "repetition_penalty": (_NUM, None, False),
    "presence_penalty": (_NUM, None, False),
    "frequency_penalty": (_NUM, None, False),
    "max_tokens": (_INT, None, True),
    "min_tokens": (_INT, None, False),
    "stop": ((list,), str, False),
    "stop_token_ids": ((list,), int, False),
    "ignore_eos": ((bool,), None, False),
    "logprobs": (_INT, None, True),
    "include_stop_str_in_output": ((bool,), None, False),
    "skip_special_tokens": ((bool,), None, False),
    "structured": ((dict,), None, True),
    "logit_bias": ((dict,), None, True),
}
_NAMES = tuple(f.name for f in fields(WireSampling))
assert set(_NAMES) == set(_SCHEMA), "every wire sampling field needs a type check"


def _check(name: str, value: Any) -> Any:
    kinds, element, nullable = _SCHEMA[name]
    if value is None and nullable:
        return None
    # bool is an int in Python, never in this schema's numbers.
    ok = isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))
    if ok and element is not None:
        ok = all(isinstance(v, element) and not isinstance(v, bool) for v in value)
    if not ok:
        raise SamplingWireError(f"sampling field {name!r} has the wrong type: {value!r}")
    if name == "structured":
        return _structured(value)
    if name == "logit_bias":
        return _logit_bias(value)
    return float(value) if kinds is _NUM else value


def _structured(value: dict[str, Any]) -> StructuredOutput:
    if set(value) != {"kind", "value", "param"} or not all(isinstance(v, str) for v in value.values()):
        raise SamplingWireError(f"sampling field 'structured' has the wrong shape: {sorted(value)}")
    try:
        return StructuredOutput(value["kind"], value["value"], value["param"])
    except StructuredOutputError as exc:
        raise SamplingWireError(str(exc)) from None


def _logit_bias(value: dict[str, Any]) -> dict[int, float]:
    # JSON keys are strings: token ids written in decimal.
    if not all(
        isinstance(k, str)
        and k.isascii()
        and k.isdigit()
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        for k, v in value.items()
    ):
        raise SamplingWireError("sampling field 'logit_bias' must map token ids to numbers")
    return {int(k): float(v) for k, v in value.items()}
