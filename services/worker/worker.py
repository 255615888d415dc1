"""The worker: Kafka consumer group -> engine -> Redis, with cancellation, leases and drain.

Concurrency (all on one event loop; the engine steps in its own process, so nothing here waits on a
model step). Each job has one module:

    fetch loop      intake.py     getmany() only while the engine's waiting queue has room
    request tasks   request_runner.py  one per request: claim, resume, generate, finish
    publisher       publisher.py  token events to Redis, batched
    commit loop     commits.py    commits offsets past terminal requests (offsets.py does the arithmetic)
    cancel listener control.py    the cancel channel -> engine.abort
    lease keeper    control.py    extends this worker's leases; a lost lease stops that request here
    load reporting  load.py       requests held (Prometheus), pod-deletion-cost
The loops run supervised (supervise.py): one that raises is restarted, and /readyz reports it meanwhile.
A request's state as the worker holds it is a ``Run`` (run_state.py), whose status changes only in
lifecycle.py (the other modules send it events). This module owns the set of runs and the worker's own
lifecycle: start, drain (SIGTERM), stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Coroutine
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from engine.core.client import EngineClient
from services.common import consumers
from services.common.engine_spans import EngineSpanExporter
from services.common.kafka import broker_session_timeout_ms, ensure_topic, make_consumer, make_probe
from services.common.settings import Settings
from services.common.store import REDIS_ERRORS, Store, connect_redis
from services.common.wire import TERMINAL
from services.worker import faults, poison, worker_telemetry
from services.worker.commits import Committer, RebalanceListener
from services.worker.control import Control
from services.worker.intake import OUTCOMES, Intake
from services.worker.kafka_compat import leave_first_generation
from services.worker.lifecycle import RunEvent
from services.worker.load import LoadReporter
from services.worker.offsets import OffsetTracker
from services.worker.publisher import Publisher
from services.worker.quarantine import Quarantine
from services.worker.request_runner import Runner
from services.worker.run_state import Outcome, Run
from services.worker.supervise import Supervisor, TaskFactory

log = logging.getLogger(__name__)

_MAX_ATTEMPTS = 3  # a request the worker fails this often (not Redis) is failed for good
_HAND_OVER_TIMEOUT_S = 20.0  # a dead engine's worker leaving the group: normally well under a second
# Each step of a stopping worker's clean-up, at most: the process ends after them, and its end releases
# whatever a step still held (a producer flushing to a broker that restarted, a core being reaped), where
# a step without a bound kept a worker whose engine had stalled from exiting for its restart.
_CLOSE_STEP_TIMEOUT_S = 10.0


class Worker:
    def __init__(
        self, settings: Settings, engine: EngineClient, spans: EngineSpanExporter | None = None
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.store = Store(connect_redis(settings))
        self.runs: dict[str, Run] = {}
        self.control = Control(settings, self.store, engine, self.runs, self._spawn)
        self.publisher = Publisher(self.store, settings, on_fenced=self.control.fence)
        self.quarantine = Quarantine()
        self.runner = Runner(engine, self.store, self.publisher, settings, spans, self.quarantine)
        self.tracker = OffsetTracker()
        self.committer = Committer(self.tracker, lambda: make_probe(settings))
        self.intake = Intake(
            settings,
            self.store,
            engine,
            self.tracker,
            self.runs,
            self._start_run,
            self._spawn,
            self.quarantine,
        )
        self.load = LoadReporter(self._spawn)
        poison.engine_failures()  # its series scrape from the start, at 0
        self.consumer: AIOKafkaConsumer | None = None
        self.supervisor = Supervisor()
        self.started = False
        # Set once a dead engine's requests are handed back and the group left (main.py may then exit).
        self.handed_over = asyncio.Event()
        self.hand_over_failed = False  # a dead engine's worker could not leave the group (main exits)
        self._leave_step = ""  # which step of leaving the group is under way (named if it hangs)
        self._tasks: list[asyncio.Task[Any]] = []
        self._consumer_tasks: list[asyncio.Task[Any]] = []
        self._background: set[asyncio.Task[Any]] = set()  # fire-and-forget, referenced until done
        self._stopped = asyncio.Event()
        self._drain_started = False

    @property
    def draining(self) -> bool:
        return self.intake.stopped

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.engine.start()
        await ensure_topic(self.settings)
        session_ms = await broker_session_timeout_ms(self.settings)
        consumer = self.consumer = self.committer.consumer = make_consumer(self.settings, session_ms)
        consumer.subscribe([self.settings.kafka_topic], listener=RebalanceListener(self.committer))
        await consumer.start()
        # The tasks that use the consumer stop with it when the engine dies.
        self._consumer_tasks = [
            self._supervise("fetch", lambda: self.intake.fetch_forever(consumer)),
            self._supervise("commit_loop", self.committer.run_forever),
            self._supervise("consumer_lag", lambda: worker_telemetry.report_lag_forever(consumer)),
            # What the gateways' /readyz counts as a worker consuming the topic (consumers.py).
            self._supervise("consumer_beat", self._beat),
        ]
        self._tasks.extend(self._consumer_tasks)
        self._tasks.append(self._supervise("publisher", self.publisher.run_forever))
        self._tasks.append(self._supervise("cancel_listener", self.control.cancel_listener))
        self._tasks.append(self._supervise("lease_keeper", self.control.lease_keeper))
        self._tasks.append(self._supervise("engine_watch", self._watch_engine))
        self.started = True
        log.info("worker %s consuming %s", self.settings.worker_id, self.settings.kafka_topic)

    async def _beat(self) -> None:
        s = self.settings
        consumer = self.consumer
        await consumers.beat_forever(
            self.store.client,
            s.kafka_topic,
            s.worker_id,
            lambda: consumer is not None and bool(consumer.assignment()) and not self.draining,
        )

    def _supervise(self, name: str, factory: TaskFactory) -> asyncio.Task[None]:
        return self.supervisor.start(name, faults.failing_task(name, factory))

    def problems(self) -> list[str]:
        """Why this worker is not fully working, one line each (/readyz answers 503 while any)."""
        return self.supervisor.problems()

    async def drain(self) -> None:
        """SIGTERM: stop fetching, let in-flight requests finish within the grace period, hand the rest
        back (their leases released, offsets uncommitted: another worker resumes them from the log)."""
        # Its own flag, not ``draining``: a dead engine also stops the intake, and that worker must
        # still exit on SIGTERM (it waited for the kill at the end of the grace period).
        if self._drain_started:
            return
        self._drain_started = True
        self.intake.stopped = True
        deadline = time.monotonic() + self.settings.drain_timeout_s
        log.info("draining %d requests (up to %.0fs)", len(self.runs), self.settings.drain_timeout_s)
        while self.runs and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for run in list(self.runs.values()):
            run.state.send(RunEvent.HAND_BACK)
            await self.control.abort(run)
        pending = [r.task for r in self.runs.values() if r.task is not None]
        if pending:
            await asyncio.wait(pending, timeout=10)
        await self.stop()

    async def stop(self) -> None:
        await _bounded("committing offsets", self.committer.commit_now())
        if self.consumer is not None:
            began = time.monotonic()
            try:
                await leave_first_generation(self.consumer)
                await self.consumer.stop()  # leaves the group: the partitions move on at once
                log.info("left the consumer group in %.1fs", time.monotonic() - began)
            except (KafkaError, OSError) as exc:
                log.warning("leaving the consumer group failed: %r", exc)
        for task in self._tasks:
            task.cancel()
        for run in self.runs.values():
            if run.task is not None:
                run.task.cancel()
        await _bounded(
            "ending its tasks",
            asyncio.gather(
                *self._tasks, *(r.task for r in self.runs.values() if r.task), return_exceptions=True
            ),
        )
        await _bounded("closing the commit probe", self.committer.close())
        await _bounded("closing the requeue producer", self.runner.requeue.close())
        await _bounded("stopping the engine", self.engine.shutdown())
        await _bounded("closing Redis", self.store.client.aclose())
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # ---- runs ------------------------------------------------------------------------------
    def _start_run(self, run: Run) -> None:
        self.runs[run.id] = run
        run.task = asyncio.create_task(self._execute(run))
        self.load.requests_changed(len(self.runs))

    async def _execute(self, run: Run) -> Outcome:
        outcome = Outcome.ERROR
        # The consume span is current for the whole request: the engine span, publish spans and log
        # lines (trace=...) of this task belong to it.
        with trace.use_span(
            run.span, end_on_exit=True, record_exception=False, set_status_on_exception=False
        ):
            try:
                outcome = await self._until_settled(run)
            except asyncio.CancelledError:
                outcome = Outcome.HANDED_BACK
                raise
            except Exception as exc:
                # Only the retry loop itself can get here. ERROR keeps the offset uncommitted: the
                # request is read again after the next rebalance or restart, never dropped.
                log.exception("request %s failed in the worker", run.id)
                run.span.record_exception(exc)
            finally:
                self.runs.pop(run.id, None)
                if outcome.releases_offset:
                    for tp, offset, generation in run.deliveries:
                        self.tracker.done(tp, offset, generation)
                    self.committer.wake()
                OUTCOMES.labels(outcome).inc()
                self.load.requests_changed(len(self.runs))
                run.span.set_attribute("inflight.outcome", str(outcome))
                if outcome is Outcome.ERROR or run.errors:
                    run.span.set_status(Status(StatusCode.ERROR))
        return outcome

    async def _until_settled(self, run: Run) -> Outcome:
        """Run the request until Redis shows it terminal (or another worker holds it): only then may its
        offset be committed. An attempt that failed, whatever the error, or was fenced (Redis refused or
        did not answer past ``redis_outage_s``) left the record "queued" or "in_progress": it runs again
        from the log, after a backoff, until Redis takes its writes. On drain or engine death it is
        handed back instead (offset uncommitted: another worker resumes it)."""
        delay_s = 0.2
        worker_failures = 0  # failures that were not Redis's
        while True:
            try:
                outcome = await self.runner.execute(run)
            except REDIS_ERRORS as exc:
                # Unreachable, or refusing writes (OOM under maxmemory, READONLY after a failover).
                log.warning("request %s: Redis failed (%r); retrying", run.id, exc)
                outcome = Outcome.ERROR
            except Exception as exc:
                log.exception("request %s failed in the worker; retrying", run.id)
                run.span.record_exception(exc)
                outcome = Outcome.ERROR
                worker_failures += 1
                with contextlib.suppress(Exception):  # whatever of it may still be in the engine
                    await self.engine.abort(run.id)
            if outcome not in (Outcome.ERROR, Outcome.FENCED):
                return outcome
            settled = await self._settled(run.id)
            if settled is not None:
                return settled  # terminal in Redis, or another worker's: the offset may move on
            if self.draining or self.engine.dead_error is not None:
                return Outcome.HANDED_BACK
            if worker_failures >= _MAX_ATTEMPTS and not run.errors:
                # The worker keeps failing this one request: not Redis's fault. Failing it is terminal
                # (offset committed once Redis has it) rather than a partition stuck on it.
                run.state.fail(0, "the worker failed this request repeatedly", "worker_error")
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 2.0)
            run = self._retry(run)

    def _retry(self, old: Run) -> Run:
        """A fresh run of the same delivery: it claims the request again and resumes from the log."""
        run = Run(
            old.msg,
            deliveries=old.deliveries,
            prompt_token_ids=list(old.msg.prompt_token_ids),
            key=old.key,
            retry_of=old.state,
        )
        run.tracing.span = old.tracing.span
        run.task = old.task
        self.runs[run.id] = run
        return run

    async def _settled(self, request_id: str) -> Outcome | None:
        """SKIPPED when terminal in Redis, FENCED when held by another live worker (whose own delivery
        will settle it), None while neither is known (Redis failing counts as not known)."""
        try:
            record = await self.store.get_record(request_id)
            if record is not None and record.get("status") in TERMINAL:
                return Outcome.SKIPPED
            owner = await self.store.owner(request_id)
        except REDIS_ERRORS:
            return None
        return Outcome.FENCED if owner is not None and owner != self.settings.worker_id else None

    async def _watch_engine(self) -> None:
        """A dead engine fails every request it is given: stop taking any. Stop fetching, hand back what
        is held (offsets uncommitted, leases released) and leave the group, so the partitions move to
        live workers at once; /readyz says not ready, /healthz 500 gets the pod restarted."""
        while self.engine.dead_error is None:
            await asyncio.sleep(0.2)
        log.error("the engine died (%r): handing back %d requests", self.engine.dead_error, len(self.runs))
        self.intake.stopped = True
        for run in list(self.runs.values()):
            run.state.send(RunEvent.ENGINE_DIED)
            with contextlib.suppress(Exception):
                await self.control.abort(run)
        pending = [r.task for r in self.runs.values() if r.task is not None]
        if pending:
            await asyncio.wait(pending, timeout=10)
        try:
            await asyncio.wait_for(self._leave_group(), _HAND_OVER_TIMEOUT_S)
        except TimeoutError:
            # aiokafka's stop() first waits for its coordination task, which a rebalance the broker
            # never completes holds for good: the member would keep this worker's partitions, and
            # their requests would wait, for as long as the process lives.
            log.error(
                "leaving the consumer group took over %.0fs (stuck %s): giving up on it",
                _HAND_OVER_TIMEOUT_S,
                self._leave_step,
            )
            self.hand_over_failed = True
        self.handed_over.set()

    async def _leave_group(self) -> None:
        for task in self._consumer_tasks:
            task.cancel()
        self._leave_step = "ending the fetch tasks"
        await asyncio.gather(*self._consumer_tasks, return_exceptions=True)
        self._leave_step = "committing"
        await self.committer.commit_now()
        if self.consumer is not None:
            consumer, self.consumer = self.consumer, None  # stop() must not leave the group twice
            try:
                self._leave_step = "leaving a first generation"
                await leave_first_generation(consumer)
                self._leave_step = "stopping the consumer"
                await consumer.stop()
                log.info("left the consumer group: the engine is dead")
            except (KafkaError, OSError) as exc:
                log.warning("leaving the consumer group failed: %r", exc)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background work failed", exc_info=exc)  # one-off work: nothing to restart

    def stats(self) -> dict[str, Any]:
        return {
            "worker": self.settings.worker_id,
            "draining": self.draining,
            "requests": sorted(self.runs),
            "suspects": sorted(r.id for r in self.runs.values() if r.suspect),  # each runs alone
            "num_waiting": self.engine.load.num_waiting,
            "num_running": self.engine.load.num_running,
            "kv": self.engine.load.kv_stats(),
            "engine_pid": self.engine.pid,
            "fetch_wait_ms": self.intake.fetch_wait_ms,  # long while idle (fetch_wait.py)
            "partitions": sorted(tp.partition for tp in self.consumer.assignment()) if self.consumer else [],
            "publisher_healthy": self.publisher.healthy,
            "problems": self.problems(),
        }


async def _bounded(step: str, awaitable: Awaitable[Any]) -> None:
    """One step of ``Worker.stop``'s clean-up, within ``_CLOSE_STEP_TIMEOUT_S``; a failure or an overrun is
    logged and the next step runs."""
    try:
        await asyncio.wait_for(awaitable, _CLOSE_STEP_TIMEOUT_S)
    except TimeoutError:
        log.warning("stopping: %s took over %.0fs; going on without it", step, _CLOSE_STEP_TIMEOUT_S)
    except Exception as exc:
        log.warning("stopping: %s failed: %r", step, exc)
