"""The gateway's FastAPI app: lifespan (Redis, Kafka, tokenizer), middleware, probes, routes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response

from engine.platform.memory import freeze_heap
from services.common.consumers import num_consuming
from services.common.http_tracing import TracingMiddleware, fastapi_native_tracing_off
from services.common.kafka import ensure_topic
from services.common.metrics import service_families
from services.common.process_telemetry import metrics_payload
from services.common.settings import Settings
from services.common.store import REDIS_ERRORS, Store, connect_redis
from services.gateway import (
    batches_routes,
    errors,
    files_routes,
    jobs_routes,
    live_routes,
    openai_routes,
    tokenize_routes,
)
from services.gateway.background import Supervisor
from services.gateway.dispatch import Dispatcher
from services.gateway.edge import Counted, KeyGuard, require_usable_keys
from services.gateway.live_feed import LiveFeed
from services.gateway.prompts import load_model_info
from services.gateway.state import Gateway
from services.gateway.token_streams import Hub
from services.gateway.uploads import BodyLimitButUploads

log = logging.getLogger(__name__)

_SHUTDOWN_STEP_S = 5.0  # each step of the shutdown after the drain (see lifespan)


def create_app(settings: Settings) -> FastAPI:
    require_usable_keys(settings.api_keys)  # before anything starts: empty keys never serve openly

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        info = load_model_info(settings)
        client = connect_redis(settings)
        store = Store(client)
        # The gateway's loops (token hub, queue watch, heartbeat, live feed): restarted when they fail or
        # return, reported by /readyz meanwhile (background.py).
        supervisor = Supervisor()
        hub = Hub(
            client,
            store,
            settings.instance_id,
            settings.redis_outage_s,
            settings.stream_buffer_bytes,
            supervisor,
        )
        service_families().gateway_stream_buffered.set_function(lambda: hub.buffered_bytes)
        service_families().gateway_streams.set_function(lambda: hub.num_streams)
        dispatcher = Dispatcher(settings, store, hub, supervisor)
        budgets = dispatcher.budgets
        service_families().gateway_queued_bytes.set_function(lambda: budgets.queued_bytes)
        service_families().gateway_requests_in_flight.set_function(lambda: budgets.num_in_flight)
        await ensure_topic(settings)
        await hub.start()
        await dispatcher.start()
        app.state.gateway = Gateway(settings, info, store, hub, dispatcher)
        app.state.live_feed = live_feed = LiveFeed(client, settings.max_live_viewers, supervisor)
        app.state.supervisor = supervisor
        known = "unknown here, the workers check it" if info.max_model_len is None else info.max_model_len
        log.info("gateway serving %s (max_model_len %s)", info.name, known)
        # What is loaded by now (the tokenizer, the app, the libraries) lives as long as the process: out
        # of the collector's sight, the full collections that traffic triggers no longer walk it (one
        # walk of the tokenizer's objects costs tens of milliseconds of CPU).
        freeze_heap()
        try:
            yield
        finally:
            # Each step bounded: a broker or Redis that stops answering must not keep the process past
            # its drain (its orchestrator would SIGKILL it anyway, after the whole grace period).
            for name, step in (
                ("the live feed", live_feed.stop()),
                ("the dispatcher", dispatcher.stop()),
                ("the token hub", hub.stop()),
                ("the Redis client", client.aclose()),
            ):
                try:
                    await asyncio.wait_for(step, _SHUTDOWN_STEP_S)
                except TimeoutError:
                    log.warning("shutdown: stopping %s took over %.0fs: not waiting", name, _SHUTDOWN_STEP_S)

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

    # Every route but the probes and the live page's assets needs a key when keys are set: KeyGuard
    # (edge.py) checks it on the headers, before the body is read.
    app.include_router(openai_routes.router)
    app.include_router(jobs_routes.router)
    app.include_router(tokenize_routes.router)
    app.include_router(files_routes.router)
    app.include_router(batches_routes.router)
    app.include_router(live_routes.router)
    app.include_router(live_routes.page_router)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    async def readyz(request: Request) -> JSONResponse:
        """200 while this gateway can admit requests: Redis and the broker answer and its background
        loops run ("tasks" lists those down or just restarted). "workers" counts the workers consuming its
        topic now; it does not change the status: with none, requests wait in Kafka for one (a gateway
        taken out of its load balancer whenever workers restart would turn a queue into refusals). A
        script that must not send before an engine is there waits for "workers" > 0 as well."""
        gw: Gateway = request.app.state.gateway
        supervisor: Supervisor = request.app.state.supervisor
        workers: int | None
        try:
            redis_ok = bool(await gw.store.client.ping())
            workers = await num_consuming(gw.store.client, gw.settings.kafka_topic)
        except REDIS_ERRORS:
            redis_ok, workers = False, None
        kafka_ok = await gw.dispatcher.kafka_ready()
        problems = supervisor.problems()
        ready = redis_ok and kafka_ok and not problems
        body = {"ready": ready, "redis": redis_ok, "kafka": kafka_ok, "workers": workers, "tasks": problems}
        return JSONResponse(body, status_code=200 if ready else 503)

    # With keys set, metrics and the API's description need a key too (probes stay open: the kubelet has
    # none). Metrics tell request volumes, queue depths and model names to whoever asks, and this port is
    # the one exposed to clients. Scrapers inside the cluster read the same payload without a key on
    # INFLIGHT_GATEWAY_METRICS_PORT (services/gateway/main.py), which only they are admitted to.
    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        body, content_type = metrics_payload()
        return Response(body, media_type=content_type)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="inflight API")

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title="inflight API")

    # Added innermost first: the server span covers everything, the counter every response, and the key
    # is checked before the body is read. Uploads (POST /v1/files) stream under bounds of their own.
    app.add_middleware(BodyLimitButUploads, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(KeyGuard, api_keys=settings.api_keys)
    app.add_middleware(Counted, routes=app.routes)
    app.add_middleware(TracingMiddleware)
    service_families()  # registered now: a scrape shows the counters at 0 before anything happens
    return app
