"""``inflight dev``: one command brings the stack up on loopback, Ctrl-C/SIGTERM takes all of it down; it
says it is up only once its workers consume the topic, waiting longer the more workers it starts."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import cast

import httpx
import pytest

from engine.models.tiny import default_model_path
from harness.dev import ready_bound_s
from harness.stack import ServiceProcess, readiness_line
from tests.e2e.conftest import start_dev

pytestmark = pytest.mark.timeout(180)


def test_the_ready_bound_grows_with_the_workers() -> None:
    # Workers load together on shared cores: four take about four times one's load.
    assert ready_bound_s(1) < ready_bound_s(2) < ready_bound_s(4)
    assert ready_bound_s(4) - ready_bound_s(1) == 3 * (ready_bound_s(2) - ready_bound_s(1))


def test_progress_counts_each_role() -> None:
    def child(role: str) -> ServiceProcess:
        return ServiceProcess(role, cast(subprocess.Popen[bytes], None), 0, Path("unused.log"))

    workers = [child("worker") for _ in range(4)]
    gateway = child("gateway")
    everyone = [*workers, gateway]
    assert readiness_line(everyone, [workers[2], workers[3], gateway]) == (
        "workers 2/4 ready (loading the model), gateway not ready (starting)"
    )
    assert readiness_line(everyone, [workers[0]]) == "workers 3/4 ready (loading the model), gateway ready"
    assert readiness_line([workers[0]], [workers[0]]) == "worker not ready (loading the model)"


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
        assert f"waiting up to {ready_bound_s(1):.0f}s" in banner
        # Up means served: the gateway already counts the worker consuming its topic.
        assert httpx.get(f"{dev.url}/readyz", timeout=10).json()["workers"] == 1
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
