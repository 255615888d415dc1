"""``inflight gateway``: serve the FastAPI app with uvicorn, and its metrics on a port of their own.

One uvicorn server listens on both ports (one event loop, one graceful shutdown on SIGTERM); requests
are told apart by the local port they arrived on. The metrics port answers ``GET /metrics`` and nothing
else, without a key: the API, the docs and the live page are never reachable through it.
"""

from __future__ import annotations

import signal
import socket
from types import FrameType

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from services.common.process_telemetry import configure_logging, metrics_payload
from services.common.settings import Settings, SettingsError
from services.common.tracing import setup_tracing, shutdown_tracing


def main(settings: Settings, port: int | None = None) -> None:
    from services.gateway.app import create_app
    from services.gateway.edge import require_usable_keys

    try:
        require_usable_keys(settings.api_keys)
    except SettingsError as exc:
        raise SystemExit(f"inflight gateway: {exc}") from None
    api_port = port or settings.gateway_port
    metrics_port = settings.gateway_metrics_port
    if metrics_port == api_port:
        raise SystemExit(f"the API port {api_port} is INFLIGHT_GATEWAY_METRICS_PORT too: pick another")
    configure_logging(settings.log_level)
    # A client's traceparent links its trace; whether a request is traced is this gateway's choice.
    tracing = setup_tracing("inflight-gateway", trust_remote_sampled=settings.trace_trust_client_sampled)
    app: ASGIApp = create_app(settings)
    if metrics_port:
        app = ByLocalPort(app, metrics_app(), metrics_port)
    config = uvicorn.Config(
        app,
        host=settings.bind_host,
        port=api_port,
        log_level="warning",
        # SIGTERM: stop accepting, let open streams finish within the drain timeout.
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
        access_log=False,
    )
    # Bound here, before the app starts: a port in use stops the process with uvicorn's error at once.
    sockets = [_bind(config, metrics_port)] if metrics_port else []
    sockets.append(_bind(config, api_port))  # last, so the config names the API port again
    # uvicorn drains on SIGTERM, then restores the handler it found and raises the signal again: with the
    # default handler the process would die right there, before the spans below are exported.
    signal.signal(signal.SIGTERM, _drained)
    uvicorn.Server(config).run(sockets=sockets)
    shutdown_tracing(tracing)  # export the last requests' spans before the process exits


def metrics_app() -> Starlette:
    """``GET /metrics``: the process's Prometheus registry, the same families the API port serves."""

    async def metrics(_: Request) -> Response:
        body, content_type = metrics_payload()
        return Response(body, media_type=content_type)

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])


class ByLocalPort:
    """Sends HTTP requests that arrived on ``port`` to ``on_port``, everything else (the lifespan, the
    API port's requests) to ``app``. ``scope["server"]`` is the listening socket's own address."""

    def __init__(self, app: ASGIApp, on_port: ASGIApp, port: int) -> None:
        self.app = app
        self.on_port = on_port
        self.port = port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if scope["type"] != "lifespan" and server is not None and server[1] == self.port:
            await self.on_port(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def _drained(signum: int, frame: FrameType | None) -> None:
    """SIGTERM after uvicorn's graceful shutdown: the server has stopped, main() returns."""


def _bind(config: uvicorn.Config, port: int) -> socket.socket:
    # uvicorn's own binding (address family from the host, SO_REUSEADDR, exit on a port in use) for
    # each port of the one config: the host is INFLIGHT_BIND_HOST for both.
    config.port = port
    return config.bind_socket()
