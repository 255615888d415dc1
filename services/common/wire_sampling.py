"""The sampling settings of a request on the wire: ``SamplingParams`` itself, with a versioned codec.

The engine's ``SamplingParams`` is the one list of sampling fields: ``WireSampling`` inherits them (and
their range checks), and each field's JSON check is derived from its type annotation. A field added to
``SamplingParams`` travels at once; one whose type the codec cannot carry fails this module's import
(add its case to ``_codec``). A field at its default is left out of the message, so a new field that a
request does not use never reaches an older worker. A message from a build with another sampling schema
version is refused loudly, not misread.

    annotation               on the wire                         decoded
    int, float, bool, str    a number / bool / string            the same (a JSON int is a float's too)
    list[T]                  an array of T                       a list
    dict[K, V]               an object (keys as strings)         a dict with keys converted back to K
    X | None                 X, or null                          X or None
    StructuredOutput         {"kind", "value", "param"}          a StructuredOutput
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any

from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput, StructuredOutputError

SAMPLING_VERSION = 1


class SamplingWireError(ValueError):
    """Sampling settings that this build cannot read (``wire.WireError`` wraps it)."""


class WireSampling(SamplingParams):
    """``SamplingParams`` as a request message carries it: the same fields and checks, plus the codec."""

    @classmethod
    def from_params(cls, params: SamplingParams) -> WireSampling:
        return cls(**{name: getattr(params, name) for name in _NAMES})

    def to_params(self) -> SamplingParams:
        return SamplingParams(**{name: getattr(self, name) for name in _NAMES})

    def to_json(self) -> dict[str, Any]:
        """Fields at their default are left out: a message that does not use a field added since is
        read by a worker of an older build (which refuses fields it does not know), and is smaller."""
        values = {name: getattr(self, name) for name in _NAMES}
        body = {name: _CODECS[name].encode(v) for name, v in values.items() if v != _DEFAULTS[name]}
        return {"v": SAMPLING_VERSION, **body}

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
        values = {name: _CODECS[name].decode(name, obj[name]) for name in _NAMES if name in obj}
        try:
            return cls(**values)  # the engine's own range checks, so a bad value fails here, not later
        except ValueError as exc:
            raise SamplingWireError(str(exc)) from None


@dataclass(frozen=True)
class _Codec:
    """One field's JSON form: ``check`` converts a JSON value (or raises ``TypeError``), ``encode`` the
    reverse; null passes only where the annotation allows None."""

    check: Callable[[Any], Any]
    encode_value: Callable[[Any], Any]
    nullable: bool

    def decode(self, name: str, value: Any) -> Any:
        if value is None and self.nullable:
            return None
        try:
            return self.check(value)
        except TypeError:
            raise SamplingWireError(f"sampling field {name!r} has the wrong type: {value!r}") from None
        except StructuredOutputError as exc:
            raise SamplingWireError(str(exc)) from None

    def encode(self, value: Any) -> Any:
        return None if value is None else self.encode_value(value)


def _scalar(kind: type) -> Callable[[Any], Any]:
    """bool is an int in Python, never in this schema's numbers; a float field takes JSON ints."""
    kinds: tuple[type, ...] = (int, float) if kind is float else (kind,)

    def check(value: Any) -> Any:
        if not isinstance(value, kinds) or (kind is not bool and isinstance(value, bool)):
            raise TypeError
        return float(typing.cast(float, value)) if kind is float else value

    return check


def _structured(value: Any) -> StructuredOutput:
    if not isinstance(value, dict):
        raise TypeError
    if set(value) != {"kind", "value", "param"} or not all(isinstance(v, str) for v in value.values()):
        raise StructuredOutputError(f"sampling field 'structured' has the wrong shape: {sorted(value)}")
    return StructuredOutput(value["kind"], value["value"], value["param"])


def _identity(value: Any) -> Any:
    return value


def _codec(hint: Any) -> _Codec:
    """The codec of a field annotated ``hint``; TypeError for a type the wire cannot carry yet."""
    args = typing.get_args(hint)
    nullable = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if nullable:
        (hint,) = [a for a in args if a is not type(None)]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (int, float, bool, str):
        return _Codec(_scalar(hint), _identity, nullable)
    if hint is StructuredOutput:
        return _Codec(_structured, lambda s: {"kind": s.kind, "value": s.value, "param": s.param}, nullable)
    if origin is list and args[0] in (int, float, bool, str):
        item = _scalar(args[0])

        def check_list(value: Any) -> list[Any]:
            if not isinstance(value, list):
                raise TypeError
            return [item(v) for v in value]

        return _Codec(check_list, list, nullable)
    if origin is dict and args[0] in (int, str) and args[1] in (int, float, bool, str):
        key_kind, value_check = args[0], _scalar(args[1])

        def check_dict(value: Any) -> dict[Any, Any]:
            if not isinstance(value, dict):
                raise TypeError
            try:  # JSON keys are strings: "50256" -> 50256
                return {key_kind(k): value_check(v) for k, v in value.items()}
            except ValueError:
                raise TypeError from None

        return _Codec(check_dict, lambda d: {str(k): v for k, v in d.items()}, nullable)
    raise TypeError(f"no wire codec for {hint!r}")


def _codecs() -> dict[str, _Codec]:
    hints = typing.get_type_hints(SamplingParams)
    out = {}
    for f in fields(SamplingParams):
        try:
            out[f.name] = _codec(hints[f.name])
        except TypeError as exc:
            raise TypeError(f"SamplingParams.{f.name}: {exc}; add its case to wire_sampling._codec") from None
    return out


_CODECS = _codecs()
_NAMES = tuple(_CODECS)
_DEFAULTS = {
    f.name: f.default if f.default_factory is MISSING else f.default_factory() for f in fields(SamplingParams)
}
