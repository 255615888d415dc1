"""OpenTelemetry tracing for the services: set up from the standard ``OTEL_*`` variables, and W3C trace
context carried across Kafka headers and HTTP.

Configuration is the SDK's own, so a deployment sets the variables every OTel SDK reads:

    OTEL_SDK_DISABLED=true             no SDK at all: spans are no-ops (incoming context still passes)
    OTEL_TRACES_EXPORTER=otlp|console|none (comma list); unset = otlp if an OTLP endpoint is set, else none
    OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT, _HEADERS, _TIMEOUT   read by the OTLP/HTTP exporter itself
    OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES                 the resource (env wins over our default)
    OTEL_TRACES_SAMPLER[_ARG], OTEL_BSP_*, OTEL_PROPAGATORS     read by the SDK itself

Who decides what is sampled. The SDK's default sampler follows a remote parent's sampled flag, so any
client could have every one of its requests traced (span storage and export cost on the server's side).
The gateway passes ``trust_remote_sampled=False``: a client's ``traceparent`` still makes the request part
of the client's trace (same trace id, its span the parent), but whether it is recorded is the gateway's
own sampler's choice, made independently of the ids the client picked. Workers keep the default: their
remote parent is the gateway, whose choice they follow.

With no exporter the process keeps the API's no-op provider rather than an SDK provider that drops
spans: a no-op span costs next to nothing, and it still carries the caller's context onwards, so a
client's ``traceparent`` survives a hop that does not record.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind
from opentelemetry.util.types import Attributes

log = logging.getLogger(__name__)

KafkaHeaders = list[tuple[str, bytes]]
INSTRUMENTATION = "inflight"
_EXPORTERS = ("otlp", "console", "none")
_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class TracingSetup:
    enabled: bool  # spans are recorded and exported
    exporters: tuple[str, ...]
    provider: TracerProvider | None


def exporter_names(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The exporters the environment asks for; raises on a name this build cannot export to."""
    raw = environ.get("OTEL_TRACES_EXPORTER", "").strip()
    if not raw:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        return ("otlp",) if endpoint else ()
    names = tuple(n.strip().lower() for n in raw.split(",") if n.strip())
    unknown = [n for n in names if n not in _EXPORTERS]
    if unknown:
        # Fail at start-up: a typo here would otherwise silently lose every trace.
        raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter(s) {unknown}; use {_EXPORTERS}")
    return tuple(n for n in names if n != "none")


class _RandomRatio(Sampler):
    """Samples a fraction of spans by a draw of its own: unlike TraceIdRatioBased, the caller cannot
    pick a trace id that is always sampled."""

    def __init__(self, rate: float) -> None:
        self.rate = rate

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: trace.TraceState | None = None,
    ) -> SamplingResult:
        sampled = self.rate >= 1.0 or random.random() < self.rate
        return SamplingResult(Decision.RECORD_AND_SAMPLE if sampled else Decision.DROP, attributes)

    def get_description(self) -> str:
        return f"RandomRatio{{{self.rate}}}"


def own_sampler(environ: Mapping[str, str]) -> Sampler:
    """The sampler OTEL_TRACES_SAMPLER / _ARG name, deciding remote parents itself: a span of this
    process with a local parent follows it, one with a remote parent (a client's ``traceparent``) is
    sampled at the configured rate, whatever the client's flag says."""
    name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    raw_arg = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if name.endswith("always_off"):
        rate = 0.0
    elif name.endswith("traceidratio"):
        try:
            rate = min(1.0, max(0.0, float(raw_arg))) if raw_arg else 1.0
        except ValueError:
            log.warning("OTEL_TRACES_SAMPLER_ARG=%r is not a number; sampling everything", raw_arg)
            rate = 1.0
    else:
        rate = 1.0
    root: Sampler = ALWAYS_OFF if rate == 0.0 else ALWAYS_ON if rate == 1.0 else TraceIdRatioBased(rate)
    remote = _RandomRatio(rate)
    return ParentBased(root, remote_parent_sampled=remote, remote_parent_not_sampled=remote)


