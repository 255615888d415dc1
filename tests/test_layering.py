"""What ships is the product: the wheel carries engine, services and inflight, and none of them imports the
repository-only trees (bench/, harness/, tests/). Services import no planner; the command line reaches the
loopback harness only through ``inflight dev``'s optional, lazy import, and the benchmarks through
``python -m bench`` (which may import everything installed, never the reverse)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.imports import modules_loaded_by_importing

REPO = Path(__file__).resolve().parents[1]
INSTALLED = ("engine", "services", "inflight")
REPOSITORY_ONLY = {"bench", "harness", "tests"}


def _imports(package: str) -> list[tuple[str, str]]:
    """(file, imported module) for every absolute import in a package, at any depth (lazy ones too)."""
    found = []
    for path in sorted((REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(str(path.relative_to(REPO)), alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append((str(path.relative_to(REPO)), node.module))
    return found


def test_the_wheel_holds_exactly_engine_services_and_inflight() -> None:
    # setuptools' own discovery with the pyproject's settings: what `pip wheel .` packs.
    from setuptools import find_packages

    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(REPO), include=find["include"], exclude=find.get("exclude", ()))
    assert {p.split(".")[0] for p in packages} == set(INSTALLED)
    assert "services.gateway" in packages and "inflight.plan" in packages and "engine.sched" in packages


def test_nothing_installed_imports_bench_harness_or_tests() -> None:
    offenders = [
        f"{f}: {m}" for pkg in INSTALLED for f, m in _imports(pkg) if m.split(".")[0] in REPOSITORY_ONLY
    ]
    assert offenders == []


def test_services_import_no_planner_or_command_line() -> None:
    offenders = [f"{f}: {m}" for f, m in _imports("services") if m.split(".")[0] == "inflight"]
    assert offenders == []


def test_importing_every_installed_module_loads_no_repository_only_module() -> None:
    loaded = modules_loaded_by_importing("services", "inflight")
    assert "inflight.plan.simulate" in loaded and "services.gateway.app" in loaded  # the walk did import
    assert [m for m in loaded if m.split(".")[0] in REPOSITORY_ONLY] == []


def test_the_command_line_has_no_bench_and_bench_has_its_own() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "inflight", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    for command in ("gateway", "worker", "dev", "plan"):
        assert command in done.stdout
    assert "bench" not in done.stdout
    bench = subprocess.run(
        [sys.executable, "-m", "bench", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert bench.returncode == 0, bench.stderr
    for command in ("engine", "service", "sweep", "chaos", "host", "policies", "validate"):
        assert command in bench.stdout


def test_inflight_dev_finds_the_harness_of_its_checkout_from_any_directory(tmp_path: Path) -> None:
    # -I: neither the checkout nor the working directory is on sys.path, as for the console script run
    # from elsewhere; the editable install maps only the packaged trees. harness/ is still found.
    script = "from inflight.commands.dev import load_harness\nprint(load_harness().__file__)\n"
    done = subprocess.run(
        [sys.executable, "-I", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == REPO / "harness" / "dev.py"


def test_inflight_dev_outside_a_checkout_says_it_needs_one(tmp_path: Path) -> None:
    # inflight as a wheel installs it: the package alone, no harness/ beside it.
    site = tmp_path / "site"
    shutil.copytree(REPO / "inflight", site / "inflight")
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(site)!r})\n"
        "import inflight\n"
        f"assert inflight.__file__.startswith({str(site)!r}), inflight.__file__\n"
        "from inflight.cli import main\n"
        "sys.exit(main(['dev']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "source checkout" in done.stderr and "make run" in done.stderr


# A worker request's status and errors (services/worker/lifecycle.py): read anywhere, changed there alone.
_RUN_STATE_ATTRS = {
    "_status", "status", "_errors", "errors", "_error_code", "error_code", "_error_param", "error_param",
    "cancelled", "handed_back", "fenced", "engine_died_under", "state",
}  # fmt: skip
_PRIVATE_STATE = {"_status", "_errors", "_error_code", "_error_param"}


def _state_writes(path: Path) -> list[str]:
    """Assignments to a run's status attributes (plain, augmented, annotated or through a subscript, as
    ``run.errors[0] = ...``), and any use of RunState's private fields, in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        for target in flat:
            while isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Attribute) and target.attr in _RUN_STATE_ATTRS:
                found.append(f"{path.name}:{node.lineno} assigns .{target.attr}")
        if isinstance(node, ast.Attribute) and node.attr in _PRIVATE_STATE:
            found.append(f"{path.name}:{node.lineno} reads .{node.attr}")
    return found


def test_a_worker_requests_status_changes_only_in_lifecycle(tmp_path: Path) -> None:
    worker = REPO / "services" / "worker"
    owners = {"lifecycle.py"}
    offenders = [
        w for path in sorted(worker.glob("*.py")) if path.name not in owners for w in _state_writes(path)
    ]
    # Run's own __post_init__ creates the state object (a new request, or a retry's from the failed one).
    assert [o.replace(o[o.index(":") : o.index(" ")], "") for o in offenders] == [
        "run_state.py assigns .state"
    ]
    # The check does catch what it looks for: the flags this replaced, set from outside.
    sample = tmp_path / "control.py"
    sample.write_text(
        "run.errors[0] = 'x'\nrun.cancelled = True\nrun.holds_lease, run.fenced = False, True\n"
    )
    assert _state_writes(sample) == [
        "control.py:1 assigns .errors",
        "control.py:2 assigns .cancelled",
        "control.py:3 assigns .fenced",
    ]
