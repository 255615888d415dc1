"""The configuration reference, ``docs/configuration.md``, rendered from the code that reads the settings.

Sources: the services' settings (``services/common/settings.py``: ``ENV_NAMES``, the ``Settings`` fields and
the comment on each), the engine's own variables (``engine/envs.py``), the engine arguments
(``engine/config.py``: ``EngineArgs`` and the comment on each field) and the harness's variables. A field's
description is the comment block right above it, or the comment after it on its line; a comment line of
dashes (``# ---- Kafka ----``) starts a section.

    python -m inflight.reference            # print the page
    python -m inflight.reference --write    # rewrite docs/configuration.md
    python -m inflight.reference --check    # exit 1 when the page is stale or a setting has no description

``tests/test_docs.py`` runs the check, so the page cannot drift from the code.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "configuration.md"
WRITE_COMMAND = "python -m inflight.reference --write"

_SECTION = re.compile(r"^-{2,}\s*(.+?)\s*-*$")
_KINDS = {
    "str": "string",
    "int": "integer",
    "float": "number",
    "bool": "true / false",
    "csv": "comma list",
    "json": "JSON object",
}
# Settings fields that no variable sets: derived per process.
_INTERNAL_SETTINGS = {"instance_id"}


@dataclass(frozen=True)
class FieldDoc:
    name: str
    section: str | None  # the latest ``# ---- Title ----`` line above the field
    doc: str  # "" when the field has no comment


def field_docs(cls: type) -> dict[str, FieldDoc]:
    """Each annotated field of ``cls``'s body with its section and comment, in declaration order."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments: dict[int, str] = {}  # line number -> comment text
    own_line: set[int] = set()  # lines that hold nothing but a comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            comments[row] = tok.string.lstrip("#").strip()
            if lines[row - 1].lstrip().startswith("#"):
                own_line.add(row)
    sections = {row: match.group(1) for row in sorted(own_line) if (match := _SECTION.match(comments[row]))}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    found: dict[str, FieldDoc] = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        row = node.lineno - 1
        while row in own_line and row not in sections:
            above.insert(0, comments[row])
            row -= 1
        trailing = comments.get(node.lineno) if node.lineno not in own_line else None
        doc = " ".join([*above, *([trailing] if trailing else [])])
        section = next((sections[r] for r in sorted(sections, reverse=True) if r < node.lineno), None)
        found[node.target.id] = FieldDoc(node.target.id, section, doc)
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(value: Any) -> str:
    if value is None or value == ():
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value}`"


def _settings_defaults() -> dict[str, Any]:
    from services.common.settings import Settings

    defaults: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return defaults


def problems() -> list[str]:
    """What keeps the reference from describing every setting: each message says what to add, where."""
    from engine.config import EngineArgs
    from services.common.settings import ENV_NAMES, Settings

    found: list[str] = []
    docs = field_docs(Settings)
    named = {attr for attr, _ in ENV_NAMES.values()}
    for env_name, (attr, _) in ENV_NAMES.items():
        if attr not in docs:
            found.append(f"ENV_NAMES maps {env_name} to {attr!r}, which is not a Settings field")
        elif not docs[attr].doc:
            found.append(
                f"{env_name} (Settings.{attr}) has no description: write a comment right above the field in "
                "services/common/settings.py saying what it bounds and why its default"
            )
    for attr in docs:
        if attr not in named and attr not in _INTERNAL_SETTINGS:
            found.append(f"Settings.{attr} has no variable: add its INFLIGHT_* name to ENV_NAMES")
    for name, doc in field_docs(EngineArgs).items():
        if name != "model" and not doc.doc:
            found.append(
                f"engine argument {name} has no description: write a comment right above the field of "
                "EngineArgs in engine/config.py saying what it does and why its default"
            )
    return found


def _service_settings() -> list[str]:
    from services.common.settings import DEPRECATED_NAMES, ENV_NAMES, Settings

    env_of = {attr: (name, kind) for name, (attr, kind) in ENV_NAMES.items()}
    defaults = _settings_defaults()
    out: list[str] = []
    section: str | None = "?"
    for attr, doc in field_docs(Settings).items():
        if attr not in env_of:
            continue
        if doc.section != section:
            section = doc.section
            out += ["", f"### {(section or 'general').capitalize()}", ""]
            out += ["| Variable | Type | Default | Description |", "|---|---|---|---|"]
        name, kind = env_of[attr]
        row = [f"`{name}`", _KINDS.get(kind, kind), _default(defaults.get(attr)), _cell(doc.doc)]
        out.append("| " + " | ".join(row) + " |")
    if DEPRECATED_NAMES:
        out += ["", "### Deprecated names", "", "They still work, with a warning at start-up.", ""]
        out += ["| Old name | Use instead |", "|---|---|"]
        out += [f"| `{old}` | `{new}` |" for old, new in DEPRECATED_NAMES.items()]
    return out


def _type_name(annotation: Any) -> str:
    text = str(annotation)
    literal = re.fullmatch(r"Literal\[(.*)\]", text)
    if literal:
        return " \\| ".join(part.strip().strip("'\"") for part in literal.group(1).split(","))
    return _cell(text)


def _engine_arguments() -> list[str]:
    from engine.config import EngineArgs

    docs = field_docs(EngineArgs)
    out = ["| Argument | Type | Default | Description |", "|---|---|---|---|"]
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            continue
        default = "`None`" if f.default is None else f"`{f.default!r}`".replace("'", '"')
        out.append(f"| `{f.name}` | {_type_name(f.type)} | {default} | {_cell(docs[f.name].doc)} |")
    return out


def render() -> str:
    """The whole page, as ``--write`` writes it."""
    from engine.envs import ENGINE_ENVS
    from services.common.settings import HARNESS_ENVS

    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the code by `{WRITE_COMMAND}`; do not edit by hand. "
        "tests/test_docs.py fails when this page and the code differ. -->",
        "",
        "Three layers: the services' environment variables (gateway and worker), the engine's own "
        "environment variables, and the engine arguments (`engine.LLM(...)` keyword arguments, or JSON in "
        "`INFLIGHT_ENGINE_ARGS` for a worker). An empty variable counts as unset. Values are checked at "
        "start-up: a bad one stops the process with a message naming the variable.",
        "",
        "## Service settings",
        "",
        "Read once by `inflight gateway` and `inflight worker` (`services/common/settings.py`). Helm sets "
        "them from `charts/inflight/values.yaml`, docker-compose in its `environment:` blocks.",
        *_service_settings(),
        "",
        "## Engine environment variables",
        "",
        "Read by the engine wherever it runs (a worker, `engine.LLM`, the benchmarks): `engine/envs.py`.",
        "",
        "| Variable | Values | Default | Description |",
        "|---|---|---|---|",
        *(f"| `{v.name}` | {_cell(v.kind)} | {_cell(v.default)} | {_cell(v.doc)} |" for v in ENGINE_ENVS),
        "",
        "## Engine arguments",
        "",
        "`engine.LLM(model, **args)`, `AsyncLLMEngine.from_engine_args(model, **args)`, or a worker's "
        '`INFLIGHT_ENGINE_ARGS` (`{"max_num_seqs": 64}`). Unknown names are refused '
        "(`engine/config.py`, `EngineArgs`).",
        "",
        *_engine_arguments(),
        "",
        "## Test and benchmark harness",
        "",
        "Never read by a deployed service; declared so that a worker started with them does not log them "
        "as unknown.",
        "",
        "| Variable | Description |",
        "|---|---|",
        *(f"| `{name}` | {_cell(doc)} |" for name, doc in HARNESS_ENVS.items()),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inflight.reference", description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite {PAGE.relative_to(REPO)}")
    mode.add_argument("--check", action="store_true", help="exit 1 when the page is stale or incomplete")
    args = parser.parse_args(argv)
    missing = problems()
    for message in missing:
        print(f"reference: {message}", file=sys.stderr)
    page = render()
    if args.write:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        PAGE.write_text(page)
        print(f"wrote {PAGE.relative_to(REPO)}")
    elif args.check:
        if not PAGE.is_file() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(REPO)} is stale: run `{WRITE_COMMAND}`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
