"""Intake's room: a request counts against the worker's fetch bound from its fetch until it leaves the
engine's waiting queue, including while the engine core has not acknowledged it yet; and none is fetched
while a quarantined request waits for the engine or holds it."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from engine.core.client import EngineCoreClient
from engine.inputs import EngineRequest
from engine.sampling_params import SamplingParams
from services.common.settings import Settings
from services.common.store import Store, connect_redis
from services.worker.intake import Intake
from services.worker.offsets import OffsetTracker
from services.worker.quarantine import Quarantine
from services.worker.run_state import Run


def _no_run(_: Run) -> None:
    raise AssertionError("nothing is fetched here")


def _no_spawn(coro: Coroutine[Any, Any, Any]) -> None:
    coro.close()


async def test_room_counts_a_request_the_core_has_not_acknowledged(model_path: Path) -> None:
    settings = Settings(fetch_max_waiting=4)
    client = EngineCoreClient(str(model_path), {"block_size": 8, "max_model_len": 256}, torch_threads=1)
    await client.start()
    store = Store(connect_redis(settings))  # never reached: room() reads the engine and the runs
    quarantine = Quarantine()
    intake = Intake(settings, store, client, OffsetTracker(), {}, _no_run, _no_spawn, quarantine)
    assert client.pid is not None
    try:
        assert intake.room() == 4
        # SIGSTOP holds the core: the request is with the client, unacknowledged, whatever the host's speed.
        os.kill(client.pid, signal.SIGSTOP)
        try:
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            stream = client.generate(EngineRequest("held", [1, 2, 3], params))
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.2)
            assert not first.done() and client.load.num_waiting == 0
            assert intake.room() == 3  # not in the core's load yet, and still counted
        finally:
            os.kill(client.pid, signal.SIGCONT)
        await first
        async for _ in stream:
            pass
        assert intake.room() == 4  # finished: it counts no more
        # A request an engine died under runs alone (quarantine.py): nothing is fetched meanwhile.
        async with quarantine.enter(True):
            assert intake.room() == 0
        assert intake.room() == 4
    finally:
        await client.shutdown()
        await store.client.aclose()
