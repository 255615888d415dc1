"""A gateway SIGKILLed mid-stream: the workers learn that its liveness key lapsed and abort its requests."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from harness.servers import ServerProcess
from services.common import keys
from tests.services.stack import MODEL_NAME, new_stack, wait_for, worker_stats

pytestmark = pytest.mark.timeout(180)


def test_requests_of_a_dead_gateway_are_aborted(
    own_servers: tuple[ServerProcess, ServerProcess], model_path: Path, tmp_path: Path
) -> None:
    kafka, redis_server = own_servers
    # The orphan must outlive the detection (liveness TTL + grace, up to about 8 s): paced at 20 ms a
    # step, its 1,000 tokens take at least 20 s on any host (an unpaced one finished on a fast host).
    stack = new_stack(kafka, redis_server, model_path, tmp_path, INFLIGHT_FAULT_STEP_DELAY_S="0.02")
    try:
        body = {
            "model": MODEL_NAME,
            "prompt": "orphan",
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
        }
        first_token = threading.Event()
        request_id: list[str] = []

        def client() -> None:
            try:
                with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: {") and not request_id:
                            request_id.append(line.split('"id":"', 1)[1].split('"', 1)[0])
                            first_token.set()
            except httpx.HTTPError:
                pass  # the gateway dies under it

        reader = threading.Thread(target=client, daemon=True)
        reader.start()
        assert first_token.wait(60)
        assert stack.gateway is not None
        stack.gateway.kill()
        killed = time.monotonic()
        worker = stack.workers[0]
        wait_for(lambda: not worker_stats(worker)["requests"], 20, interval_s=0.2, message="the abort")
        record = stack.redis_client().hgetall(keys.record(request_id[0]))
        assert record["status"] == "cancelled", record
        assert time.monotonic() - killed < 15
    finally:
        stack.close()
