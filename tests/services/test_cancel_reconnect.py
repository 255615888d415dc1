"""A cancel published while the worker's pub/sub connection is down still reaches the request."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.servers import ServerProcess
from tests.services.stack import MODEL_NAME, new_stack, wait_for

pytestmark = pytest.mark.timeout(180)


def test_cancel_during_a_pubsub_reconnect(
    own_servers: tuple[ServerProcess, ServerProcess], model_path: Path, tmp_path: Path
) -> None:
    kafka, redis_server = own_servers
    # Paced at 10 ms a step, the job's 1,800 tokens take at least 18 s: it is still running when the
    # cancel comes, about 2 s after it starts, on any host.
    stack = new_stack(kafka, redis_server, model_path, tmp_path, INFLIGHT_FAULT_STEP_DELAY_S="0.01")
    try:
        body = {"model": MODEL_NAME, "prompt": "a long one", "max_tokens": 1800, "ignore_eos": True}
        created = httpx.post(
            f"{stack.url}/v1/jobs", json={"endpoint": "/v1/completions", "body": body}, timeout=30
        )
        job_url = f"{stack.url}/v1/jobs/{created.json()['id']}"

        def running() -> Any:
            return httpx.get(job_url, timeout=10).json()["status"] == "in_progress"

        wait_for(running, 60, interval_s=0.2, message="the job to run")
        r = stack.redis_client()

        # Keep dropping every pub/sub connection (the worker's cancel listener among them) for a
        # while, and cancel in the middle of it: the cancel message is published while the listener
        # is between connections (redis-py reconnects within milliseconds, so one kill is a race).
        def storm() -> None:
            end = time.monotonic() + 1.5
            while time.monotonic() < end:
                r.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
                time.sleep(0.001)

        killer = threading.Thread(target=storm)
        killer.start()
        time.sleep(0.5)
        assert httpx.delete(job_url, timeout=10).json()["status"] in ("cancelling", "cancelled")
        killer.join()
        final = wait_for(
            lambda: (job := httpx.get(job_url, timeout=10).json())["status"] != "in_progress" and job,
            20,
            interval_s=0.2,
            message="the job to stop",
        )
        assert final["status"] == "cancelled", final["status"]
        assert final["result"] is None or final["usage"]["completion_tokens"] < 1800
    finally:
        stack.close()
