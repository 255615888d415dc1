"""The CPU kernels' build lock: a builder killed mid-build must not make every later start wait forever.

torch's extension loader waits while ``<build dir>/lock`` exists; a builder killed mid-build leaves it.
These tests kill a real builder process and use torch's own ``FileBaton`` as the stub build, so they
compile nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.utils.file_baton import FileBaton

from engine.kernels import cpu
from engine.kernels.cpu import build_lock
from engine.kernels.cpu.build_lock import OWN_LOCK, TORCH_LOCK, exclusive_build

# A builder in another process: takes our lock, takes torch's baton as cpp_extension does, says so,
# then waits for a line on stdin (or to be killed) before releasing both. build_lock.py is loaded by
# path so the child starts without torch.
_BUILDER = f"""
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("build_lock", {str(Path(build_lock.__file__))!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
directory = sys.argv[1]
with module.exclusive_build(__import__("pathlib").Path(directory)):
    fd = os.open(os.path.join(directory, {TORCH_LOCK!r}), os.O_CREAT | os.O_EXCL)
    print("building", flush=True)
    sys.stdin.readline()
    os.close(fd)
    os.remove(os.path.join(directory, {TORCH_LOCK!r}))
"""


@pytest.fixture
def builder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    child = subprocess.Popen(
        [sys.executable, "-c", _BUILDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "building"
    assert (tmp_path / TORCH_LOCK).exists()
    yield child
    if child.poll() is None:
        child.kill()
    child.wait(timeout=30)


def _torch_would_proceed(directory: Path) -> bool:
    """What cpp_extension does first: try to take the baton (it waits forever when this is False)."""
    baton = FileBaton(str(directory / TORCH_LOCK))
    if not baton.try_acquire():
        return False
    baton.release()
    return True


def test_a_lock_left_by_a_killed_builder_is_broken_with_a_warning(
    tmp_path: Path, builder: subprocess.Popen[str], caplog: pytest.LogCaptureFixture
) -> None:
    builder.send_signal(signal.SIGKILL)
    builder.wait(timeout=30)
    assert (tmp_path / TORCH_LOCK).exists(), "the dead builder left torch's lock file behind"
    assert not _torch_would_proceed(tmp_path)  # what every later start used to wait on, forever

    built: list[bool] = []
    with caplog.at_level(logging.WARNING, logger=build_lock.__name__), exclusive_build(tmp_path):
        built.append(_torch_would_proceed(tmp_path))
    assert built == [True]
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        f"died (pid {builder.pid})" in warning.getMessage()
        and str(tmp_path / TORCH_LOCK) in warning.getMessage()
    )
    assert not (tmp_path / TORCH_LOCK).exists()


def test_a_live_builder_is_waited_for_and_its_lock_left_alone(
    tmp_path: Path, builder: subprocess.Popen[str], caplog: pytest.LogCaptureFixture
) -> None:
    entered = threading.Event()
    lock_seen: list[bool] = []

    def build() -> None:
        with exclusive_build(tmp_path):
            lock_seen.append((tmp_path / TORCH_LOCK).exists())
            entered.set()

    with caplog.at_level(logging.INFO, logger=build_lock.__name__):
        waiter = threading.Thread(target=build)
        waiter.start()
        # The waiter says whom it waits for just before it blocks on the lock.
        deadline = time.monotonic() + 60
        while not any("waiting for process" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the waiter never reached the lock"
            time.sleep(0.01)
        assert f"waiting for process {builder.pid}," in caplog.text
        assert not entered.is_set() and (tmp_path / TORCH_LOCK).exists()

        assert builder.stdin is not None
        builder.stdin.write("done\n")
        builder.stdin.flush()
        builder.wait(timeout=30)
        waiter.join(timeout=30)
    assert entered.is_set() and lock_seen == [False]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "a finished build is not stale"
    assert (tmp_path / OWN_LOCK).read_text().strip() == str(os.getpid())  # the last holder, for the next one


def test_load_breaks_a_stale_lock_before_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setenv("INFLIGHT_CPU_EXT_DIR", str(tmp_path))
    monkeypatch.delenv("INFLIGHT_DISABLE_CPU_KERNELS", raising=False)
    directory = cpu.build_dir()
    assert directory.parent == tmp_path
    directory.mkdir(parents=True)
    (directory / TORCH_LOCK).touch()  # a build that died before we kept a lock of our own
    calls: list[str] = []

    def stub_build(*, build_directory: str, **kwargs: object) -> None:
        calls.append(build_directory)
        assert _torch_would_proceed(Path(build_directory)), "torch would wait on the stale lock"

    monkeypatch.setattr(cpp_extension, "load", stub_build)
    with caplog.at_level(logging.WARNING, logger=build_lock.__name__):
        assert cpu.load.__wrapped__() is True
    assert calls == [str(directory)]
    assert "died (pid ?)" in caplog.text
