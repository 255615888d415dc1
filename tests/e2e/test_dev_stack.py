"""``inflight dev``: one command brings the stack up on loopback, Ctrl-C/SIGTERM takes all of it down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.models.tiny import default_model_path
from harness.servers import free_port

pytestmark = pytest.mark.timeout(180)


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            children = {int(c) for c in task.read_text().split()}
            todo.extend(children - found)
            found |= children
    return found


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
def test_dev_stack_up_serves_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "dev.out"
    with open(out, "wb") as sink:
        dev = subprocess.Popen(
            # The tiny model: `inflight dev` defaults to SmolLM2, which test_readme runs.
            [
                sys.executable,
                "-m",
                "inflight",
                "dev",
                "--port",
                str(port),
                "--model",
                str(default_model_path()),
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "INFLIGHT_SERVED_MODEL_NAME": "tiny"},
        )
    try:
        deadline = time.monotonic() + 120
        while b"inflight is up" not in out.read_bytes():
            assert dev.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        banner = out.read_text()
        assert f"http://127.0.0.1:{port}/v1" in banner and "curl" in banner
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 5},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 5
        children = _descendants(dev.pid)
        assert len(children) >= 4  # broker, Redis, worker, gateway
        dev.send_signal(signal.SIGTERM)
        assert dev.wait(60) == 0
        time.sleep(0.5)
        assert not [pid for pid in children if _alive(pid)], "children left behind"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        if dev.poll() is None:
            dev.kill()
