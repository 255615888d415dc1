"""A SERVER span per HTTP request (ASGI middleware), continuing the client's ``traceparent``.

The span covers the whole response, a streamed one (SSE) included: the app returns only when the last
chunk is sent. Its name is "{method} {route template}" (e.g. "POST /v1/chat/completions"), never the
raw path, so job ids do not make one span name per request. Probes and /metrics are left untraced:
they would bury the requests under scrapes.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.tracing import extract_http, get_tracer

UNTRACED = ("/metrics", "/healthz", "/readyz", "/livez")


class TracingMiddleware:
    def __init__(
        self, app: ASGIApp, untraced: Iterable[str] = UNTRACED, tracer: trace.Tracer | None = None
    ) -> None:
        self.app = app
        self.untraced = frozenset(untraced)
        # The global tracer is a proxy: created before setup_tracing() it still follows the provider.
        self.tracer = tracer or get_tracer()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.untraced:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        method = scope.get("method", "GET")
        attributes = {
            "http.request.method": method,
            "url.path": scope["path"],
            "url.scheme": scope.get("scheme", "http"),
        }
        if scope.get("client"):
            attributes["client.address"] = str(scope["client"][0])
        if "user-agent" in headers:
            attributes["user_agent.original"] = headers["user-agent"]
        with self.tracer.start_as_current_span(
            method, context=extract_http(headers), kind=SpanKind.SERVER, attributes=attributes
        ) as span:

            async def traced_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:  # a 4xx is the client's error, not this server's (HTTP semconv)
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            try:
                await self.app(scope, receive, traced_send)
            finally:
                _name_after_route(span, scope, method)


def fastapi_native_tracing_off() -> dict[str, Any]:
    """``FastAPI(**...)`` keyword arguments that turn off FastAPI's own spans where it has them.

    Newer FastAPI releases trace natively (a server span plus spans per dependency and endpoint). The
    gateway keeps this module's middleware as its one server span instead: the same span name,
    attributes and untraced probes on every FastAPI version pyproject allows, and no second SERVER
    span per request."""
    from fastapi import FastAPI

    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        return {"telemetry": {"tracing": False, "operation_spans": False}}
    return {}


def _name_after_route(span: trace.Span, scope: Scope, method: str) -> None:
    route = getattr(scope.get("route"), "path", None)  # set by the router once it matched
    if isinstance(route, str):
        span.set_attribute("http.route", route)
        span.update_name(f"{method} {route}")
