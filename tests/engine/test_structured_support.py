"""The torch-free support check (engine/structured/support.py) against the installed xgrammar: the list of
unsupported keywords, formats and regex constructs cannot drift from what xgrammar does."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from engine.structured.spec import StructuredOutput, StructuredOutputError
from engine.structured.support import check_grammar, check_regex, check_schema, check_supported

REPO = Path(__file__).resolve().parents[2]


def test_probes_agree_with_installed_xgrammar(capsys: pytest.CaptureFixture[str]) -> None:
    main = runpy.run_path(str(REPO / "scripts" / "probe_xgrammar.py"), run_name="probe")["main"]
    rc = main()
    assert rc == 0, "xgrammar's verdicts drifted from support.py:\n" + "\n".join(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("DRIFT")
    )


def _enforced(schema: dict[str, Any], allowed: str, forbidden: str) -> bool:
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    return accepts(grammar, allowed) and not accepts(grammar, forbidden)


def test_the_allowed_corners_are_enforced() -> None:
    # A lone allOf, and multipleOf on integers: support.py lets these through.
    lone = {"allOf": [{"type": "integer"}], "title": "t"}
    assert _enforced(lone, "1", '"a"')
    check_schema(lone, "response_format")
    integers = {"type": "integer", "multipleOf": 3}
    assert _enforced(integers, "3", "4")
    check_schema(integers, "response_format")
    # ... and the same keywords in the shapes xgrammar ignores are refused.
    beside = {"type": "integer", "allOf": [{"minimum": 2}]}
    assert not _enforced(beside, "3", "1")
    with pytest.raises(StructuredOutputError, match="allOf"):
        check_schema(beside, "response_format")


@pytest.mark.parametrize(
    ("schema", "match"),
    [
        ({"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}, "uniqueItems"),
        ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "oneOf"),
        ({"$defs": {"a": {"not": {"type": "null"}}}, "$ref": "#/$defs/a"}, r"'not' at /\$defs/a"),
        ({"type": "string", "format": "iri"}, "format 'iri'"),
        (
            {"$schema": "http://json-schema.org/draft-07/schema#", "items": [{"type": "integer"}]},
            "prefixItems",
        ),
        ({"type": "strin"}, "not a valid JSON schema"),
        ({"properties": {"a": {"minimum": "x"}}}, r"not a valid JSON schema at /properties/a/minimum"),
        ([1], "must be an object"),
    ],
)
def test_schema_refusals_name_the_keyword(schema: object, match: str) -> None:
    with pytest.raises(StructuredOutputError, match=match) as info:
        check_schema(schema, "tools")
    assert info.value.param == "tools"


def test_a_deeply_nested_schema_is_refused_not_a_crash() -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(2000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(StructuredOutputError, match="nested too deeply"):
        check_schema(schema, "response_format")


def test_keyword_names_as_property_names_are_fine() -> None:
    # "not" and "uniqueItems" here are property names, not keywords.
    check_schema({"type": "object", "properties": {"not": {"type": "string"}, "uniqueItems": {}}}, "x")


def test_regex_and_grammar_checks() -> None:
    check_regex(r"[(?=]\(\?=x\)", "guided_regex")  # a class and escapes spell the construct: fine
    with pytest.raises(StructuredOutputError, match="lookahead"):
        check_regex("(?=a)b", "guided_regex")
    with pytest.raises(StructuredOutputError, match="not a valid regex"):
        check_regex("(a", "guided_regex")
    check_grammar('root ::= "a" | "b"', "guided_grammar")
    with pytest.raises(StructuredOutputError, match="root"):
        check_grammar('start ::= "a"', "guided_grammar")
    with pytest.raises(StructuredOutputError, match="empty"):
        check_grammar("  \n", "guided_grammar")
    with pytest.raises(StructuredOutputError) as info:
        check_supported(StructuredOutput("regex", r"\bword", "guided_regex"))
    assert info.value.param == "guided_regex"
