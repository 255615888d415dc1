"""What the grammar library (xgrammar) can enforce, checked without it: the gateway's image has no torch,
hence no xgrammar, yet must refuse an unsupported constraint with a 400 before anything is queued.

How the lists were derived: ``scripts/probe_xgrammar.py`` runs every probe below through xgrammar 0.2.9
compiled as ``grammar.py`` compiles (strict mode, no free whitespace). A JSON Schema keyword is supported
when the schema compiles, the grammar accepts a JSON instance the keyword allows and refuses one it forbids.
A keyword xgrammar rejects at compile time, or silently ignores (the output could then break the schema),
is unsupported. ``tests/engine/test_structured_support.py`` runs the same probes against the installed
xgrammar, so an upgrade that changes any verdict fails there instead of drifting silently.

What is checked here: a JSON schema against its meta-schema (``jsonschema``) and for unsupported keywords;
a regex for Python's syntax and for the constructs xgrammar's regex dialect refuses; a grammar only for
being non-empty with a ``root`` rule. What is left to the worker (where xgrammar compiles it, its error the
same 400 later): EBNF syntax and undefined rules, and value-level limits inside a supported keyword (an
integer bound with a fraction, more required properties than a closed object allows).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from engine.structured.spec import StructuredOutput, StructuredOutputError

_I = {"type": "integer"}


@dataclass(frozen=True)
class Probe:
    """A keyword, a schema using it, an instance it allows and one it forbids."""

    keyword: str
    schema: dict[str, Any]
    allowed: str
    forbidden: str


def _obj(**kw: Any) -> dict[str, Any]:
    return {"type": "object", **kw}


def _arr(**kw: Any) -> dict[str, Any]:
    return {"type": "array", **kw}


PROBES: tuple[Probe, ...] = (
    Probe("type", {"type": "string"}, '"a"', "1"),
    Probe("enum", {"enum": ["a", "b"]}, '"a"', '"c"'),
    Probe("const", {"const": "a"}, '"a"', '"b"'),
    Probe("properties", _obj(properties={"a": _I}), '{"a": 1}', '{"a": "x"}'),
    Probe("required", _obj(properties={"a": _I}, required=["a"]), '{"a": 1}', "{}"),
    Probe(
        "additionalProperties", _obj(properties={"a": _I}, additionalProperties=False), '{"a": 1}', '{"b": 2}'
    ),
    Probe("patternProperties", _obj(patternProperties={"^a": _I}), '{"ab": 1}', '{"ab": "x"}'),
    Probe("propertyNames", _obj(propertyNames={"pattern": "^a"}), '{"ab": 1}', '{"b": 1}'),
    Probe("minProperties", _obj(minProperties=1), '{"a": 1}', "{}"),
    Probe("maxProperties", _obj(maxProperties=1), '{"a": 1}', '{"a": 1, "b": 2}'),
    Probe(
        "dependentRequired",
        _obj(properties={"a": _I, "b": _I}, dependentRequired={"a": ["b"]}),
        '{"a": 1, "b": 2}',
        '{"a": 1}',
    ),
    Probe(
        "dependentSchemas",
        _obj(properties={"a": _I, "b": _I}, dependentSchemas={"a": {"required": ["b"]}}),
        '{"a": 1, "b": 2}',
        '{"a": 1}',
    ),
    Probe(
        "dependencies",
        _obj(properties={"a": _I, "b": _I}, dependencies={"a": ["b"]}),
        '{"a": 1, "b": 2}',
        '{"a": 1}',
    ),
    Probe(
        "unevaluatedProperties",
        _obj(properties={"a": _I}, unevaluatedProperties=False),
        '{"a": 1}',
        '{"b": 2}',
    ),
    Probe("items", _arr(items=_I), "[1]", '["x"]'),
    Probe("prefixItems", _arr(prefixItems=[_I]), "[1]", '["x"]'),
    Probe("minItems", _arr(items=_I, minItems=1), "[1]", "[]"),
    Probe("maxItems", _arr(items=_I, maxItems=1), "[1]", "[1, 2]"),
    Probe("uniqueItems", _arr(items=_I, uniqueItems=True), "[1, 2]", "[1, 1]"),
    Probe("contains", _arr(contains=_I), "[1]", '["x"]'),
    Probe("minContains", _arr(contains=_I, minContains=2), "[1, 2]", '[1, "x"]'),
    Probe("maxContains", _arr(contains=_I, maxContains=1), "[1]", "[1, 2]"),
    Probe("unevaluatedItems", _arr(prefixItems=[_I], unevaluatedItems=False), "[1]", "[1, 2]"),
    Probe("additionalItems", _arr(items=[_I], additionalItems=False), "[1]", "[1, 2]"),
    Probe("minLength", {"type": "string", "minLength": 2}, '"ab"', '"a"'),
    Probe("maxLength", {"type": "string", "maxLength": 1}, '"a"', '"ab"'),
    Probe("pattern", {"type": "string", "pattern": "^[a-z]+$"}, '"ab"', '"1"'),
    Probe("format", {"type": "string", "format": "date"}, '"2024-01-02"', '"x"'),
    Probe("contentEncoding", {"type": "string", "contentEncoding": "base64"}, '"YQ=="', '"*"'),
    Probe("contentMediaType", {"type": "string", "contentMediaType": "application/json"}, '"1"', '"{"'),
    Probe("minimum", {"type": "integer", "minimum": 1}, "1", "0"),
    Probe("maximum", {"type": "integer", "maximum": 1}, "1", "2"),
    Probe("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 1}, "2", "1"),
    Probe("exclusiveMaximum", {"type": "integer", "exclusiveMaximum": 1}, "0", "1"),
    Probe("multipleOf", {"type": "number", "multipleOf": 0.5}, "1.5", "1.2"),
    Probe("anyOf", {"anyOf": [_I, {"type": "string"}]}, "1", "null"),
    Probe("oneOf", {"oneOf": [_I, {"type": "number"}]}, "1.5", "1"),
    Probe("allOf", {"allOf": [_obj(properties={"a": _I}), {"required": ["a"]}]}, '{"a": 1}', "{}"),
    Probe("not", {"not": _I}, '"x"', "1"),
    Probe("if", {"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}}, "6", "7"),
    Probe("then", {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, "6", "7"),
    Probe("else", {"type": "integer", "if": {"minimum": 5}, "else": {"maximum": 2}}, "6", "3"),
    Probe("$ref", {"$defs": {"a": _I}, "$ref": "#/$defs/a"}, "1", '"x"'),
    Probe("$defs", {"$defs": {"a": _I}, "$ref": "#/$defs/a"}, "1", '"x"'),
    Probe("definitions", {"definitions": {"a": _I}, "$ref": "#/definitions/a"}, "1", '"x"'),
    Probe(
        "$dynamicRef",
        {"$defs": {"a": {"$dynamicAnchor": "n", "type": "integer"}}, "$dynamicRef": "#n"},
        "1",
        '"x"',
    ),
    Probe("$anchor", {"$defs": {"a": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}, "1", '"x"'),
)

# The verdicts of the probes on xgrammar 0.2.9: keyword -> what xgrammar does with it.
UNSUPPORTED_KEYWORDS: dict[str, str] = {
    "patternProperties": "only an empty object matches",
    "propertyNames": "only an empty object matches",
    "minProperties": "refused at compile time",
    "maxProperties": "only an empty object matches",
    "dependentRequired": "ignored",
    "dependentSchemas": "ignored",
    "dependencies": "ignored",
    "uniqueItems": "ignored",
    "contains": "only an empty array matches",
    "minContains": "refused at compile time",
    "maxContains": "only an empty array matches",
    "additionalItems": "refused at compile time (items must be one schema; use prefixItems)",
    "contentEncoding": "ignored",
    "contentMediaType": "ignored",
    "multipleOf": "ignored for numbers (enforced for integers only)",
    "oneOf": "treated as anyOf: exclusivity is not enforced (use anyOf)",
    "allOf": "ignored (one subschema alone, with nothing beside it, is enforced)",
    "not": "ignored",
    "if": "ignored",
    "then": "ignored",
    "else": "ignored",
    "$dynamicRef": "ignored",
    "$anchor": "ignored (refer to $defs by path)",
}

# The two refinements the probes above check too (FORMAT_PROBES, and allOf / multipleOf in the test).
# ``format`` values whose grammar refuses a malformed string; other values are ignored by xgrammar.
SUPPORTED_FORMATS = frozenset(
    {
        "date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
        "uri-reference", "uuid", "uri-template", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip
FORMAT_PROBES: dict[str, tuple[str, str]] = {
    "date-time": ('"2024-01-02T03:04:05Z"', '"x"'),
    "time": ('"03:04:05Z"', '"x"'),
    "date": ('"2024-01-02"', '"x"'),
    "duration": ('"P1D"', '"x"'),
    "email": ('"a@b.co"', '"x"'),
    "idn-email": ('"a@b.co"', '"x"'),
    "hostname": ('"a.b"', '"-"'),
    "idn-hostname": ('"a.b"', '"-"'),
    "ipv4": ('"1.2.3.4"', '"x"'),
    "ipv6": ('"::1"', '"x"'),
    "uri": ('"http://a"', '"x y"'),
    "uri-reference": ('"/a"', '"x y"'),
    "iri": ('"http://a"', '"x y"'),
    "iri-reference": ('"/a"', '"x y"'),
    "uuid": ('"123e4567-e89b-12d3-a456-426614174000"', '"x"'),
    "uri-template": ('"/a{b}"', '"{"'),
    "json-pointer": ('"/a"', '"a"'),
    "relative-json-pointer": ('"0/a"', '"/a"'),
    "regex": ('"a+"', '"("'),
}

# Where subschemas sit: under these keys a dict of schemas, one schema, or a list of schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = (
    "additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
    "unevaluatedItems", "unevaluatedProperties", "additionalItems",
)  # fmt: skip
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
# Keywords that say nothing about the value: allowed beside a lone allOf.
_ANNOTATIONS = frozenset(
    {"$schema", "$id", "$comment", "$defs", "definitions", "title", "description", "default", "examples"}
)


def check_schema(schema: Any, param: str) -> None:
    """Refuse a JSON schema that is not one (its meta-schema) or that uses a keyword xgrammar does not
    enforce, naming the keyword and where it sits."""
    if not isinstance(schema, dict | bool):
        raise StructuredOutputError("a JSON schema must be an object", param)
    import jsonschema  # pure Python; imported on the first schema only

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/" + "/".join(str(p) for p in exc.absolute_path)
        raise StructuredOutputError(f"not a valid JSON schema at {where}: {exc.message}", param) from None
    except RecursionError:  # the meta-schema check recurses once per level of nesting
        raise StructuredOutputError("the JSON schema is nested too deeply", param) from None
    todo: list[tuple[Any, str]] = [(schema, "")]
    while todo:  # iterative: a deeply nested schema cannot exhaust the stack
        node, path = todo.pop()
        if not isinstance(node, dict):
            continue
        _check_node(node, path, param)
        for key in _SCHEMA_MAPS:
            sub = node.get(key)
            if isinstance(sub, dict):
                todo.extend((v, f"{path}/{key}/{k}") for k, v in sub.items())
        for key in _SCHEMA_ONE:
            if isinstance(node.get(key), dict):
                todo.append((node[key], f"{path}/{key}"))
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                todo.extend((v, f"{path}/{key}/{i}") for i, v in enumerate(node[key]))


def _check_node(node: dict[str, Any], path: str, param: str) -> None:
    where = path or "/"
    for key in node:
        why = UNSUPPORTED_KEYWORDS.get(key)
        if why is None or _allowed_here(key, node):
            continue
        raise StructuredOutputError(
            f"the JSON schema uses {key!r} at {where}, which constrained decoding cannot enforce ({why})",
            param,
        )
    if isinstance(node.get("items"), list):
        raise StructuredOutputError(
            f"the JSON schema's items at {where} is a list (the old tuple form); use prefixItems", param
        )
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in SUPPORTED_FORMATS:
        supported = ", ".join(sorted(SUPPORTED_FORMATS))
        raise StructuredOutputError(
            f"the JSON schema's format {fmt!r} at {where} cannot be enforced (supported: {supported})", param
        )


def _allowed_here(key: str, node: dict[str, Any]) -> bool:
    """The supported corners of otherwise unsupported keywords, as the probes in the test check them."""
    if key == "multipleOf":
        return node.get("type") == "integer"
    if key == "allOf":
        subs = node["allOf"]
        return isinstance(subs, list) and len(subs) == 1 and set(node) <= _ANNOTATIONS | {"allOf"}
    return False


# ---- regex ------------------------------------------------------------------------------------
# xgrammar's regex dialect refuses these (probed like the keywords: REGEX_PROBES); Python's ``re``
# accepts most of them, so its compile alone would let them through to the worker.
_REGEX_REFUSED: tuple[tuple[str, str], ...] = (
    (r"\(\?[=!]", "lookahead"),
    (r"\(\?<[=!]", "lookbehind"),
    (r"\(\?P?[=>#a-zA-Z]|\(\?P<", "group flags, comments, atomic and Python-named groups"),
    (r"\\[1-9]|\\k<|\(\?P=", "backreferences"),
    (r"\\[bB]", "word boundaries"),
    (r"\\[pP]", "Unicode property classes"),
    (r"[*+?}][*+{]|\}\?[*+?{]|[*+?]\?[*+?{]", "two consecutive repetitions (possessive or stacked)"),
    (r"\{,", "a repetition without a lower bound ({,n}: write {0,n})"),
)
REGEX_PROBES: dict[str, bool] = {  # pattern -> whether xgrammar 0.2.9 compiles it
    "a+": True, "(?:a)": True, "(?<n>a)": True, "a*?": True, r"\d\w\s": True, "[^a]": True,
    "a{2,}": True, r"[\b]": True, r"[(?=]": True, "^a$": True, "a|": True,
    "(?=a)b": False, "(?!a)b": False, "(?<=a)b": False, "(?<!a)b": False, r"(a)\1": False,
    r"\k<n>": False, "(?P<x>a)": False, "(?P=x)": False, "(?i)abc": False, "(?s:a)": False,
    "(?#c)a": False, "(?>a)": False, r"\bfoo": False, r"a\B": False, r"\p{L}": False, "a++": False,
    "a{2}{3}": False, "a{,3}": False, "[": False, "a**": False,
}  # fmt: skip


def check_regex(pattern: str, param: str) -> None:
    """Refuse a regex that Python cannot parse or that uses a construct xgrammar's dialect refuses."""
    try:
        # Python spells a named group (?P<name>...), xgrammar (?<name>...): the syntax check takes both.
        re.compile(re.sub(r"\(\?<(?=[A-Za-z_])", "(?P<", pattern))
    except (re.error, RecursionError, OverflowError) as exc:
        raise StructuredOutputError(f"not a valid regex: {exc}", param) from None
    outside = _outside_classes(pattern)
    for construct, what in _REGEX_REFUSED:
        if re.search(construct, outside):
            raise StructuredOutputError(f"the regex uses {what}, which constrained decoding cannot do", param)


