"""The worker: Kafka consumer group -> engine -> Redis, with cancellation, leases and drain.

Concurrency (all on one event loop; the engine steps on its own thread, so nothing here waits on a
model step):

    fetch loop      getmany() only while the engine's waiting queue has room; pause/resume partitions
    request tasks   one per request (services.worker.runner)
    publisher       token events to Redis, batched (services.worker.publisher)
    commit loop     commits offsets past terminal requests (services.worker.offsets)
    cancel listener the cancel channel -> engine.abort
    lease keeper    extends this worker's leases; a lost lease stops that request here
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from aiokafka.protocol.group import LeaveGroupRequest
from aiokafka.structs import ConsumerRecord, TopicPartition
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from prometheus_client import Counter, Gauge

from services.common import keys
from services.common.engine_spans import EngineSpanExporter
from services.common.kafka import ensure_topic, make_consumer
from services.common.settings import Settings
from services.common.store import REDIS_ERRORS, Store, connect_redis
from services.common.wire import CancelMessage, RequestMessage, WireError
from services.worker import telemetry
from services.worker.offsets import OffsetTracker
from services.worker.publisher import Publisher
from services.worker.run import Run
from services.worker.runner import HANDED_BACK, Runner

log = logging.getLogger(__name__)

INFLIGHT = Gauge("inflight_worker_requests", "Requests this worker holds (in the engine or about to be)")
OUTCOMES = Counter(
    "inflight_worker_outcomes_total", "Requests this worker let go of, by outcome", ["outcome"]
)
KV_USAGE = Gauge("inflight_worker_kv_usage", "Fraction of KV cache blocks in use")
WAITING = Gauge("inflight_worker_engine_waiting", "Requests in the engine's waiting queue")
RUNNING = Gauge("inflight_worker_engine_running", "Requests in the engine's running batch")


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.worker.commit_now()  # last chance to commit these partitions' finished prefix
        self.worker.tracker.forget(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        # Eager rebalancing revokes everything first, and the consumer re-reads every assigned partition
        # from its committed offset: requests still running here are redelivered and reattach.
        self.worker.tracker.reset(assigned)
        log.info("assigned partitions %s", sorted(tp.partition for tp in assigned))


class Worker:
    def __init__(self, settings: Settings, engine: Any, spans: EngineSpanExporter | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.store = Store(connect_redis(settings))
        self.publisher = Publisher(self.store, settings, on_fenced=self._fence)
        self.runner = Runner(engine, self.store, self.publisher, settings, spans)
        self.tracker = OffsetTracker()
        self.consumer: AIOKafkaConsumer | None = None
        self.runs: dict[str, Run] = {}
        self.draining = False
        self.started = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._background: set[asyncio.Task[Any]] = set()  # fire-and-forget, referenced until done
        self._commit_wake = asyncio.Event()
        self._stopped = asyncio.Event()
        self._deletion_cost = _deletion_cost()

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.engine.start()
        await ensure_topic(self.settings)
        self.consumer = make_consumer(self.settings)
        self.consumer.subscribe([self.settings.kafka_topic], listener=_Rebalance(self))
        await self.consumer.start()
        for coro in (self.publisher.run_forever(), self._fetch_loop(), self._commit_loop(),
                     self._cancel_listener(), self._lease_keeper(), self._gauges(),
                     telemetry.report_lag_forever(self.consumer)):  # fmt: skip
            self._tasks.append(asyncio.create_task(coro))
        self.started = True
        log.info("worker %s consuming %s", self.settings.worker_id, self.settings.kafka_topic)

    async def drain(self) -> None:
        """SIGTERM: stop fetching, let in-flight requests finish within the grace period, hand the rest
        back (their leases released, offsets uncommitted: another worker resumes them from the log)."""
        if self.draining:
            return
        self.draining = True
        deadline = time.monotonic() + self.settings.drain_timeout_s
        log.info("draining %d requests (up to %.0fs)", len(self.runs), self.settings.drain_timeout_s)
        while self.runs and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for run in list(self.runs.values()):
            run.handed_back = True
            for engine_id in list(run.engine_ids):
                await self.engine.abort(engine_id)
        pending = [r.task for r in self.runs.values() if r.task is not None]
        if pending:
            await asyncio.wait(pending, timeout=10)
        await self.stop()

    async def stop(self) -> None:
        await self.commit_now()
        if self.consumer is not None:
            began = time.monotonic()
            try:
                await _leave_first_generation(self.consumer)
                await self.consumer.stop()  # leaves the group: the partitions move on at once
                log.info("left the consumer group in %.1fs", time.monotonic() - began)
            except (KafkaError, OSError) as exc:
                log.warning("leaving the consumer group failed: %r", exc)
        for task in self._tasks:
            task.cancel()
        for run in self.runs.values():
            if run.task is not None:
                run.task.cancel()
        await asyncio.gather(
            *self._tasks, *(r.task for r in self.runs.values() if r.task), return_exceptions=True
        )
        with contextlib.suppress(Exception):
            await self.engine.shutdown()
        with contextlib.suppress(Exception):
            await self.store.client.aclose()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # ---- intake ----------------------------------------------------------------------------
    def _room(self) -> int:
        # Requests consumed but not yet in the engine count as waiting: the bound holds at all times.
        intake = sum(1 for r in self.runs.values() if not r.engine_ids)
        return self.settings.max_waiting - self.engine.num_waiting - intake

    async def _fetch_loop(self) -> None:
        assert self.consumer is not None
        consumer = self.consumer
        while True:
            room = 0 if self.draining else self._room()
            assigned = consumer.assignment()
            if room <= 0:
                consumer.pause(*assigned)
            elif consumer.paused():
                consumer.resume(*consumer.paused())
            try:
                # Paused partitions return nothing; the call still keeps the consumer polling.
                batch = await consumer.getmany(timeout_ms=50 if room <= 0 else 100, max_records=max(room, 1))
            except KafkaError as exc:
                log.warning("fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for tp, records in batch.items():
                for record in records:
                    self._on_record(tp, record)

    def _on_record(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes]) -> None:
        generation = self.tracker.add(tp, record.offset)
        try:
            msg = RequestMessage.decode(record.value or b"")
        except WireError as exc:
            log.error("rejecting message at %s:%d offset %d: %s", tp.topic, tp.partition, record.offset, exc)
            OUTCOMES.labels("rejected").inc()
            self.tracker.done(tp, record.offset, generation)
            self._spawn(self._fail_unreadable(record.value, exc))
            return
        run = self.runs.get(msg.id)
        if run is not None:
            run.deliveries.append((tp, record.offset, generation))  # a redelivery of one running here
            run.span.add_event("redelivered", {"partition": tp.partition, "offset": record.offset})
            return
        run = Run(
            msg,
            deliveries=[(tp, record.offset, generation)],
            prompt_token_ids=list(msg.prompt_token_ids),
            span=telemetry.consume_span(record, msg.id),
        )
        self.runs[msg.id] = run
        run.task = asyncio.create_task(self._execute(run))
        self._load_changed()

    async def _execute(self, run: Run) -> str:
        outcome = "error"
        # The consume span is current for the whole request: the engine span, publish spans and log
        # lines (trace=...) of this task belong to it.
        with trace.use_span(
            run.span, end_on_exit=True, record_exception=False, set_status_on_exception=False
        ):
            try:
                outcome = await self.runner.execute(run)
            except asyncio.CancelledError:
                outcome = HANDED_BACK
                raise
            except Exception as exc:
                log.exception("request %s failed in the worker", run.id)
                run.span.record_exception(exc)
            finally:
                self.runs.pop(run.id, None)
                if outcome != HANDED_BACK:
                    for tp, offset, generation in run.deliveries:
                        self.tracker.done(tp, offset, generation)
                    self._commit_wake.set()
                OUTCOMES.labels(outcome).inc()
                self._load_changed()
                run.span.set_attribute("inflight.outcome", outcome)
                if outcome == "error" or run.errors:
                    run.span.set_status(Status(StatusCode.ERROR))
        return outcome

    async def _fail_unreadable(self, raw: bytes | None, exc: WireError) -> None:
        # A request id we can read lets its client learn why, instead of waiting for a timeout.
        with contextlib.suppress(Exception):
            request_id = json.loads(raw or b"{}").get("id")
            if isinstance(request_id, str):
                await self.store.fail_queued(
                    request_id, f"the worker cannot read this request: {exc}", "wire"
                )

    # ---- commits ---------------------------------------------------------------------------
    async def commit_now(self) -> None:
        offsets = self.tracker.committable()
        if not offsets or self.consumer is None:
            return
        try:
            # A position past the partition's end means the log is not the one the offsets came from
            # (a broker that lost its log): committing it would skip new messages. Bounded in time,
            # because aiokafka retries a commit for as long as the broker lets it, and the rebalance
            # listener awaits this.
            ends = await asyncio.wait_for(self.consumer.end_offsets(list(offsets)), 5.0)
            stale = {tp for tp, position in offsets.items() if position > ends.get(tp, position)}
            if stale:
                log.warning("not committing past the end of %s: the broker lost its log", sorted(stale))
                self.tracker.forget(stale)
                offsets = {tp: p for tp, p in offsets.items() if tp not in stale}
            if offsets:
                await asyncio.wait_for(self.consumer.commit(offsets), 5.0)
                self.tracker.mark_committed(offsets)
        except (KafkaError, TimeoutError) as exc:
            # Not fatal: the offsets are committed with the next success, or the requests are
            # redelivered after a rebalance and skipped as terminal.
            log.warning("commit failed: %r", exc)

    async def _commit_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._commit_wake.wait(), timeout=1.0)
            self._commit_wake.clear()
            await self.commit_now()
            await asyncio.sleep(0.05)  # coalesce bursts of finishing requests into one commit

    # ---- cancellation, leases --------------------------------------------------------------
    async def _cancel_listener(self) -> None:
        pubsub = self.store.client.pubsub()
        await pubsub.subscribe(keys.CANCEL_CHANNEL)
        while True:
            try:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            except REDIS_ERRORS as exc:
                log.warning("cancel channel: %s; reconnecting", exc)
                await asyncio.sleep(0.5)
                continue  # redis-py reconnects and resubscribes on the next read
            if message is None:
                continue
            try:
                request_id = CancelMessage.decode(message["data"]).id
            except WireError as exc:
                log.error("ignoring cancel message: %s", exc)
                continue
            run = self.runs.get(request_id)
            if run is not None and not run.cancelled:
                log.info("cancelling %s", request_id)
                telemetry.count_cancelled("engine" if run.engine_ids else "intake")
                run.span.add_event("cancel requested")
                run.cancelled = True
                for engine_id in list(run.engine_ids):
                    await self.engine.abort(engine_id)

    async def _lease_keeper(self) -> None:
        interval = self.settings.lease_ttl_s / 3
        while True:
            await asyncio.sleep(interval)
            held = [r.id for r in self.runs.values() if r.holds_lease]
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
                    log.warning("lost the lease of %s to another worker; stopping it here", request_id)
                    self._fence(run)

    def _fence(self, run: Run) -> None:
        run.fenced = True
        run.holds_lease = False
        for engine_id in list(run.engine_ids):
            self._spawn(self.engine.abort(engine_id))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- load reporting --------------------------------------------------------------------
    def _load_changed(self) -> None:
        INFLIGHT.set(len(self.runs))
        if self._deletion_cost is not None:
            self._spawn(self._deletion_cost.update(len(self.runs)))

    async def _gauges(self) -> None:
        while True:
            stats = self.engine.kv_stats()
            KV_USAGE.set(stats["usage"])
            WAITING.set(self.engine.num_waiting)
            RUNNING.set(self.engine.num_running)
            await asyncio.sleep(1.0)

    def stats(self) -> dict[str, Any]:
        return {
            "worker": self.settings.worker_id,
            "draining": self.draining,
            "requests": sorted(self.runs),
            "num_waiting": self.engine.num_waiting,
            "num_running": self.engine.num_running,
            "kv": self.engine.kv_stats(),
            "partitions": sorted(tp.partition for tp in self.consumer.assignment()) if self.consumer else [],
            "publisher_healthy": self.publisher.healthy,
        }


async def _leave_first_generation(consumer: AIOKafkaConsumer) -> None:
    """Send LeaveGroup for a member of generation 0, which aiokafka itself never does.

    aiokafka reads generation 0 as "never joined" (Kafka numbers generations from 1), but tansu's first
    generation is 0: without this, a worker that drains before any rebalance leaves its partitions
    stranded until its session times out, instead of handing them over at once.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None or coordinator.generation != 0 or not coordinator.member_id:
        return
    try:
        await coordinator._send_req(LeaveGroupRequest(coordinator.group_id, coordinator.member_id))
    except Exception as exc:  # best effort, like aiokafka's own leave
        log.warning("LeaveGroup failed: %r", exc)


def _deletion_cost() -> Any:
    # k8s.py belongs to the deployment; the worker must run before (and without) it.
    try:
        from services.worker.k8s import PodDeletionCost
    except ImportError:
        return None
    try:
        return PodDeletionCost.from_env()
    except Exception:
        log.exception("pod deletion cost disabled")
        return None
