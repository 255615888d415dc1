"""Control of running requests from outside the stream: the cancel channel, leases, fencing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from redis.asyncio.client import PubSub

from engine.core.client import EngineClient
from services.common import keys
from services.common.settings import Settings
from services.common.store import REDIS_ERRORS, Store
from services.common.wire import CancelMessage, WireError
from services.worker.lifecycle import RunEvent
from services.worker.run_state import Run
from services.worker.worker_telemetry import count_cancelled

log = logging.getLogger(__name__)

_ORIGIN_GRACE_S = 3.0

Spawn = Callable[[Coroutine[Any, Any, Any]], None]  # runs a coroutine in the background


class Control:
    def __init__(
        self, settings: Settings, store: Store, engine: EngineClient, runs: dict[str, Run], spawn: Spawn
    ) -> None:
        self.settings = settings
        self.store = store
        self.engine = engine
        self.runs = runs  # the worker's: request id -> run, for requests held here
        self._spawn = spawn
        self._origins: dict[str, str] = {}  # request id -> the gateway whose client awaits it
        self._strikes: dict[str, float] = {}  # request id -> when its origin was first seen gone

    async def cancel_listener(self) -> None:
        async with self.store.client.pubsub() as pubsub:  # closed when a failure ends this run of it
            await pubsub.subscribe(keys.CANCEL_CHANNEL)
            await self._listen(pubsub)

    async def _listen(self, pubsub: PubSub) -> None:
        while True:
            try:
                message = await pubsub.get_message(ignore_subscribe_messages=False, timeout=1.0)
            except REDIS_ERRORS as exc:
                log.warning("cancel channel: %s; reconnecting", exc)
                await asyncio.sleep(0.5)
                continue  # redis-py reconnects and resubscribes on the next read
            if message is None:
                continue
            if message["type"] == "subscribe":
                # (Re)subscribed: a cancel published while the connection was down never reached this
                # worker, but its key is in Redis. Check every request held here once more.
                await self._recheck_cancels()
                continue
            if message["type"] != "message":
                continue
            try:
                request_id = CancelMessage.decode(message["data"]).id
            except WireError as exc:
                log.error("ignoring cancel message: %s", exc)
                continue
            run = self.runs.get(request_id)
            if run is not None:
                await self._cancel(run)

    async def _cancel(self, run: Run) -> None:
        in_engine = bool(run.engine_ids)
        if not run.state.send(RunEvent.CANCEL):
            return  # cancelled already, or on its way out: its next claim reads the cancel key
        log.info("cancelling %s", run.id)
        count_cancelled("engine" if in_engine else "intake")
        run.span.add_event("cancel requested")
        await self.abort(run)

    async def _recheck_cancels(self) -> None:
        for run in list(self.runs.values()):
            if run.cancelled:
                continue
            try:
                cancelled = await self.store.is_cancelled(run.id)
            except REDIS_ERRORS as exc:
                log.warning("cancel re-check failed: %s", exc)
                return
            if cancelled:
                await self._cancel(run)

    async def lease_keeper(self) -> None:
        interval = self.settings.lease_ttl_s / 3
        while True:
            await asyncio.sleep(interval)
            held = [(r.id, r.epoch) for r in self.runs.values() if r.holds_lease]
            try:
                lost = await self.store.refresh_leases(
                    held, self.settings.worker_id, self.settings.lease_ttl_s
                )
            except REDIS_ERRORS as exc:
                log.warning("lease refresh failed: %s", exc)
                continue
            for request_id in lost:
                run = self.runs.get(request_id)
                if run is not None:
                    log.warning("%s is another worker's or finished now; stopping it here", request_id)
                    self.fence(run)
            try:
                await self._cancel_orphans()
            except REDIS_ERRORS as exc:
                log.warning("origin check failed: %s", exc)

    async def _cancel_orphans(self) -> None:
        """Cancel synchronous requests whose origin gateway died: nobody reads their tokens any more.

        A gateway renews its liveness key every second; a key missing for ``_ORIGIN_GRACE_S`` on end
        (never just the moment of a Redis restart, which loses every key) means that gateway is gone.
        """
        held = [r for r in self.runs.values() if not r.msg.job and not r.cancelled and r.holds_lease]
        for gone in set(self._origins) - {r.id for r in held}:
            self._origins.pop(gone, None)
            self._strikes.pop(gone, None)
        unknown = [r.id for r in held if r.id not in self._origins]
        if unknown:
            async with self.store.client.pipeline(transaction=False) as pipe:
                for request_id in unknown:
                    pipe.hget(keys.record(request_id), "origin")
                for request_id, origin in zip(unknown, await pipe.execute(), strict=True):
                    if origin:
                        self._origins[request_id] = str(origin)
        origins = sorted({self._origins[r.id] for r in held if r.id in self._origins})
        if not origins:
            return
        async with self.store.client.pipeline(transaction=False) as pipe:
            for origin in origins:
                pipe.exists(keys.gateway_alive(origin))
            alive = {o for o, n in zip(origins, await pipe.execute(), strict=True) if n}
        for run in held:
            origin = self._origins.get(run.id)
            if origin is None or origin in alive:
                self._strikes.pop(run.id, None)
                continue
            first_miss = self._strikes.setdefault(run.id, time.monotonic())
            if time.monotonic() - first_miss >= _ORIGIN_GRACE_S:
                log.warning("cancelling %s: its gateway %s is gone", run.id, origin)
                await self._cancel(run)

    def fence(self, run: Run) -> None:
        """Another worker owns ``run`` now (or its events cannot be delivered): stop it here, silently."""
        run.state.send(RunEvent.FENCE)
        run.holds_lease = False
        self._spawn(self.abort(run))

    async def abort(self, run: Run) -> None:
        """Abort every completion of ``run`` that is in the engine; each stream ends with "abort"."""
        for engine_id in list(run.engine_ids):
            await self.engine.abort(engine_id)
