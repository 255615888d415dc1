"""The live page: ``/`` (plain HTML and JS from package data, no build step) and its feed.

GET /                   the page: a chat box that streams, and a live view of the engines
GET /static/{name}      its script and stylesheet
GET /v1/live/events     SSE: every worker's ``LiveSteps`` messages (see services/common/live_wire.py) as they
                        are published, relayed from the gateway's one Redis subscription (live_feed.py);
                        a comment line every few seconds keeps proxies from closing an idle stream.
                        429 past ``INFLIGHT_MAX_LIVE_VIEWERS`` viewers on this gateway.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from services.gateway.errors import APIError
from services.gateway.live_feed import LiveFeed
from services.gateway.responses import sse_data
from services.gateway.sse import SSE_HEADERS

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


def _too_many(feed: LiveFeed) -> APIError:
    message = f"the live view has its {feed.max_viewers} viewers on this gateway; retry shortly"
    return APIError(429, message, code="rate_limit_exceeded", headers={"Retry-After": "5"})


@router.get("/v1/live/events", include_in_schema=False, response_model=None)
async def live_events(request: Request) -> StreamingResponse:
    feed: LiveFeed = request.app.state.live_feed
    if feed.full:
        raise _too_many(feed)

    async def relay() -> AsyncIterator[str]:
        # Joined here, not in the route: a generator that never starts (its client left at once) would
        # never run a ``finally`` to leave again.
        viewer = feed.join()
        if viewer is None:  # others joined since the check above
            yield sse_data(_too_many(feed).body())
            return
        try:
            yield ": live\n\n"  # the headers and a first byte now: the page knows it is connected
            while True:
                try:
                    data = await asyncio.wait_for(viewer.queue.get(), _KEEPALIVE_S)
                except TimeoutError:
                    yield ": keepalive\n\n"  # also how a gone client is noticed while nothing happens
                    continue
                yield f"data: {data}\n\n"
        finally:
            feed.leave(viewer)

    return StreamingResponse(relay(), media_type="text/event-stream", headers=SSE_HEADERS)
