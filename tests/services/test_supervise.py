"""Supervised background tasks: restarted after a failure with a capped, growing backoff; reported while
down or freshly restarted; never restarted once cancelled or finished. Then in a worker process: its
/readyz while a task is down, and the restarted task at work.

The supervisor's clock is a manual one in the unit tests, so "stable for stable_s" is a fact of the test,
not of how fast the host runs it; the backoff sleeps are real but tiny.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from services.worker.supervise import Supervisor
from tests.services.stack import MODEL_NAME, Stack, new_stack, wait_for

if TYPE_CHECKING:
    from harness.servers import ServerProcess


_sleep = asyncio.sleep  # the real one: a test below replaces asyncio.sleep to record the backoff


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _until(predicate: object, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # type: ignore[operator]
            await _sleep(0.001)


@pytest.mark.timeout(30)
async def test_a_failing_task_is_restarted_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    sup = Supervisor(base_s=0.001, cap_s=0.004, stable_s=5.0, clock=clock)
    starts = 0
    release = asyncio.Event()

    async def flaky() -> None:
        nonlocal starts
        starts += 1
        if starts <= 4:
            raise RuntimeError(f"failure {starts}")
        await release.wait()  # the fifth start runs until told to stop
        await asyncio.Event().wait()

    caplog.set_level(logging.INFO, logger="services.worker.supervise")
    task = sup.start("publisher", flaky)
    await _until(lambda: starts == 5)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert [m.split("(")[1].split(" ")[0] for m in logged] == ["1", "2", "3", "4"]  # failures in a row
    assert all(m.startswith("background task publisher failed") for m in logged)
    # Restarted, but not yet for stable_s: still a problem, with the reason.
    (problem,) = sup.problems()
    assert problem.startswith("publisher: restarted") and "failure 4" in problem
    clock.now += 5.0
    assert sup.problems() == []
    assert not task.done()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled() and sup.problems() == [] and starts == 5


@pytest.mark.timeout(30)
async def test_backoff_doubles_up_to_the_cap_and_starts_over_after_a_stable_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    sup = Supervisor(base_s=0.2, cap_s=1.0, stable_s=5.0, clock=clock)
    slept: list[float] = []

    async def record_sleep(delay: float) -> None:
        slept.append(delay)
        await _sleep(0)

    monkeypatch.setattr("services.worker.supervise.asyncio.sleep", record_sleep)
    starts = 0
    resume = asyncio.Event()

    async def task() -> None:
        nonlocal starts
        starts += 1
        if starts == 6:  # runs a while (the clock moves past stable_s), then fails once more
            await resume.wait()
            clock.now += 6.0
        raise RuntimeError("boom")

    running = sup.start("lease_keeper", task)
    await _until(lambda: starts == 6)
    assert slept == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert sup.problems() != []
    resume.set()
    await _until(lambda: starts >= 7)
    assert slept[5] == 0.2  # a new spell: the backoff starts over
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)


@pytest.mark.timeout(30)
async def test_down_while_waiting_to_restart_and_a_finished_task_stays_finished() -> None:
    clock = Clock()
    sup = Supervisor(base_s=60.0, cap_s=60.0, stable_s=1.0, clock=clock)
    failed = asyncio.Event()

    async def fails() -> None:
        failed.set()
        raise ValueError("bad state")

    async def returns() -> None:
        return None

    finished = sup.start("engine_watch", returns)
    await finished
    down = sup.start("cancel_listener", fails)
    await failed.wait()
    await asyncio.sleep(0)
    (problem,) = sup.problems()  # the finished watcher is no problem; the failed listener is down
    assert problem.startswith("cancel_listener: down for") and "ValueError('bad state')" in problem
    down.cancel()
    await asyncio.gather(down, return_exceptions=True)
    assert sup.problems() == []


def _readyz(worker: Any) -> tuple[int, dict[str, Any]] | None:
    try:
        resp = httpx.get(f"{worker.url}/readyz", timeout=5)
    except httpx.HTTPError:
        return None  # not listening yet
    return resp.status_code, resp.json()


def _job(stack: Stack, job_id: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{stack.url}/v1/jobs/{job_id}", timeout=30).json()
    return body


@pytest.mark.timeout(240)
def test_a_worker_restarts_a_failed_task_and_is_not_ready_meanwhile(
    kafka: ServerProcess, redis_server: ServerProcess, model_path: Path, tmp_path: Path
) -> None:
    """The cancel listener fails at its first three starts: /readyz says 503 and why, then 200 once it
    has run stably, and the restarted listener does its job (a cancel reaches a running request)."""
    stack = new_stack(kafka, redis_server, model_path, tmp_path, workers=0)
    try:
        worker = stack.add_worker(
            wait=False, INFLIGHT_FAULT_TASK_FAILS="cancel_listener:3", INFLIGHT_FAULT_STEP_DELAY_S="0.05"
        )

        def listener_down() -> dict[str, Any] | None:
            got = _readyz(worker)
            problems = got[1].get("problems", []) if got else []
            return got[1] if got and any(p.startswith("cancel_listener: ") for p in problems) else None

        down = wait_for(listener_down, 180, interval_s=0.05, message="readyz to report the listener down")
        assert down["ready"] is False and "injected fault" in down["problems"][0]
        wait_for(lambda: (got := _readyz(worker)) is not None and got[0] == 200, 60, message="ready again")
        body = {"model": MODEL_NAME, "prompt": "cancel me", "max_tokens": 400, "ignore_eos": True}
        resp = httpx.post(
            f"{stack.url}/v1/jobs", json={"endpoint": "/v1/completions", "body": body}, timeout=30
        )
        job_id = resp.json()["id"]
        wait_for(lambda: _job(stack, job_id)["status"] == "in_progress", 60, message="the job to run")
        assert httpx.delete(f"{stack.url}/v1/jobs/{job_id}", timeout=30).json()["status"] == "cancelling"
        final = wait_for(
            lambda: (j := _job(stack, job_id))["status"] == "cancelled" and j, 30, message="cancelled"
        )
        assert final["usage"]["completion_tokens"] < 400  # stopped by the listener, not run to the end
    finally:
        stack.close()
