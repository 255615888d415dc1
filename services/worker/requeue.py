"""A handed-back request whose message the broker no longer holds is produced again.

Handing a request back (its engine died, the worker drains) leaves its offset uncommitted, so the
partition's next reader gets the message again and resumes the request from its log in Redis. That
needs the broker to still hold the message. A broker that lost its log since the request was consumed
(tansu keeps it in memory; a Kafka topic recreated or cut back by an unclean leader election) holds
nothing there, or another message: no worker would ever see the request again, and its client would
wait for good. So before letting go of a claim, the worker reads the message's offset back, and where
the message is gone produces it again, same key (same partition, same engine's prefix cache), with the
request's trace context. Its record stays in progress: the claim that takes it resumes from the log.

The probe and producer are started on first need: a worker that never hands back opens neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError
from opentelemetry import trace

from services.common.kafka import log_holds, make_probe, make_producer, refresh_producer_metadata
from services.common.settings import Settings
from services.common.tracing import inject_kafka
from services.worker.run_state import Run

log = logging.getLogger(__name__)

PRODUCE_TIMEOUT_S = 10.0


class Requeue:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._probe: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()  # one probe: its seeks and reads must not interleave

    async def ensure_held(self, run: Run) -> bool:
        """Make sure some worker will get ``run`` again; True when its message had to be produced again.
        Best effort: a broker that cannot be reached now leaves the request as it was."""
        if not run.deliveries:
            return False
        tp, offset, _ = run.deliveries[0]
        try:
            async with self._lock:
                if self._probe is None:
                    self._probe = make_probe(self.settings)
                    await self._probe.start()
                if await log_holds(self._probe, tp, offset, run.key):
                    return False
                if self._producer is None:
                    self._producer = make_producer(self.settings)
                    await self._producer.start()
                await refresh_producer_metadata(self._producer)
                headers = inject_kafka(context=trace.set_span_in_context(run.span))
                sent = await asyncio.wait_for(
                    self._producer.send_and_wait(
                        self.settings.kafka_topic, run.msg.encode(), key=run.key, headers=headers
                    ),
                    PRODUCE_TIMEOUT_S,
                )
        except (KafkaError, OSError, TimeoutError) as exc:
            log.warning("request %s: could not check or restore its message in Kafka: %r", run.id, exc)
            return False
        log.warning(
            "request %s: the broker no longer holds its message (%s:%d offset %d); produced it again "
            "(partition %d offset %d) for another worker to resume",
            run.id,
            tp.topic,
            tp.partition,
            offset,
            sent.partition,
            sent.offset,
        )
        return True

    async def close(self) -> None:
        for client in (self._probe, self._producer):
            if client is not None:
                with contextlib.suppress(KafkaError, OSError):
                    await client.stop()
        self._probe = self._producer = None
