"""Process telemetry: logging (with the current trace id), tracing set-up, the Prometheus exposition.

Pieces: ``tracing`` (OTel from OTEL_* variables, context over Kafka and HTTP), ``http_tracing`` (the
server span), ``metrics`` (Prometheus families and the engine exporter), ``engine_spans`` (engine
request and step spans).
"""

from __future__ import annotations

import logging

from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from services.common.tracing import TracingSetup, setup_tracing


class _TraceIdFilter(logging.Filter):
    """Adds `` trace=<id>`` to records logged inside a span, so a log line leads to its trace."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        record.trace = f" trace={ctx.trace_id:032x}" if ctx.is_valid else ""
        return True


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s:%(trace)s %(message)s",
        force=True,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(_TraceIdFilter())
    # aiokafka logs every rebalance hiccup at WARNING: expected events in a consumer group.
    logging.getLogger("aiokafka").setLevel(max(logging.getLogger().level, logging.ERROR))


def setup_telemetry(service_name: str, log_level: str) -> TracingSetup:
    """Logging, then tracing from the OTEL_* environment: the first thing a service process does."""
    configure_logging(log_level)
    return setup_tracing(service_name)


def metrics_payload() -> tuple[bytes, str]:
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
