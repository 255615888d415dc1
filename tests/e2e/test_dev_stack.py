"""``inflight dev``: one command brings the stack up on loopback, Ctrl-C/SIGTERM takes all of it down."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from engine.models.tiny import default_model_path
from tests.e2e.conftest import start_dev

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
    # The tiny model: this checks the command's lifecycle; the shared stack serves the default model.
    dev = start_dev(tmp_path, model=str(default_model_path()), env={"INFLIGHT_SERVED_MODEL_NAME": "tiny"})
    try:
        banner = dev.output()
        assert f"{dev.url}/v1" in banner and "curl" in banner
        resp = httpx.post(
            f"{dev.url}/v1/completions",
            json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 5},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 5
        children = _descendants(dev.proc.pid)
        assert len(children) >= 4  # broker, Redis, worker, gateway
        assert dev.stop() == 0
        time.sleep(0.5)
        assert not [pid for pid in children if _alive(pid)], "children left behind"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{dev.url}/healthz", timeout=5)
    finally:
        if dev.proc.poll() is None:
            dev.proc.kill()