def build_provider(
    service_name: str,
    exporters: Sequence[str],
    environ: Mapping[str, str] | None = None,
    *,
    trust_remote_sampled: bool = True,
) -> TracerProvider:
    env = os.environ if environ is None else environ
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    # None: the SDK reads OTEL_TRACES_SAMPLER itself (parent-based: a remote parent's flag decides).
    sampler = None if trust_remote_sampled else own_sampler(env)
    provider = TracerProvider(resource=resource, sampler=sampler)
    for name in exporters:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name, env)))
    return provider


def _exporter(name: str, env: Mapping[str, str]) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol and protocol != "http/protobuf":
        log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s is not installed; exporting http/protobuf", protocol)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def setup_tracing(
    service_name: str, environ: Mapping[str, str] | None = None, *, trust_remote_sampled: bool = True
) -> TracingSetup:
    """Install the process's tracer provider from the environment (once, at start-up);
    ``trust_remote_sampled``: see the module docstring."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return TracingSetup(False, (), None)
    exporters = exporter_names(env)
    if not exporters:
        return TracingSetup(False, (), None)
    provider = build_provider(service_name, exporters, env, trust_remote_sampled=trust_remote_sampled)
    trace.set_tracer_provider(provider)
    log.info("tracing %s to %s", service_name, ", ".join(exporters))
    return TracingSetup(True, exporters, provider)


def shutdown_tracing(setup: TracingSetup) -> None:
    """Flush what is buffered (a worker's last requests) before the process exits."""
    if setup.provider is not None:
        setup.provider.shutdown()


def get_tracer() -> trace.Tracer:
    return trace.get_tracer(INSTRUMENTATION)


# ---- W3C trace context over Kafka headers --------------------------------------------------------
class _KafkaGetter(Getter[Sequence[tuple[str, bytes]]]):
    def get(self, carrier: Sequence[tuple[str, bytes]], key: str) -> list[str] | None:
        # Kafka header names are case-sensitive, W3C's are lowercase: match loosely, as HTTP does.
        values = [v.decode("latin-1") for k, v in carrier if k.lower() == key and v is not None]
        return values or None

    def keys(self, carrier: Sequence[tuple[str, bytes]]) -> list[str]:
        return [k for k, _ in carrier]


class _KafkaSetter(Setter[KafkaHeaders]):
    def set(self, carrier: KafkaHeaders, key: str, value: str) -> None:
        # Replace, never append: a re-produced message must not carry two parents.
        carrier[:] = [(k, v) for k, v in carrier if k.lower() != key]
        carrier.append((key, value.encode("latin-1")))


_KAFKA_GETTER = _KafkaGetter()
_KAFKA_SETTER = _KafkaSetter()


def inject_kafka(headers: KafkaHeaders | None = None, context: Context | None = None) -> KafkaHeaders:
    """Headers carrying ``context`` (default: the current one): traceparent, tracestate, baggage."""
    carrier: KafkaHeaders = list(headers or [])
    propagate.inject(carrier, context=context, setter=_KAFKA_SETTER)
    return carrier


def extract_kafka(headers: Sequence[tuple[str, bytes]] | None) -> Context:
    """The producer's context from a consumed message's headers (an empty context if it has none)."""
    return propagate.extract(list(headers or []), getter=_KAFKA_GETTER)


# ---- HTTP ------------------------------------------------------------------------------------------
def inject_http(headers: Mapping[str, str] | None = None, context: Context | None = None) -> dict[str, str]:
    carrier = dict(headers or {})
    propagate.inject(carrier, context=context)
    return carrier


def extract_http(headers: Mapping[str, str]) -> Context:
    """The client's context from request headers (Starlette's are case-insensitive, a dict must be
    lowercase, as HTTP/2 sends them)."""
    return propagate.extract(headers)


def current_traceparent() -> str | None:
    carrier = inject_http()
    return carrier.get("traceparent")


@contextmanager
def attached(context: Context) -> Iterator[None]:
    """Make ``context`` current for a block (for code that starts spans without a context argument)."""
    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)
