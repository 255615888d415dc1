"""Re-derive engine/structured/support.py's verdicts from the installed xgrammar.

    .venv/bin/python scripts/probe_xgrammar.py

Prints, for every probe, what xgrammar does (refused at compile time, ignored, only the empty value,
enforced) beside what support.py says, and exits 1 where they disagree. Grammars are built as
engine/structured/grammar.py compiles them: strict mode, no free whitespace.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version

import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from engine.structured.spec import StructuredOutputError
from engine.structured.support import (
    FORMAT_PROBES,
    PROBES,
    REGEX_PROBES,
    SUPPORTED_FORMATS,
    UNSUPPORTED_KEYWORDS,
    check_regex,
)


def schema_verdict(schema: dict[str, object], allowed: str, forbidden: str) -> str:
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    except RuntimeError:
        return "refused at compile time"
    if not accepts(grammar, allowed):
        return "refuses a valid instance"
    return "ignored" if accepts(grammar, forbidden) else "enforced"


def regex_compiles(pattern: str) -> bool:
    try:
        xgr.Grammar.from_regex(pattern)
    except RuntimeError:
        return False
    return True


def main() -> int:
    print(f"xgrammar {version('xgrammar')}")
    drift = 0
    for p in PROBES:
        verdict = schema_verdict(p.schema, p.allowed, p.forbidden)
        listed = p.keyword in UNSUPPORTED_KEYWORDS
        ok = (verdict == "enforced") != listed
        drift += not ok
        print(f"{'' if ok else 'DRIFT '}{p.keyword:24} {verdict:26} support.py: {'un' * listed}supported")
    for fmt, (allowed, forbidden) in FORMAT_PROBES.items():
        verdict = schema_verdict({"type": "string", "format": fmt}, allowed, forbidden)
        ok = (verdict == "enforced") == (fmt in SUPPORTED_FORMATS)
        drift += not ok
        print(f"{'' if ok else 'DRIFT '}format {fmt:17} {verdict}")
    for pattern, compiles in REGEX_PROBES.items():
        try:
            check_regex(pattern, "guided_regex")
            refused_here = False
        except StructuredOutputError:
            refused_here = True
        ok = regex_compiles(pattern) == compiles == (not refused_here)
        drift += not ok
        print(f"{'' if ok else 'DRIFT '}regex {pattern!r:14} xgrammar compiles: {regex_compiles(pattern)}")
    return 1 if drift else 0


if __name__ == "__main__":
    sys.exit(main())
