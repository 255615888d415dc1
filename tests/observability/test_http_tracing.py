"""The HTTP server span: continues the client's trace, named by route, covers a streamed response."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from services.common.http_tracing import TracingMiddleware

CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def make_app(tracer: trace.Tracer) -> FastAPI:
    app = FastAPI()
    inner = tracer

    @app.get("/v1/jobs/{job_id}")
    async def job(job_id: str) -> dict[str, str]:
        with inner.start_as_current_span("child"):
            return {"id": job_id}

    @app.get("/v1/stream")
    async def stream() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(3):
                with inner.start_as_current_span(f"chunk {i}"):
                    yield f"data: {i}\n\n".encode()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    app.add_middleware(TracingMiddleware, tracer=tracer)
    return app


async def test_server_span_continues_the_client_trace(spans) -> None:
    provider, exporter = spans
    app = make_app(provider.get_tracer("test"))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        assert (await client.get("/v1/jobs/abc", headers={"traceparent": CLIENT})).status_code == 200
        body = (await client.get("/v1/stream")).text
        assert (await client.get("/boom")).status_code == 500
        await client.get("/healthz")
    assert body.count("data:") == 3
    got = {s.name: s for s in exporter.get_finished_spans()}
    server = got["GET /v1/jobs/{job_id}"]  # the route template, not the job id
    assert server.kind == SpanKind.SERVER and server.attributes["http.route"] == "/v1/jobs/{job_id}"
    assert server.attributes["http.response.status_code"] == 200
    assert f"{server.context.trace_id:032x}" == CLIENT.split("-")[1]
    assert f"{server.parent.span_id:016x}" == CLIENT.split("-")[2]
    assert got["child"].parent.span_id == server.context.span_id
    # The streamed response's chunks are produced inside the server span, which ends after them.
    stream = got["GET /v1/stream"]
    assert stream.parent is None
    for i in range(3):
        chunk = got[f"chunk {i}"]
        assert chunk.parent.span_id == stream.context.span_id and chunk.end_time <= stream.end_time
    assert got["GET /boom"].status.status_code == StatusCode.ERROR
    assert not any("healthz" in name for name in got)
