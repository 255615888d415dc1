"""The worker's liveness probe waits for a dead engine's hand-back before it asks for a restart.

A restart before the hand-back would lose the engine failure counted against each request it held
(services/worker/poison.py): the request that killed the engine would resume elsewhere as if nothing had
happened. The worker here is a stand-in with only what the probe reads (the real one needs an engine
core and a broker; tests/services/test_crash.py covers a whole worker whose engine is killed).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import httpx

from services.worker.http import create_app


async def test_healthz_fails_only_once_the_dead_engine_is_handed_back() -> None:
    engine = SimpleNamespace(dead_error=None)
    worker = SimpleNamespace(engine=engine, handed_over=asyncio.Event())
    transport = httpx.ASGITransport(app=create_app(cast(Any, worker)))
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as http:
        assert (await http.get("/healthz")).status_code == 200
        engine.dead_error = RuntimeError("the engine core process exited (exit code -9)")
        handing_back = await http.get("/healthz")
        assert handing_back.status_code == 200 and "handing back" in handing_back.json()["status"]
        worker.handed_over.set()
        dead = await http.get("/healthz")
        assert dead.status_code == 500 and "exit code -9" in dead.json()["error"]
