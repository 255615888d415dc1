"""Fetching from Kafka, bounded by the engine's room: a message becomes a ``Run`` (or joins its run).

Backpressure: the worker fetches only while the engine's waiting queue has room, counting requests
consumed but not yet in the engine, so the bound holds at all times; otherwise its partitions are
paused and Kafka is the buffer. A request counts from its fetch until it leaves the waiting queue:

    fetched, claiming (no engine id)  ->  handed to the engine client, not yet acknowledged by the core
      (``num_unacknowledged``)  ->  acknowledged: in the core's load (``load.num_waiting``)  ->  running

so a long step or a stalled core, during which nothing is acknowledged, stops the fetch instead of
piling requests into the client's queue.

An idle worker's fetches wait long at the broker instead of polling it every few milliseconds
(fetch_wait.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import ConsumerStoppedError, KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition

from engine.core.client import EngineClient
from services.common.metrics import service_families
from services.common.settings import Settings
from services.common.store import Store
from services.common.wire import RequestMessage, WireError
from services.worker import worker_telemetry
from services.worker.control import Spawn
from services.worker.fetch_wait import FetchWait
from services.worker.kafka_compat import set_fetch_wait
from services.worker.offsets import OffsetTracker
from services.worker.quarantine import Quarantine
from services.worker.run_state import Outcome, Run

log = logging.getLogger(__name__)

OUTCOMES = service_families().worker_outcomes


class Intake:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        engine: EngineClient,
        tracker: OffsetTracker,
        runs: dict[str, Run],
        start_run: Callable[[Run], None],
        spawn: Spawn,
        quarantine: Quarantine | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.engine = engine
        self.tracker = tracker
        self.runs = runs
        self._start_run = start_run
        self._spawn = spawn
        self.quarantine = quarantine or Quarantine()  # the runner's: a suspect in it stops the fetch
        self.stopped = False  # drain: fetch nothing more
        self.fetch_wait = FetchWait(settings.kafka_fetch_max_wait_ms, settings.kafka_idle_fetch_wait_ms)
        self.fetch_wait_ms = settings.kafka_fetch_max_wait_ms  # what the fetches wait now (/stats)

    def room(self) -> int:
        # Requests consumed but not yet in the engine count as waiting, and so do those handed to it that
        # its core has not acknowledged (its load shows them only from then on): the bound holds at all
        # times. The engine client updates its load before the count drops, so no request is ever missed
        # (for an instant one may count twice: the fetch then waits a poll longer).
        if self.quarantine.active:
            return 0  # a suspect waits for the engine or holds it alone: new work would queue behind it
        intake = sum(1 for r in self.runs.values() if not r.engine_ids)
        waiting = self.engine.load.num_waiting + self.engine.num_unacknowledged
        return self.settings.fetch_max_waiting - waiting - intake

    async def fetch_forever(self, consumer: AIOKafkaConsumer) -> None:
        fetched = False
        while True:
            room = 0 if self.stopped else self.room()
            assigned = consumer.assignment()
            if room <= 0:
                consumer.pause(*assigned)
            elif consumer.paused():
                consumer.resume(*consumer.paused())
            wait_ms = self.fetch_wait.update(busy=fetched or bool(self.runs))
            if wait_ms != self.fetch_wait_ms:
                set_fetch_wait(consumer, wait_ms)
                self.fetch_wait_ms = wait_ms
            # Idle, this loop need not wake more often than the broker answers: a record wakes it anyway.
            timeout_ms = 50 if room <= 0 else max(100, wait_ms)
            try:
                # Paused partitions return nothing; the call still keeps the consumer polling.
                batch = await consumer.getmany(timeout_ms=timeout_ms, max_records=max(room, 1))
            except ConsumerStoppedError:
                return  # stopped on purpose (a drain, a dead engine): done, not a failure to restart
            except KafkaError as exc:
                log.warning("fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            fetched = bool(batch)
            for tp, records in batch.items():
                for record in records:
                    self.on_record(tp, record)

    def on_record(self, tp: TopicPartition, record: ConsumerRecord[bytes, bytes]) -> None:
        generation = self.tracker.add(tp, record.offset, record.key)
        try:
            msg = RequestMessage.decode(record.value or b"")
        except WireError as exc:
            log.error("rejecting message at %s:%d offset %d: %s", tp.topic, tp.partition, record.offset, exc)
            OUTCOMES.labels(Outcome.REJECTED).inc()
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
            key=record.key,
        )
        run.tracing.span = worker_telemetry.consume_span(record, msg.id)
        self._start_run(run)

    async def _fail_unreadable(self, raw: bytes | None, exc: WireError) -> None:
        # A request id we can read lets its client learn why, instead of waiting for a timeout.
        with contextlib.suppress(Exception):
            request_id = json.loads(raw or b"{}").get("id")
            if isinstance(request_id, str):
                await self.store.fail_queued(
                    request_id, f"the worker cannot read this request: {exc}", "wire"
                )
