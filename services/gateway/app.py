"""The gateway's FastAPI app: lifespan (Redis, Kafka, tokenizer), middleware, probes, routes."""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.platform.memory import freeze_heap
from services.common.http_tracing import TracingMiddleware, fastapi_native_tracing_off
from services.common.kafka import ensure_topic
from services.common.metrics import service_families
from services.common.process_telemetry import metrics_payload
from services.common.settings import Settings
from services.common.store import REDIS_ERRORS, Store, connect_redis
from services.gateway import errors, jobs_routes, live_routes, openai_routes
from services.gateway.dispatch import Dispatcher
from services.gateway.errors import APIError
from services.gateway.live_feed import LiveFeed
from services.gateway.prompts import load_model_info
from services.gateway.state import Gateway
from services.gateway.token_streams import Hub

log = logging.getLogger(__name__)

RESPONSES = service_families().gateway_responses


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        info = load_model_info(settings)
        client = connect_redis(settings)
        store = Store(client)
        hub = Hub(client, store, settings.instance_id, settings.redis_outage_s, settings.stream_buffer_bytes)
        service_families().gateway_stream_buffered.set_function(lambda: hub.buffered_bytes)
        dispatcher = Dispatcher(settings, store, hub)
        await ensure_topic(settings)
        await hub.start()
        await dispatcher.start()
        app.state.gateway = Gateway(settings, info, store, hub, dispatcher)
        app.state.live_feed = live_feed = LiveFeed(client, settings.max_live_viewers)
        known = "unknown here, the workers check it" if info.max_model_len is None else info.max_model_len
        log.info("gateway serving %s (max_model_len %s)", info.name, known)
        # What is loaded by now (the tokenizer, the app, the libraries) lives as long as the process: out
        # of the collector's sight, the full collections that traffic triggers no longer walk it (one
        # walk of the tokenizer's objects costs tens of milliseconds of CPU).
        freeze_heap()
        try:
            yield
        finally:
            await live_feed.stop()
            await dispatcher.stop()
            await hub.stop()
            await client.aclose()

    app = FastAPI(
        title="inflight",
        version="0.1.0",
        description="Continuous-batching LLM serving: OpenAI-compatible API and async jobs.",
        lifespan=lifespan,
        # Served below, behind the key guard like the API they describe.
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        **fastapi_native_tracing_off(),
    )
    errors.install(app)

    async def require_key(request: Request) -> None:
        if not settings.api_keys:
            return
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not any(hmac.compare_digest(token.encode(), key.encode()) for key in settings.api_keys):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        # Jobs belong to the key that created them: records store a digest of it, never the key.
        request.state.key_owner = hashlib.sha256(token.encode()).hexdigest()[:32]

    guarded = [Depends(require_key)]
    app.include_router(openai_routes.router, dependencies=guarded)
    app.include_router(jobs_routes.router, dependencies=guarded)
    app.include_router(live_routes.router, dependencies=guarded)
    app.include_router(live_routes.page_router)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    async def readyz(request: Request) -> JSONResponse:
        gw: Gateway = request.app.state.gateway
        try:
            redis_ok = bool(await gw.store.client.ping())
        except REDIS_ERRORS:
            redis_ok = False
        kafka_ok = await gw.dispatcher.kafka_ready()
        ready = redis_ok and kafka_ok
        return JSONResponse(
            {"ready": ready, "redis": redis_ok, "kafka": kafka_ok}, status_code=200 if ready else 503
        )

    # With keys set, metrics and the API's description need a key too (probes stay open: the kubelet has
    # none). Metrics tell request volumes, queue depths and model names to whoever asks, and this port is
    # the one exposed to clients. Scrapers inside the cluster read the same payload without a key on
    # INFLIGHT_GATEWAY_METRICS_PORT (services/gateway/main.py), which only they are admitted to.
    @app.get("/metrics", include_in_schema=False, dependencies=guarded)
    async def metrics() -> Response:
        body, content_type = metrics_payload()
        return Response(body, media_type=content_type)

    @app.get("/openapi.json", include_in_schema=False, dependencies=guarded)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=guarded)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="inflight API")

    @app.get("/redoc", include_in_schema=False, dependencies=guarded)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title="inflight API")

    app.add_middleware(_Limits, max_body_bytes=settings.max_body_bytes)
    # Outermost (added last): the server span also covers requests the limits refuse.
    app.add_middleware(TracingMiddleware)
    service_families()  # registered now: a scrape shows the counters at 0 before anything happens
    return app


class _Limits:
    """413 for bodies over the limit (declared or streamed), and a response counter by route.

    The body is read here, up to the limit, before the app sees it: the app's own body parsing would
    turn any error raised mid-read into a 400.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = _route_label(scope["path"])
        too_large = APIError(
            413, f"the request body exceeds {self.max_body_bytes} bytes", code="request_too_large"
        )
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            RESPONSES.labels(route, "413").inc()
            await JSONResponse(too_large.body(), status_code=413)(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                RESPONSES.labels(route, "413").inc()
                await JSONResponse(too_large.body(), status_code=413)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later reads wait for the disconnect, as the app expects

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                RESPONSES.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, replay, counting_send)


def _route_label(path: str) -> str:
    # Job ids would make one time series per job.
    if path.startswith("/v1/jobs/"):
        return "/v1/jobs/{id}/events" if path.endswith("/events") else "/v1/jobs/{id}"
    return path if path.startswith("/v1/") else "other"
