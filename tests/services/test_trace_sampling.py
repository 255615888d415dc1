"""The gateway's sampler: a client's traceparent makes its request part of the client's trace, but the
gateway's sampler decides whether it is recorded (unless the deployment trusts the client's flag)."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.http_tracing import TracingMiddleware
from services.common.tracing import build_provider

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
SAMPLED = f"00-{TRACE_ID}-b7ad6b7169203331-01"
NOT_SAMPLED = f"00-{TRACE_ID}-b7ad6b7169203331-00"


async def _server_spans(env: dict[str, str], trust: bool, traceparent: str) -> tuple[list[str], str]:
    """The finished server spans' trace ids, and the trace id the handler ran in."""
    provider = build_provider("test-gateway", [], env, trust_remote_sampled=trust)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = FastAPI()
    seen: list[str] = []

    @app.get("/v1/models")
    async def models() -> dict[str, str]:
        from opentelemetry import trace

        seen.append(f"{trace.get_current_span().get_span_context().trace_id:032x}")
        return {}

    app.add_middleware(TracingMiddleware, tracer=provider.get_tracer("test"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        assert (await client.get("/v1/models", headers={"traceparent": traceparent})).status_code == 200
    spans = [f"{s.context.trace_id:032x}" for s in exporter.get_finished_spans()]
    provider.shutdown()
    return spans, seen[0]


@pytest.mark.parametrize("sampler", [{"OTEL_TRACES_SAMPLER": "always_off"}, {
    "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}])  # fmt: skip
async def test_a_client_cannot_force_sampling(sampler: dict[str, str]) -> None:
    spans, linked = await _server_spans(sampler, trust=False, traceparent=SAMPLED)
    assert spans == [] and linked == TRACE_ID  # not recorded, still in the client's trace
    trusted, _ = await _server_spans(sampler, trust=True, traceparent=SAMPLED)
    assert trusted == [TRACE_ID]  # the setting that trusts the client's flag


async def test_the_gateway_samples_what_its_sampler_says_whatever_the_flag() -> None:
    spans, linked = await _server_spans({}, trust=False, traceparent=NOT_SAMPLED)
    assert spans == [TRACE_ID] and linked == TRACE_ID
    spans, _ = await _server_spans({}, trust=True, traceparent=NOT_SAMPLED)
    assert spans == []  # trusted: the client's "not sampled" wins
