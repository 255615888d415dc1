"""The worker's own small HTTP server: probes, metrics, and a JSON view of its state."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.common.process_telemetry import metrics_payload
from services.worker.worker import Worker


class Probes:
    """What the probes have answered. After a stall the worker exits once a readiness probe has seen it
    not ready with its engine dead, so the probe records why (a process that is gone reads as refused)."""

    def __init__(self) -> None:
        self.saw_dead_engine = asyncio.Event()


def create_app(worker: Worker, probes: Probes | None = None) -> Starlette:
    async def healthz(_: Request) -> Response:
        dead = getattr(worker.engine, "dead_error", None)
        if dead is not None and worker.handed_over.is_set():
            return JSONResponse({"status": "engine loop died", "error": str(dead)}, status_code=500)
        if dead is not None:
            # Still handing back: counting the death against its requests (poison.py), committing and
            # leaving the group (bounded, worker.py). A restart now would lose the count, and the request
            # that killed the engine would resume elsewhere as if nothing had happened.
            return JSONResponse({"status": "engine loop died, handing back", "error": str(dead)})
        return JSONResponse({"status": "ok"})

    async def readyz(_: Request) -> Response:
        # A dead engine fails whatever it is given: not ready (it has also left the consumer group).
        alive = worker.engine.dead_error is None
        ready = worker.started and alive and not worker.draining and worker.publisher.healthy
        ready = ready and not worker.problems()  # a background task down (supervise.py)
        if not alive and probes is not None:
            probes.saw_dead_engine.set()
        return JSONResponse({"ready": ready, **worker.stats()}, status_code=200 if ready else 503)

    async def metrics(_: Request) -> Response:
        body, content_type = metrics_payload()
        return Response(body, media_type=content_type)

    async def stats(_: Request) -> Response:
        return JSONResponse(worker.stats())

    routes = [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics),
        Route("/stats", stats),
    ]
    return Starlette(routes=routes)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the worker drains on SIGTERM itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_port(host: str, port: int) -> socket.socket:
    """The worker's HTTP socket, bound before anything else starts: a port in use stops the worker at once
    with uvicorn's error, before a model loads and an engine core starts that a failed start would have
    to stop."""
    return uvicorn.Config("services.worker.http:create_app", host=host, port=port).bind_socket()


def make_server(worker: Worker, host: str, port: int, probes: Probes | None = None) -> uvicorn.Server:
    app = create_app(worker, probes)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
    return _Server(config)
