"""User documentation: a README that stays a guide, docs/ that match the code, no history where users read.

* ``docs/configuration.md`` is generated from the code (``inflight/reference.py``); it must equal what the
  generator renders now, and every setting and engine argument must have a description.
* README.md stays a guide of at most 350 lines; its links into docs/ resolve.
* No issue numbers, run records or remarks about when something was measured in the README, docs/,
  the Makefile's comments or any ``--help`` text: history lives in git.
"""

from __future__ import annotations

import argparse
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from inflight import reference

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 350

# What a changelog or a work log says, not a guide: "issue 2's targets", "run 17", "runs 12-16", "this
# session", "last time". Measured figures name the CPU they ran on instead of when.
HISTORY = re.compile(
    r"\bissues?\b|\bruns? \d+\b|\bthis session\b|\blast time\b|\bthis time\b",
    re.IGNORECASE,
)


def test_configuration_reference_describes_every_setting() -> None:
    missing = reference.problems()
    assert not missing, "\n".join(missing)


def test_configuration_reference_matches_the_code() -> None:
    page = reference.PAGE
    assert page.is_file(), f"no {page}: run `{reference.WRITE_COMMAND}`"
    assert page.read_text() == reference.render(), (
        f"{page.relative_to(REPO)} differs from the code: run `{reference.WRITE_COMMAND}` and commit it"
    )


def test_the_reference_names_every_variable_the_code_declares() -> None:
    from engine.envs import ENGINE_ENVS
    from services.common.settings import DEPRECATED_NAMES, ENV_NAMES, HARNESS_ENVS

    text = reference.PAGE.read_text()
    names = [*ENV_NAMES, *DEPRECATED_NAMES, *HARNESS_ENVS, *(v.name for v in ENGINE_ENVS)]
    assert [n for n in names if f"`{n}`" not in text] == []
    assert "`max_num_batched_tokens`" in text and "`scheduling_policy`" in text  # engine arguments


def test_readme_is_a_guide_of_bounded_length() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_links_into_docs_resolve() -> None:
    links = re.findall(r"\]\((docs/[^)#\s]+)", README.read_text())
    for page in ("architecture.md", "benchmarks.md", "planner.md", "operations.md", "configuration.md"):
        assert f"docs/{page}" in links, page
    assert [link for link in links if not (REPO / link).is_file()] == []
    for doc in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#\s:]+\.md)", doc.read_text()):
            assert (doc.parent / target).is_file(), (doc.name, target)


def _user_texts() -> Iterator[tuple[str, str]]:
    yield "README.md", README.read_text()
    for doc in sorted(DOCS.glob("*.md")):
        yield f"docs/{doc.name}", doc.read_text()
    makefile = (REPO / "Makefile").read_text().splitlines()
    comments = [line for line in makefile if line.lstrip().startswith("#")]
    yield "Makefile comments", "\n".join(comments)


def _parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    from inflight import cli

    roots = [("inflight", cli._parser())]
    # The benchmarks parse their own arguments (a passthrough command of inflight, or python -m bench).
    bench_parser = getattr(importlib.import_module("bench.cli"), "_parser", None)
    if bench_parser is not None:
        roots.append(("bench", bench_parser()))
    stack = list(roots)
    while stack:
        name, parser = stack.pop()
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack += [(f"{name} {sub}", p) for sub, p in action.choices.items()]


@pytest.mark.parametrize("where,text", list(_user_texts()), ids=[w for w, _ in _user_texts()])
def test_no_history_where_users_read(where: str, text: str) -> None:
    found = sorted({m.group(0) for m in HISTORY.finditer(text)})
    assert not found, f"{where}: {found} (history belongs in git, not in what users read)"


def test_no_history_in_help_texts() -> None:
    seen = 0
    for name, parser in _parsers():
        seen += 1
        found = sorted({m.group(0) for m in HISTORY.finditer(parser.format_help())})
        assert not found, f"`{name} --help`: {found}"
    assert seen >= 10  # the walk reached the subcommands
