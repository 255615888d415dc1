"""The quarantine gate on its own: who may be in the engine beside whom (services/worker/quarantine.py).

Pure asyncio, no servers: the stack test (test_worker_quarantine.py) shows what it is for.
"""

from __future__ import annotations

import asyncio

import pytest

from services.worker.quarantine import Quarantine


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_shared_runs_enter_together() -> None:
    gate = Quarantine()
    async with gate.enter(False), gate.enter(False):
        assert gate.num_shared == 2 and not gate.active
    assert gate.num_shared == 0


async def test_a_suspect_waits_for_the_engine_to_empty_and_holds_back_new_runs() -> None:
    gate = Quarantine()
    order: list[str] = []
    release_first = asyncio.Event()

    async def shared(name: str, until: asyncio.Event | None = None) -> None:
        async with gate.enter(False):
            order.append(f"{name} in")
            if until is not None:
                await until.wait()
            order.append(f"{name} out")

    async def suspect() -> None:
        async with gate.enter(True):
            order.append("suspect in")
            assert gate.num_shared == 0  # alone
            await asyncio.sleep(0)
            order.append("suspect out")

    first = asyncio.create_task(shared("first", release_first))
    await _settle()
    waiting = asyncio.create_task(suspect())
    await _settle()
    assert gate.active and order == ["first in"]  # the suspect waits for the run in the engine
    late = asyncio.create_task(shared("late"))  # arrives while the suspect waits: goes after it
    await _settle()
    assert order == ["first in"]
    release_first.set()
    await asyncio.gather(first, waiting, late)
    assert order == ["first in", "first out", "suspect in", "suspect out", "late in", "late out"]
    assert not gate.active and gate.num_shared == 0


async def test_suspects_take_the_engine_one_at_a_time() -> None:
    gate = Quarantine()
    inside: list[int] = []
    most = 0

    async def suspect() -> None:
        nonlocal most
        async with gate.enter(True):
            inside.append(1)
            most = max(most, len(inside))
            await asyncio.sleep(0.01)
            inside.pop()

    await asyncio.gather(*(suspect() for _ in range(4)))
    assert most == 1


async def test_a_suspect_cancelled_while_waiting_lets_the_others_in() -> None:
    gate = Quarantine()
    release = asyncio.Event()

    async def hold() -> None:
        async with gate.enter(False):
            await release.wait()

    holder = asyncio.create_task(hold())
    await _settle()

    async def suspect() -> None:
        async with gate.enter(True):
            pytest.fail("a cancelled suspect must never enter")

    waiting = asyncio.create_task(suspect())
    await _settle()
    late_entered = asyncio.Event()

    async def late() -> None:
        async with gate.enter(False):
            late_entered.set()

    latecomer = asyncio.create_task(late())
    await _settle()
    assert not late_entered.is_set()  # held back behind the waiting suspect
    waiting.cancel()
    await asyncio.wait_for(latecomer, 5)  # the suspect gave up: the shared run goes in at once
    assert late_entered.is_set() and not gate.active
    with pytest.raises(asyncio.CancelledError):
        await waiting
    release.set()
    await holder
    assert gate.num_shared == 0


async def test_past_its_bound_a_suspect_runs_beside_a_long_run_and_the_worker_fetches_again() -> None:
    gate = Quarantine(max_wait_s=0.2)
    release = asyncio.Event()

    async def long_run() -> None:
        async with gate.enter(False):
            await release.wait()

    holder = asyncio.create_task(long_run())
    await _settle()
    entered = asyncio.Event()

    async def suspect() -> None:
        async with gate.enter(True):
            entered.set()
            assert gate.num_shared == 2  # beside the long run, counted as shared
            await release.wait()

    waiting = asyncio.create_task(suspect())
    await _settle()
    assert gate.active and not entered.is_set()  # within the bound: held back, nothing fetched
    await asyncio.wait_for(entered.wait(), 5)
    assert not gate.active  # past it: the worker takes work again
    release.set()
    await asyncio.gather(holder, waiting)
    assert gate.num_shared == 0 and not gate.active


async def test_past_its_bound_a_suspect_still_waits_for_another_suspect_alone() -> None:
    gate = Quarantine(max_wait_s=0.1)
    release = asyncio.Event()
    together: list[int] = []

    async def suspect(hold: bool) -> None:
        async with gate.enter(True):
            together.append(1)
            assert len(together) == 1  # never two suspects in the engine at once
            if hold:
                await release.wait()
            together.pop()

    first = asyncio.create_task(suspect(True))
    await _settle()
    second = asyncio.create_task(suspect(False))
    await asyncio.sleep(0.3)  # past the second's bound: it still waits
    assert not second.done()
    release.set()
    await asyncio.gather(first, second)
