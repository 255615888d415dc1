"""Supervised background tasks: restarted after a failure with a capped, growing backoff; reported while
down or freshly restarted; never restarted once cancelled or finished.

The supervisor's clock is a manual one here, so "stable for stable_s" is a fact of the test, not of how
fast the host runs it; the backoff sleeps are real but tiny.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.worker.supervise import Supervisor

pytestmark = pytest.mark.timeout(30)

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
