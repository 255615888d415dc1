"""The live page: ``/`` (plain HTML and JS from package data, no build step) and its feed.

GET /                   the page: a chat box that streams, and a live view of the engines
GET /static/{name}      its script and stylesheet
GET /v1/live/events     SSE: every worker's ``LiveSteps`` messages (see services/common/live.py) as they
                        are published, relayed from Redis pub/sub; a comment line every few seconds
                        keeps proxies from closing an idle stream
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from redis.asyncio.client import PubSub

from services.common.live import LIVE_CHANNEL, LiveSteps
from services.gateway.errors import APIError
from services.gateway.openai_routes import SSE_HEADERS
from services.gateway.state import gateway

log = logging.getLogger(__name__)

_STATIC = {"live.js": "text/javascript", "live.css": "text/css"}
_KEEPALIVE_S = 5.0

# The page itself carries no data: it is public; its feed and the API it calls keep the API key guard.
page_router = APIRouter(include_in_schema=False)
router = APIRouter()


def _asset(name: str) -> str:
    return resources.files("services.gateway").joinpath("static", name).read_text(encoding="utf-8")


@page_router.get("/")
async def live_page() -> HTMLResponse:
    return HTMLResponse(_asset("index.html"), headers={"Cache-Control": "no-cache"})


@page_router.get("/static/{name}")
async def live_asset(name: str) -> Response:
    if name not in _STATIC:
        raise APIError(404, f"no static file {name!r}", code="not_found")
    return Response(_asset(name), media_type=_STATIC[name], headers={"Cache-Control": "no-cache"})


@router.get("/v1/live/events", include_in_schema=False, response_model=None)
async def live_events(request: Request) -> StreamingResponse:
    gw = gateway(request)
    pubsub = gw.store.client.pubsub()
    await pubsub.subscribe(LIVE_CHANNEL)

    async def relay() -> AsyncIterator[str]:
        try:
            yield ": live\n\n"  # the headers and a first byte now: the page knows it is connected
            idle = 0.0
            while not await request.is_disconnected():
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is None:
                    idle += 1.0
                    if idle >= _KEEPALIVE_S:
                        idle = 0.0
                        yield ": keepalive\n\n"
                    continue
                try:
                    data = message["data"]
                    LiveSteps.decode(data)  # a message from a newer or older worker is dropped, loudly
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("dropping a live message: %s", exc)
                    continue
                idle = 0.0
                yield f"data: {data.decode() if isinstance(data, bytes) else data}\n\n"
        finally:
            # The client went away (or the server stops): leave the channel without blocking on Redis.
            await asyncio.shield(_close(pubsub))

    return StreamingResponse(relay(), media_type="text/event-stream", headers=SSE_HEADERS)


async def _close(pubsub: PubSub) -> None:
    try:
        await pubsub.unsubscribe()
        await pubsub.aclose()
    except Exception as exc:  # best effort: a dead Redis connection is closed by the pool anyway
        log.debug("closing the live subscription: %r", exc)
