"""The worker's traces and metrics: the engine's exporters, the consume span, Kafka consumer lag.

Trace of one request in the worker (the producer's context arrives in the message headers):

    process <topic>  (CONSUMER, child of the gateway's "send <topic>")
      ├ engine.request <operation>   one per completion index; timeline events from the engine
      │   └ publish inflight:events  the first token events reaching Redis
      └ publish inflight:events      the final round trip (done event and record), inflight.final=true
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from engine.sampling_params import SamplingParams
from services.common import keys
from services.common.engine_spans import Attributes, EngineSpanExporter, sampling_attributes
from services.common.metrics import EngineMetricsExporter, service_families
from services.common.settings import Settings
from services.common.tracing import extract_kafka, get_tracer
from services.common.wire import RequestMessage
from services.worker.run_state import Run

if TYPE_CHECKING:
    from engine.metrics import EngineStatsSource

log = logging.getLogger(__name__)

LAG_INTERVAL_S = 2.0
PUBLISH_SPAN = f"publish {keys.PREFIX}:events"  # the channel name without the id: one span name


def instrument_engine(engine: EngineStatsSource, settings: Settings) -> EngineSpanExporter:
    """Attach the Prometheus exporter and the span exporter to the engine (before its loop starts).

    The span exporter is attached even with tracing off: its spans are then the API's no-op ones, and
    the benchmark (bench/tracing_overhead.py) measures exactly this configuration.
    """
    EngineMetricsExporter(settings.model_name).attach(engine)
    spans = EngineSpanExporter(
        get_tracer(), settings.model_name, step_sample_every=settings.trace_step_sample_every
    )
    spans.attach(engine)
    service_families()  # the service counters appear in the first scrape, at 0
    return spans


def consume_span(record: ConsumerRecord[bytes, bytes], request_id: str | None) -> trace.Span:
    """The CONSUMER span of a message, continuing the producer's trace from its headers."""
    attributes: Attributes = {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": record.topic,
        "messaging.destination.partition.id": str(record.partition),
        "messaging.kafka.offset": record.offset,
    }
    if request_id:
        attributes["messaging.message.id"] = request_id
    return get_tracer().start_span(
        f"process {record.topic}",
        context=extract_kafka(record.headers),
        kind=SpanKind.CONSUMER,
        attributes=attributes,
    )


def engine_attributes(msg: RequestMessage, params: SamplingParams, index: int, resumed: int) -> Attributes:
    attrs = sampling_attributes(params)
    attrs["gen_ai.operation.name"] = "chat" if msg.kind == "chat" else "text_completion"
    attrs["gen_ai.response.id"] = msg.id
    attrs["inflight.choice.index"] = index
    if resumed:
        attrs["inflight.resumed_tokens"] = resumed  # the stream continues another worker's
    return attrs


def trace_publish(
    run: Run, *, final: bool, num_events: int, num_requests: int, ok: bool, start_ns: int, end_ns: int
) -> None:
    """A span for a publish round trip that carried ``run``'s events: only its first one (the first
    tokens, under the engine span) and its final one (under the consume span). A span per token would
    outnumber everything else in the trace and cost a span per step per request."""
    if not run.span.is_recording():
        return
    if final:
        parent = trace.set_span_in_context(run.span)
    elif not run.tracing.first_publish_traced and run.tracing.publish_parent is not None:
        parent = run.tracing.publish_parent
        run.tracing.first_publish_traced = True
    else:
        return
    attributes: Attributes = {
        "messaging.system": "redis",
        "messaging.operation.type": "send",
        "messaging.destination.name": keys.events(run.id),
        "messaging.batch.message_count": num_events,
        "inflight.seq": run.outbox.seq,
        "inflight.final": final,
        "inflight.round_trip.requests": num_requests,  # requests sharing this pipelined round trip
    }
    span = get_tracer().start_span(
        PUBLISH_SPAN, context=parent, kind=SpanKind.PRODUCER, attributes=attributes, start_time=start_ns
    )
    if not ok:
        span.set_status(Status(StatusCode.ERROR, "fenced: another worker owns the request now"))
    span.end(end_ns)


def count_cancelled(stage: str) -> None:
    """stage: queued (cancelled while in Kafka: the worker skips the message; a redelivery of such a
    message counts again), intake (consumed, not yet in the engine), engine (aborted in the engine)."""
    service_families().requests_cancelled.labels(stage).inc()


async def consumer_lag(consumer: AIOKafkaConsumer) -> dict[tuple[str, int], int]:
    """Messages between this consumer's position and the log end, per assigned partition. A paused
    partition (the engine is full) keeps its position while the end moves: its lag is the backlog."""
    assigned = list(consumer.assignment())
    if not assigned:
        return {}
    ends = await asyncio.wait_for(consumer.end_offsets(assigned), 5.0)
    lags = {}
    for tp in assigned:
        position = await asyncio.wait_for(consumer.position(tp), 2.0)
        lags[(tp.topic, tp.partition)] = ends.get(tp, position) - position
    return lags


async def report_lag_forever(consumer: AIOKafkaConsumer, interval_s: float = LAG_INTERVAL_S) -> None:
    families = service_families()
    while True:
        try:
            families.set_consumer_lag(await consumer_lag(consumer))
        except (KafkaError, TimeoutError) as exc:  # e.g. a rebalance took a partition meanwhile
            log.debug("consumer lag not measured this round: %r", exc)
        await asyncio.sleep(interval_s)
