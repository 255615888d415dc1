"""A worker that cannot start (its broker unreachable, its port taken) exits non-zero for a restart,
instead of staying up with its engine core and serving nothing.

The core ignores SIGTERM (its parent drains with it), so a worker that left the core to
multiprocessing's exit handler hung in that handler's join for good.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from harness.servers import free_port
from harness.stack import launch
from tests.services.stack import Stack

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


def test_a_worker_whose_port_is_taken_exits_before_loading_its_model(stack: Stack) -> None:
    """Its HTTP port is bound before the model loads: a port in use ends the process at once with
    uvicorn's error, not after a load and an engine core that a failed start must then stop."""
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        worker = launch("worker", stack.env, stack.log_dir / "port-taken", port=port)
        try:
            code = worker.proc.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
            pytest.fail(f"the worker did not exit with its port taken:\n{worker.tail_log()}")
    log = worker.tail_log()
    assert code != 0, log
    assert "address already in use" in log.lower(), log
    assert "loaded" not in log, log  # it never got as far as the model
