"""A request running when the broker restarts empty, then handed back, is not stranded: the worker finds
its message gone and produces it again (services/worker/requeue.py). Real broker and Redis, restarted."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from harness.servers import ServerProcess
from harness.stack import ServiceProcess
from tests.services.sse import text_of
from tests.services.stack import new_stack, worker_stats
from tests.services.test_restarts import STEP_DELAY_S, _reference, _stream

pytestmark = pytest.mark.timeout(150)


def test_a_request_handed_back_after_the_broker_lost_its_log_resumes(
    own_servers: tuple[ServerProcess, ServerProcess], model_path: Path, tmp_path: Path
) -> None:
    """A stream is running when the broker restarts empty, then its engine dies: handing it back, the
    worker finds its message gone and produces it again, and the other worker resumes it from its log
    (services/worker/requeue.py). Without that no worker would ever see it again."""
    kafka, redis_server = own_servers
    stack = new_stack(
        kafka, redis_server, model_path, tmp_path, workers=2, INFLIGHT_FAULT_STEP_DELAY_S=STEP_DELAY_S
    )
    try:
        expected = _reference(stack)
        doomed: list[ServiceProcess] = []

        def lose_the_log_then_the_engine() -> None:
            kafka.restart()
            request_ids = [w for w in stack.workers if worker_stats(w)["requests"]]
            (owner,) = request_ids
            os.kill(worker_stats(owner)["engine_pid"], signal.SIGKILL)
            doomed.append(owner)

        chunks = _stream(stack, lose_the_log_then_the_engine)
        assert chunks[-1] == "[DONE]"
        assert text_of(chunks) == expected
        assert "produced it again" in doomed[0].tail_log(50_000)
    finally:
        stack.close()
