"""Admission, enqueue and the watch over queued requests.

    budgets (this gateway's, per key: budgets.py) -> admit (cluster-wide pending bound, 429 past it)
    -> record (queued) -> subscribe -> produce
    -> watch until an engine takes it (or its deadline passes: failed with code "timeout")

The watch refreshes this gateway's reservations in the pending set (so they outlive a long queue while
this gateway lives, and expire soon after it dies), and notices a request whose Kafka message is gone:
a broker that lost its log (tansu keeps it in memory) or was reset. Such a request is produced again,
or after a few attempts failed with a clear error, instead of hanging its client forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition
from opentelemetry.trace import SpanKind

from services.common import keys
from services.common.kafka import (
    MESSAGE_TOO_LARGE,
    ensure_topic,
    log_holds,
    make_probe,
    make_producer,
    max_message_bytes,
    refresh_producer_metadata,
    topic_partitions,
)
from services.common.settings import Settings
from services.common.store import REDIS_ERRORS, Store
from services.common.tracing import get_tracer, inject_kafka
from services.common.wire import FAILED, RequestMessage
from services.gateway.background import Supervisor, forever
from services.gateway.budgets import KeyBudgets, Slot, refuse
from services.gateway.errors import APIError, unavailable
from services.gateway.token_streams import Hub, Subscription

log = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 1.0
_MAX_PRODUCE_ATTEMPTS = 3
_HEARTBEAT_S = 1.0
GATEWAY_ALIVE_TTL_S = 4.0  # a few missed heartbeats before the workers give this gateway's requests up


@dataclass
class _Queued:
    value: bytes
    key: bytes
    headers: list[tuple[str, bytes]]
    partition: int
    offset: int
    held: Slot  # its bytes in this gateway's queued-bytes budgets, given back when it leaves _queued
    deadline: float | None = None  # unix seconds by which an engine must have started it
    attempts: int = 1


class Dispatcher:
    def __init__(
        self, settings: Settings, store: Store, hub: Hub, supervisor: Supervisor | None = None
    ) -> None:
        self.settings = settings
        self.store = store
        self.hub = hub
        self.producer: AIOKafkaProducer = make_producer(settings)
        # Group-less consumer, only to read end offsets (has a queued message been lost?).
        self._probe = make_probe(settings)
        self._queued: dict[str, _Queued] = {}
        self.budgets = KeyBudgets(
            settings.max_concurrent_per_key, settings.max_queued_bytes, settings.max_queued_bytes_per_key
        )
        self._task: asyncio.Task[None] | None = None
        self._beat: asyncio.Task[None] | None = None
        self._cleanups: set[asyncio.Task[None]] = set()
        self._supervisor = supervisor or Supervisor()

    async def start(self) -> None:
        await self.producer.start()
        await self._probe.start()
        self._task = self._supervisor.start("queue_watch", forever("queue_watch", self._watch))
        self._beat = self._supervisor.start(
            "gateway_heartbeat", forever("gateway_heartbeat", self._heartbeat)
        )

    async def stop(self) -> None:
        for task in (self._task, self._beat):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        with contextlib.suppress(*REDIS_ERRORS):
            await self.store.client.delete(keys.gateway_alive(self.settings.instance_id))
        for client in (self.producer, self._probe):
            with contextlib.suppress(Exception):
                await client.stop()

    async def kafka_ready(self) -> bool:
        try:
            await asyncio.wait_for(self._probe._client.fetch_all_metadata(), 2.0)
            return True
        except (KafkaError, TimeoutError, OSError):
            return False

    # ---- submit ----------------------------------------------------------------------------
    async def submit(
        self,
        msg: RequestMessage,
        key: bytes,
        headers: list[tuple[str, bytes]],
        record: dict[str, str | int | float],
        *,
        subscribe: bool,
        owner: str = "",
    ) -> Subscription | None:
        """Admit and produce ``msg`` for ``owner`` (a key's digest); its subscription when ``subscribe``.

        A synchronous request takes one of its key's in-flight slots, held until its subscription is
        dropped; every message holds its bytes until an engine takes it (budgets.py).
        """
        s = self.settings
        ttl = s.job_ttl_s if msg.job else s.record_ttl_s
        value = msg.encode()
        if len(value) > max_message_bytes(s):
            # Refused now: the producer would otherwise retry a message it can never send until its timeout.
            message = (
                f"this request encodes to {len(value)} bytes, over the {max_message_bytes(s)} the queue takes"
            )
            raise APIError(413, message, code="request_too_large")
        slot = self.budgets.enter(owner) if subscribe and not msg.job else None
        try:
            held = self.budgets.hold(owner, len(value))
        except APIError:
            if slot is not None:
                slot.release()
            raise
        try:
            sub, headers, partition, offset = await self._admit_and_produce(
                msg, value, key, headers, record, ttl, subscribe=subscribe
            )
        except BaseException:
            held.release()
            if slot is not None:
                slot.release()
            raise
        if slot is not None and sub is not None:
            sub.on_release = slot.release
        self._queued[msg.id] = _Queued(value, key, headers, partition, offset, held, msg.deadline)
        return sub

    async def _admit_and_produce(
        self,
        msg: RequestMessage,
        value: bytes,
        key: bytes,
        headers: list[tuple[str, bytes]],
        record: dict[str, str | int | float],
        ttl: int,
        *,
        subscribe: bool,
    ) -> tuple[Subscription | None, list[tuple[str, bytes]], int, int]:
        s = self.settings
        # Subscribing and admitting are independent round trips: run them at once.
        pending_sub = asyncio.ensure_future(self.hub.subscribe(msg.id)) if subscribe else None
        sub: Subscription | None = None
        try:
            admitted = await self.store.admit_and_record(msg.id, s.max_pending, s.pending_ttl_s, record, ttl)
            sub = await pending_sub if pending_sub is not None else None  # before producing: nothing missed
            if not admitted:
                self._forget(msg.id, sub)
                message = (
                    f"the service is at capacity ({s.max_pending} requests wait for an engine); retry shortly"
                )
                raise refuse("capacity", message)
            headers, partition, offset = await self._traced_produce(msg.id, value, key, headers)
        except APIError:
            raise
        except BaseException as exc:
            if sub is None and pending_sub is not None:
                # The admission failed (or this route was cancelled) while the subscription ran beside
                # it: a subscription that completed is released here, or nobody ever would.
                sub = await _settled(pending_sub)
            await self._abandon(msg.id, sub)
            if isinstance(exc, MESSAGE_TOO_LARGE):
                # The broker (or its topic) takes smaller messages than this gateway's body limit.
                log.warning("the broker refused a %d-byte request: %r", len(value), exc)
                message = f"this request encodes to {len(value)} bytes, more than the message broker takes"
                raise APIError(413, message, code="request_too_large") from None
            if isinstance(exc, KafkaError | TimeoutError):
                log.warning("produce failed: %r", exc)
                raise unavailable("the message broker is unavailable", "broker_unavailable") from None
            raise
        return sub, headers, partition, offset

    def _forget(self, request_id: str, sub: Subscription | None) -> None:
        """A refused request: drop its record and subscription off the response's path."""

        async def cleanup() -> None:
            if sub is not None:
                await self.hub.unsubscribe(sub)
            with contextlib.suppress(*REDIS_ERRORS):
                await self.store.client.delete(keys.record(request_id))

        task = asyncio.ensure_future(cleanup())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _traced_produce(
        self, request_id: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]]
    ) -> tuple[list[tuple[str, bytes]], int, int]:
        """Produce inside a PRODUCER span whose context rides in the message headers (W3C traceparent,
        tracestate): the worker's consume span continues this trace. Returns the headers as sent."""
        topic = self.settings.kafka_topic
        attributes = {
            "messaging.system": "kafka",
            "messaging.operation.type": "send",
            "messaging.operation.name": "send",
            "messaging.destination.name": topic,
            "messaging.message.id": request_id,
            "messaging.kafka.message.key": key.decode("latin-1"),
        }
        with get_tracer().start_as_current_span(
            f"send {topic}", kind=SpanKind.PRODUCER, attributes=attributes
        ) as span:
            headers = inject_kafka(headers)
            partition, offset = await self._produce(value, key, headers)
            span.set_attribute("messaging.destination.partition.id", str(partition))
            span.set_attribute("messaging.kafka.offset", offset)
        return headers, partition, offset

    async def _produce(self, value: bytes, key: bytes, headers: list[tuple[str, bytes]]) -> tuple[int, int]:
        deadline = time.monotonic() + self.settings.kafka_produce_timeout_s
        while True:
            try:
                remaining = max(0.1, deadline - time.monotonic())
                fut = await asyncio.wait_for(
                    self.producer.send(self.settings.kafka_topic, value, key=key, headers=headers), remaining
                )
                meta = await asyncio.wait_for(fut, max(0.1, deadline - time.monotonic()))
                return meta.partition, meta.offset
            except MESSAGE_TOO_LARGE:
                raise  # no retry makes it smaller
            except KafkaError:
                # Hiccups of a broker that just came back (the topic being recreated, tansu's
                # UnknownError) are retried until the deadline; the caller then answers 503.
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.1)

    async def _abandon(self, request_id: str, sub: Subscription | None) -> None:
        if sub is not None:
            await self.hub.unsubscribe(sub)
        with contextlib.suppress(*REDIS_ERRORS):
            await self.store.release_pending(request_id)
            # Failed, not deleted: if the message still reaches Kafka later, the worker skips it. Fenced:
            # a cancel or a worker that got there first keeps its status, and the record its TTL.
            ttl = self.settings.record_ttl_s
            await self.store.set_fields(request_id, {"status": FAILED, "error": "never enqueued"}, ttl)

    def _drop(self, request_id: str) -> None:
        """``request_id`` left this gateway's watch (taken, cancelled, failed): its bytes are free."""
        queued = self._queued.pop(request_id, None)
        if queued is not None:
            queued.held.release()

    async def cancel(self, request_id: str) -> str:
        self._drop(request_id)
        return await self.store.cancel(request_id, max(self.settings.job_ttl_s, 60))

    async def _heartbeat(self) -> None:
        """This gateway's liveness key: workers abort the synchronous requests of a gateway whose key
        has lapsed (SIGKILLed, or cut off from Redis), instead of generating for nobody."""
        name = keys.gateway_alive(self.settings.instance_id)
        while True:
            with contextlib.suppress(*REDIS_ERRORS):
                await self.store.client.set(name, "1", px=int(GATEWAY_ALIVE_TTL_S * 1000))
            await asyncio.sleep(_HEARTBEAT_S)

    # ---- watch -----------------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            if not self._queued:
                continue
            try:
                await self._check_queued()
            except (*REDIS_ERRORS, KafkaError, TimeoutError) as exc:
                log.warning("queue watch skipped a round: %r", exc)
            except Exception:
                log.exception("queue watch failed a round")  # never let the watch die

    async def _check_queued(self) -> None:
        ids = list(self._queued)
        alive = await self.store.refresh_pending(ids, self.settings.pending_ttl_s)
        for request_id in ids:
            if request_id not in alive:
                self._drop(request_id)  # an engine took it (or it was cancelled)
        alive = await self._expire(alive)
        if not alive:
            return
        topic = self.settings.kafka_topic
        # A partition the topic no longer has (it came back from a broker that lost it, with the broker's
        # default count) lost its messages; its end offset would only time out, for every request.
        existing = await topic_partitions(self._probe, topic)
        partitions = list(
            {TopicPartition(topic, q.partition) for q in self._queued.values() if q.partition in existing}
        )
        ends = await asyncio.wait_for(self._probe.end_offsets(partitions), 5.0) if partitions else {}
        for request_id in alive:
            queued = self._queued.get(request_id)
            if queued is None:
                continue
            tp = TopicPartition(topic, queued.partition)
            end = ends.get(tp)
            # An empty partition holds nothing for sure; otherwise read the message (end offsets lag).
            gone = queued.partition not in existing or end == 0
            if gone or (
                end is not None
                and end <= queued.offset
                and not await log_holds(self._probe, tp, queued.offset, queued.key)
            ):
                await self._requeue(request_id, queued)

    async def _expire(self, pending: set[str]) -> set[str]:
        """Fail the pending requests whose deadline has passed; returns the others.

        The worker makes the same check when it takes a request, so one expired in Kafka is never
        prefilled either way; failing it here answers its client even while no worker is free.
        """
        now = time.time()
        kept = set()
        for request_id in pending:
            queued = self._queued.get(request_id)
            if queued is None or queued.deadline is None or now < queued.deadline:
                kept.add(request_id)
                continue
            self._drop(request_id)
            late_s = now - queued.deadline
            message = f"no engine could start this request by its deadline ({late_s:.1f}s ago)"
            await self.store.fail_queued(request_id, message, "timeout")
        return kept

    async def _requeue(self, request_id: str, queued: _Queued) -> None:
        """The partition's log ends before this message: the broker lost it."""
        if queued.attempts >= _MAX_PRODUCE_ATTEMPTS:
            log.error("request %s lost by the broker %d times; failing it", request_id, queued.attempts)
            self._drop(request_id)
            await self.store.fail_queued(
                request_id, "the message broker lost this request; please retry", "lost_by_broker"
            )
            return
        log.warning("request %s was lost by the broker; producing it again", request_id)
        await ensure_topic(self.settings)  # a restarted broker may have forgotten the topic too
        await refresh_producer_metadata(self.producer)
        queued.partition, queued.offset = await self._produce(queued.value, queued.key, queued.headers)
        queued.attempts += 1


async def _settled(pending: asyncio.Future[Subscription]) -> Subscription | None:
    """The subscription a side task made, or None: one still running is cancelled and waited for (its
    own clean-up unsubscribes it), one that failed made nothing."""
    if not pending.done():
        pending.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait([pending])
    if pending.cancelled() or pending.exception() is not None:
        return None
    return pending.result()