def _outside_classes(pattern: str) -> str:
    """The pattern with each character class and escaped literal blanked out (kept the same length), so
    that ``[(?=]`` or ``\\(`` are not taken for the constructs they spell."""
    out: list[str] = []
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            nxt = pattern[i + 1]
            # Keep escapes that are constructs (\b, \1, \k, \p), outside classes only.
            keep = not in_class and (nxt in "bBpPk" or (nxt.isdigit() and nxt != "0"))
            out.append(c + nxt if keep else "__")
            i += 2
            continue
        if in_class:
            if c == "]" and not (pattern[i - 1] == "[" or pattern[i - 2 : i] == "[^"):
                in_class = False
            out.append("_")
        elif c == "[":
            in_class = True
            out.append("_")
        else:
            out.append(c)
        i += 1
    return "".join(out)


_ROOT_RULE = re.compile(r"(?m)^\s*root\s*::=")


def check_grammar(grammar: str, param: str) -> None:
    """A grammar must be non-empty and define ``root``: its EBNF syntax is checked by the worker."""
    if not grammar.strip():
        raise StructuredOutputError("the grammar is empty", param)
    if not _ROOT_RULE.search(grammar):
        raise StructuredOutputError("the grammar must define its start rule as `root ::= ...`", param)


def check_supported(spec: StructuredOutput) -> None:
    """Refuse ``spec`` if it is invalid or unsupported, as far as can be told without xgrammar."""
    if spec.kind == "json_schema":
        import json

        check_schema(json.loads(spec.value), spec.param)
    elif spec.kind == "regex":
        check_regex(spec.value, spec.param)
    elif spec.kind == "grammar":
        check_grammar(spec.value, spec.param)
