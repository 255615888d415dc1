"""Token events to Redis: batched, ordered per request, fenced by the lease, riding out outages.

Engine outputs arrive as fast as steps run; the publisher sends whatever has accumulated in one
pipelined round trip (one PUBLISH script per request), so at low load a token goes out at once and
under load events batch up instead of queueing per token. Events of a request are numbered only
when sent, and a failed send keeps them numbered and queued, so a Redis outage delays a stream but
never reorders, renumbers or drops it (until ``redis_outage_s`` passes; then the runs are stopped and
the worker runs them again from the log once Redis takes writes). Every write carries the run's claim
(its epoch), so Redis refuses events of a run that is no longer this worker's, or already finished.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from services.common.settings import Settings
from services.common.store import REDIS_ERRORS, Store
from services.worker.run_state import Final, PendingDelta, Run, record
from services.worker.worker_telemetry import trace_publish

log = logging.getLogger(__name__)

# A request nobody reads token by token (a whole response, a job) has its token events held back for
# up to this long and sent together: an 8-token response then costs one Redis round trip and one
# gateway wake-up instead of eight. Bounded, so a long one still shows progress (the gateway's idle
# timeout) and a crash loses at most this much work (recomputed exactly on resume).
HOLD_S = 0.25


class PublishError(RuntimeError):
    """The run's events could not be delivered: another claim fenced it off, Redis failed past the
    outage budget, or the publisher itself failed."""


class Publisher:
    def __init__(self, store: Store, settings: Settings, on_fenced: Callable[[Run], None]) -> None:
        self.store = store
        self.settings = settings
        self.worker = settings.worker_id
        self._on_fenced = on_fenced
        self._dirty: dict[str, Run] = {}
        self._wake = asyncio.Event()
        self._failing_since: float | None = None
        self._held: dict[str, float] = {}  # run id -> when its oldest held-back delta was queued
        self.num_round_trips = 0

    def emit(self, run: Run, delta: PendingDelta, *, last: bool = False) -> None:
        """Queue a delta. ``last``: the request's final delta; it waits for ``finish`` so that it and the
        done event reach Redis in one round trip (the response's last hop is the slowest)."""
        record(run.output, delta)
        run.outbox.pending.append(delta)
        run.outbox.pending_bytes += delta.approx_bytes()
        self._dirty[run.id] = run
        if last:
            return
        if not run.msg.stream:
            now = time.monotonic()
            since = self._held.setdefault(run.id, now)
            if now - since < HOLD_S:
                if since == now:  # newly held: make sure a round trip comes by the time it is due
                    asyncio.get_running_loop().call_later(HOLD_S, self._wake.set)
                return  # sent with the next round trip: another run's, the finish, or the timer's
        self._wake.set()

    def finish(self, run: Run, final: Final) -> asyncio.Future[None]:
        """Queue the terminal event and record; the future resolves once Redis has them."""
        run.outbox.final = final
        sent = run.outbox.final_sent = asyncio.get_running_loop().create_future()
        self._mark(run)
        return sent

    def _mark(self, run: Run) -> None:
        self._dirty[run.id] = run
        self._wake.set()

    @property
    def healthy(self) -> bool:
        return self._failing_since is None

    async def run_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._dirty = list(self._dirty.values()), {}
            self._held.clear()  # everything dirty goes out now
            try:
                await self._send(batch)
                self._failing_since = None
            except REDIS_ERRORS as exc:
                now = time.monotonic()
                self._failing_since = self._failing_since or now
                if now - self._failing_since > self.settings.redis_outage_s:
                    down_s = now - self._failing_since
                    log.error("Redis unreachable for %.0fs, failing %d requests: %s", down_s, len(batch), exc)
                    for run in batch:
                        self._give_up(run, f"Redis unreachable: {exc!r}")
                    continue
                log.warning("Redis publish failed, retrying: %r", exc)
                for run in batch:
                    self._dirty.setdefault(run.id, run)
                await asyncio.sleep(0.2)
                self._wake.set()
            except Exception as exc:
                # Not Redis: a bug, which sending the same batch again would repeat. Its runs stop
                # (the worker runs them again from the log, worker.py) instead of waiting for ever on
                # events that cannot go out; the supervisor restarts this loop.
                for run in batch:
                    self._give_up(run, f"the publisher failed: {exc!r}")
                raise

    async def _send(self, batch: list[Run]) -> None:
        s = self.settings
        calls: list[tuple[str, Any, Any]] = []
        sent: list[tuple[Run, int, bool]] = []
        for run in batch:
            run.number_outbox(self.worker)
            box = run.outbox
            final = box.final is not None and not box.pending and box.final_sent is not None
            if final and not box.done_numbered:
                box.unsent.append(run.done_event(self.worker))
            if not box.unsent:
                continue
            ttl = s.job_ttl_s if run.msg.job else s.record_ttl_s
            fields = box.final.fields if final and box.final is not None else None
            calls.append(
                self.store.publish_call(
                    run.id,
                    self.worker,
                    s.lease_ttl_s,
                    ttl,
                    box.unsent,
                    epoch=run.epoch,
                    final=final,
                    fields=fields,
                )
            )
            sent.append((run, len(box.unsent), final))
        if not calls:
            return
        began_ns = time.time_ns()
        results = await self.store.eval_many(calls)
        ended_ns = time.time_ns()
        self.num_round_trips += 1
        for (run, count, final), ok in zip(sent, results, strict=True):
            trace_publish(
                run,
                final=final,
                num_events=count,
                num_requests=len(sent),
                ok=bool(ok),
                start_ns=began_ns,
                end_ns=ended_ns,
            )
            del run.outbox.unsent[:count]
            if not ok:
                run.outbox.pending.clear()
                self._on_fenced(run)
                self._resolve(run, PublishError(f"request {run.id} is now owned by another worker"))
            elif final:
                run.holds_lease = False
                self._resolve(run, None)

    def _give_up(self, run: Run, reason: str) -> None:
        run.outbox.pending.clear()
        run.outbox.unsent.clear()
        self._on_fenced(run)
        self._resolve(run, PublishError(reason))

    @staticmethod
    def _resolve(run: Run, error: BaseException | None) -> None:
        fut = run.outbox.final_sent
        if fut is None:
            # Not finishing yet: the failure reaches the run through on_fenced (it stops).
            return
        if not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)
