"""The cache root: INFLIGHT_HOME, then XDG_CACHE_HOME, then ~/.cache, for every file inflight writes.

In the chart's pods HOME is a 1 GiB scratch volume and XDG_CACHE_HOME the volume sized for models: a
GGUF conversion that ignored XDG_CACHE_HOME filled the scratch volume and got the pod evicted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.models import gguf
from engine.paths import cache_root, cpu_ext_root, models_dir


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A clean environment: HOME in tmp_path, none of the cache variables set."""
    for name in ("INFLIGHT_HOME", "XDG_CACHE_HOME", "INFLIGHT_CPU_EXT_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_default_is_under_home(home: Path) -> None:
    assert cache_root() == home / ".cache" / "inflight"
    assert models_dir() == home / ".cache" / "inflight" / "models"
    assert cpu_ext_root() == home / ".cache" / "inflight" / "cpu_ext"


def test_xdg_cache_home_moves_everything(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cache_root() == tmp_path / "cache" / "inflight"
    assert gguf.model_cache_dir() == tmp_path / "cache" / "inflight" / "models"
    assert cpu_ext_root() == tmp_path / "cache" / "inflight" / "cpu_ext"


@pytest.mark.parametrize("value", ["", "relative/cache"])
def test_an_empty_or_relative_xdg_cache_home_is_ignored(
    home: Path, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", value)  # the XDG spec: such a value is invalid
    assert cache_root() == home / ".cache" / "inflight"


def test_inflight_home_wins_for_models_not_for_kernels(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("INFLIGHT_HOME", str(tmp_path / "mine"))
    assert gguf.model_cache_dir() == tmp_path / "mine" / "models"
    # A test's temporary INFLIGHT_HOME must not cost a kernel rebuild: kernels stay in the user's cache.
    assert cpu_ext_root() == tmp_path / "cache" / "inflight" / "cpu_ext"
    monkeypatch.setenv("INFLIGHT_CPU_EXT_DIR", str(tmp_path / "ext"))
    assert cpu_ext_root() == tmp_path / "ext"


def test_the_tiny_model_is_written_under_xdg_cache_home(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.models.tiny import default_model_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = default_model_path()
    assert path == tmp_path / "cache" / "inflight" / "models" / "tiny-llama"
    assert (path / "config.json").is_file()
    assert not home.exists(), "nothing written under HOME"


def test_no_module_builds_its_own_cache_path() -> None:
    """Every cache path goes through engine/paths.py: a module spelling '.cache' itself ignores XDG."""
    repo = Path(__file__).resolve().parents[2]
    offenders = [
        str(path.relative_to(repo))
        for folder in ("engine", "services", "inflight", "bench", "harness")
        for path in sorted((repo / folder).rglob("*.py"))
        if path.name != "paths.py" and '".cache"' in path.read_text()
    ]
    assert offenders == []
