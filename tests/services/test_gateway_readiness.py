"""The gateway's background loops supervised as the worker's are, and a /readyz that says whether any
worker consumes its topic.

Unit: a loop that returns counts as down and is restarted (a gateway loop has no job that ends). Then a
real gateway whose token-hub reader fails at its first starts (the fault-injection variable the worker
uses): /readyz answers 503 naming it, then 200 once it runs, and streams work; its "workers" field
follows the one worker of the stack, without changing the status.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.servers import ServerProcess
from services.gateway.background import Supervisor, forever
from tests.services.stack import MODEL_NAME, new_stack, wait_for


class _Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.timeout(30)
async def test_a_loop_that_returns_is_down_and_restarted(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    sup = Supervisor(base_s=0.001, cap_s=0.002, stable_s=5.0, clock=clock)
    starts = 0
    forever_after = asyncio.Event()

    async def falls_out_of_its_loop() -> None:
        nonlocal starts
        starts += 1
        if starts >= 3:
            await forever_after.wait()  # the third start keeps running

    caplog.set_level(logging.INFO, logger="services.worker.supervise")
    task = sup.start("queue_watch", forever("queue_watch", falls_out_of_its_loop))
    async with asyncio.timeout(10):
        while starts < 3:
            await asyncio.sleep(0.001)
    (problem,) = sup.problems()  # restarted less than stable_s ago, after a return
    assert problem.startswith("queue_watch: restarted") and "returned" in problem, problem
    assert "background task queue_watch failed (2 in a row)" in caplog.text
    clock.now += 5.0
    assert sup.problems() == []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def _readyz(url: str) -> tuple[int, dict[str, Any]]:
    resp = httpx.get(f"{url}/readyz", timeout=10)
    return resp.status_code, resp.json()


@pytest.mark.timeout(240)
def test_readyz_reports_failed_loops_and_consuming_workers(
    kafka: ServerProcess, redis_server: ServerProcess, model_path: Path, tmp_path: Path
) -> None:
    stack = new_stack(kafka, redis_server, model_path, tmp_path, gateway=False)
    try:
        # Six failed starts: 0.2 + 0.4 + ... + 6.4 s of backoff, a dozen seconds of "down" to see.
        gateway = stack.add_gateway(wait=False, INFLIGHT_FAULT_TASK_FAILS="token_hub:6")
        seen: list[dict[str, Any]] = []

        def down() -> bool:
            try:
                status, body = _readyz(gateway.url)
            except httpx.HTTPError:
                return False  # not listening yet
            seen.append(body)
            return status == 503 and any(t.startswith("token_hub:") for t in body["tasks"])

        wait_for(down, 60, interval_s=0.2, message="/readyz to report the failing token hub")
        assert seen[-1]["redis"] and seen[-1]["kafka"], seen[-1]
        wait_for(lambda: _readyz(gateway.url)[0] == 200, 60, interval_s=0.5, message="recovery")
        status, body = _readyz(gateway.url)
        assert (status, body["tasks"], body["workers"]) == (200, [], 1), body
        body_ = {"model": MODEL_NAME, "prompt": "after", "max_tokens": 8, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body_, timeout=60) as resp:
            assert resp.status_code == 200
            assert any(line == "data: [DONE]" for line in resp.iter_lines())
        # The worker goes: the field says so within a few beats, the status stays (requests can queue).
        stack.workers[0].stop()
        wait_for(lambda: _readyz(gateway.url)[1]["workers"] == 0, 15, interval_s=0.5, message="no worker")
        assert _readyz(gateway.url)[0] == 200
    finally:
        stack.close()
