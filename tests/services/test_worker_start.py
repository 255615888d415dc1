"""A worker that cannot start (its broker unreachable) exits non-zero for a restart, instead of staying
up with its engine core and serving nothing.

The core ignores SIGTERM (its parent drains with it), so a worker that left the core to
multiprocessing's exit handler hung in that handler's join for good.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.servers import free_port
from harness.stack import launch

pytestmark = pytest.mark.timeout(240)


def test_a_worker_whose_broker_is_unreachable_exits_non_zero(model_path: Path, tmp_path: Path) -> None:
    nothing = f"127.0.0.1:{free_port()}"  # no broker listens here
    env = {
        "INFLIGHT_MODEL": str(model_path),
        "INFLIGHT_KAFKA_BOOTSTRAP": nothing,
        "INFLIGHT_REDIS_URL": f"redis://{nothing}/0",
        "INFLIGHT_TORCH_THREADS": "1",
    }
    worker = launch("worker", env, tmp_path)
    try:
        code = worker.proc.wait(timeout=200)
    except subprocess.TimeoutExpired:
        pytest.fail("the worker is still up without a broker:\n" + worker.log_path.read_text()[-3000:])
    finally:
        worker.stop(timeout_s=5)
    assert code != 0
    assert "the worker could not start" in worker.log_path.read_text()
