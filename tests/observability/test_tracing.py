"""Tracing setup from OTEL_* variables, and W3C trace context over Kafka headers and HTTP."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import NonRecordingSpan

from services.common.tracing import (
    build_provider,
    exporter_names,
    extract_http,
    extract_kafka,
    inject_http,
    inject_kafka,
    setup_tracing,
)

CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ("otlp",)),
        # The chart sets "none" explicitly when no collector is configured.
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ()),
        ({"OTEL_TRACES_EXPORTER": "otlp, Console"}, ("otlp", "console")),
    ],
)
def test_exporters_come_from_the_environment(env: dict[str, str], expected: tuple[str, ...]) -> None:
    assert exporter_names(env) == expected


def test_an_unknown_exporter_fails_at_start_up() -> None:
    with pytest.raises(ValueError, match="zipkin"):
        exporter_names({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_disabled_or_unconfigured_keeps_the_noop_provider() -> None:
    before = trace.get_tracer_provider()
    off = setup_tracing("svc", {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"})
    none = setup_tracing("svc", {})
    assert not off.enabled and not none.enabled and off.provider is None
    assert trace.get_tracer_provider() is before


def test_provider_resource_and_processors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "k8s.pod.name=worker-0")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    provider = build_provider("inflight-worker", ["otlp", "console"])
    assert provider.resource.attributes["service.name"] == "inflight-worker"
    assert provider.resource.attributes["k8s.pod.name"] == "worker-0"
    processors = provider._active_span_processor._span_processors
    assert len(processors) == 2 and all(isinstance(p, BatchSpanProcessor) for p in processors)
    provider.shutdown()
    # The deployment's OTEL_SERVICE_NAME wins over the code's default.
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gw-eu")
    named = build_provider("inflight-gateway", [])
    assert named.resource.attributes["service.name"] == "gw-eu"
    named.shutdown()


def test_kafka_headers_round_trip_with_tracestate(spans) -> None:
    provider, _ = spans
    tracer = provider.get_tracer("test")
    incoming = extract_http({"traceparent": CLIENT, "tracestate": "vendor=abc"})
    with tracer.start_as_current_span("produce", context=incoming) as span:
        # A re-produced message already carries a traceparent: it is replaced, never duplicated.
        headers = inject_kafka([("traceparent", b"stale"), ("x-other", b"1")])
    names = [k for k, _ in headers]
    assert names.count("traceparent") == 1 and "x-other" in names
    assert dict(headers)["tracestate"] == b"vendor=abc"
    ctx = trace.get_current_span(extract_kafka(headers)).get_span_context()
    assert ctx.is_remote and ctx.trace_id == span.get_span_context().trace_id
    assert ctx.span_id == span.get_span_context().span_id
    assert ctx.trace_state.get("vendor") == "abc"
    # The produce span continued the client's trace.
    assert f"{ctx.trace_id:032x}" == CLIENT.split("-")[1]


def test_kafka_header_names_match_case_insensitively() -> None:
    span = trace.get_current_span(extract_kafka([("Traceparent", CLIENT.encode())]))
    assert f"{span.get_span_context().span_id:016x}" == "b7ad6b7169203331"


def test_missing_or_malformed_context_starts_a_new_trace() -> None:
    for headers in (None, [], [("traceparent", b"00-garbage")]):
        assert not trace.get_current_span(extract_kafka(headers)).get_span_context().is_valid


def test_http_inject_of_an_explicit_context() -> None:
    ctx = extract_http({"traceparent": CLIENT})
    assert isinstance(trace.get_current_span(ctx), NonRecordingSpan)
    assert inject_http({"accept": "x"}, context=ctx) == {"accept": "x", "traceparent": CLIENT}


def test_otlp_exporter_reaches_a_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exporter the services build from OTEL_* variables speaks to a collector (the test's receiver)."""
    from tests.observability.otlp_receiver import OTLPReceiver

    with OTLPReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "svc-under-test")
        provider = build_provider("fallback", exporter_names({"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint}))
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("parent") as parent:
            span = tracer.start_span("child", attributes={"list": ["a", "b"], "n": 3})
            span.add_event("tick", {"k": 1})
            span.end()
        provider.shutdown()  # flushes the batch processor
        spans = {s.name: s for s in rx.wait_for(lambda got: len(got) == 2)}
    child = spans["child"]
    assert child.service == "svc-under-test"
    assert child.parent_span_id == f"{parent.get_span_context().span_id:016x}"
    assert child.trace_id == spans["parent"].trace_id
    assert child.attributes == {"list": ("a", "b"), "n": 3}
    assert [(e.name, e.attributes) for e in child.events] == [("tick", {"k": 1})]
