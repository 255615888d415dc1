"""The engine is the bottom layer: importing any of it loads no service, benchmark, harness or command-line
code, nor the service stack's libraries (FastAPI, Kafka, Redis). tests/test_layering.py pins the rest."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.imports import modules_loaded_by_importing

REPO = Path(__file__).resolve().parents[2]
# The layers above the engine, the repository-only trees, and the service stack's own libraries.
UPPER = {"services", "bench", "inflight", "harness", "tests", "fastapi", "aiokafka", "redis"}


def test_engine_imports_no_service_bench_or_cli_module() -> None:
    loaded = modules_loaded_by_importing("engine")
    assert "engine.llm_engine" in loaded and "engine.sched.scheduler" in loaded  # the walk did import
    assert "engine.runner.model_runner" in loaded
    above = [m for m in loaded if m.split(".")[0] in UPPER]
    assert above == []


def test_no_engine_source_imports_upper_layers_even_lazily() -> None:
    # The runtime check above misses imports inside functions (the old ``engine/cli.py`` had only those).
    offenders = []
    for path in sorted((REPO / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in UPPER]
    assert offenders == []


def test_the_model_runner_is_below_the_core_and_holds_no_text() -> None:
    # engine/runner runs a scheduled step on the model; the core (engine/core) drives it, never the
    # reverse, and text (tokenizer, detokenizer, output processing) lives beside the client.
    above = (
        "engine.core",
        "engine.llm_engine",
        "engine.llm",
        "engine.tokenizer",
        "engine.sampling.detokenizer",
    )
    offenders = []
    for path in sorted((REPO / "engine" / "runner").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.startswith(above)]
    assert offenders == []
    assert not (REPO / "engine" / "worker").exists()  # the model runner's package is not named "worker"
