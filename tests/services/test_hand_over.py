"""A worker whose engine died leaves the consumer group within a bound, or exits.

aiokafka's ``consumer.stop()`` waits for its coordination task, and a rebalance the broker never
completes holds that task for good: a CI run saw a dead engine's worker keep its partitions for
minutes. Making a real consumer hang on demand is not possible here, so the consumer is a stand-in
whose ``stop()`` hangs (or returns); the worker, its hand-over and main's exit path are the real ones.
No Redis or Kafka is reached: nothing is held, and nothing is to commit.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from services.common.settings import Settings
from services.worker import main as worker_main
from services.worker import worker as worker_module
from services.worker.worker import Worker

pytestmark = pytest.mark.timeout(60)


class _Consumer:
    """What the hand-over calls on an aiokafka consumer; ``_coordinator`` None: no generation-0 leave."""

    _coordinator = None

    def __init__(self, hangs: bool) -> None:
        self.hangs = hangs
        self.stopped = False

    async def stop(self) -> None:
        if self.hangs:
            await asyncio.Event().wait()  # a coordination task that never finishes
        self.stopped = True


def _worker(consumer: _Consumer) -> Worker:
    engine: Any = SimpleNamespace(dead_error=RuntimeError("the engine core died"))
    worker = Worker(Settings(redis_url="redis://127.0.0.1:1/0"), engine)
    worker.consumer = consumer  # type: ignore[assignment]
    return worker


async def test_a_clean_leave_hands_over_at_once() -> None:
    consumer = _Consumer(hangs=False)
    worker = _worker(consumer)
    await asyncio.wait_for(worker._watch_engine(), 10)
    assert consumer.stopped and worker.handed_over.is_set() and not worker.hand_over_failed


async def test_a_stop_that_hangs_is_given_up_and_the_process_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_module, "_HAND_OVER_TIMEOUT_S", 0.5)
    worker = _worker(_Consumer(hangs=True))
    began = time.monotonic()
    await asyncio.wait_for(worker._watch_engine(), 10)
    assert 0.5 <= time.monotonic() - began < 5
    assert worker.handed_over.is_set() and worker.hand_over_failed

    exits: list[int] = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(worker_main.os, "_exit", fake_exit)
    with pytest.raises(SystemExit):
        await worker_main._exit_after_stall(worker, SimpleNamespace())  # type: ignore[arg-type]
    assert exits == [worker_main.EXIT_HAND_OVER]
