"""The gateway's ASGI edge, outermost first: count every response, check the API key, bound the body.

    Counted -> KeyGuard -> BodyLimit -> the FastAPI app

Each layer costs a client only what it has earned: a request without a valid key is answered 401 from
its headers alone (its body is never read, however large it says it is), and only an authenticated one
has its body read, up to the size limit, before the app parses it.

The response counter is labelled with the route's template ("/v1/jobs/{job_id}"), never the raw path,
and with "other" for a path no route matches: a client sending random paths cannot add series.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.metrics import service_families
from services.common.settings import SettingsError
from services.gateway.errors import APIError

UNMATCHED = "other"
# Open without a key: the probes (the kubelet has none) and the live page's HTML and assets (they carry
# no data; the feed and the API they call keep the guard).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/"})
OPEN_PREFIXES = ("/static/",)


def route_label(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """The template of the route that matched (or would match) this request, else ``UNMATCHED``.

    The router records the route it picked in the scope; a request answered before routing (refused
    by a layer above) is matched here against the same routes. A path that matches in all but its
    method (a 405) keeps its template: the set of templates is fixed either way.
    """
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    for candidate in routes:
        match, _ = candidate.matches(scope)
        if match is not Match.NONE:
            return str(candidate.path)  # type: ignore[attr-defined]
    return UNMATCHED


def leaf_routes(routes: Sequence[BaseRoute]) -> list[BaseRoute]:
    """The routes that have a template, out of included routers too (the gateway includes its routers
    without a prefix, so a leaf's own template is the path it serves)."""
    out: list[BaseRoute] = []
    for route in routes:
        if isinstance(getattr(route, "path", None), str):
            out.append(route)
            continue
        inner = getattr(getattr(route, "original_router", None), "routes", None)
        if inner is None:
            inner = getattr(route, "routes", None)
        if inner:
            out.extend(leaf_routes(inner))
    return out


class Counted:
    """``inflight:gateway_responses_total{route, status}`` for every HTTP response."""

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        # The app's list, read when the first request comes: every route has been added by then.
        self._all_routes = routes
        self._leaves: list[BaseRoute] | None = None
        self.counter = service_families().gateway_responses

    @property
    def routes(self) -> list[BaseRoute]:
        if self._leaves is None:
            self._leaves = leaf_routes(self._all_routes)
        return self._leaves

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(route_label(self.routes, scope), str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def require_usable_keys(api_keys: tuple[str, ...] | None) -> None:
    """Keys unset: an open gateway, on purpose (development). Keys set but none in them (an empty or
    blank value: a Secret that lost its content): refuse to start rather than run open."""
    if api_keys is not None and not api_keys:
        raise SettingsError(
            "INFLIGHT_API_KEYS is set but holds no key (empty, blank or only commas): refusing to start "
            "a gateway that would accept every request. Set one or more keys, or unset the variable to "
            "run without authentication on purpose."
        )


def key_owner(token: str) -> str:
    """Who owns a job: a digest of the API key that created it (records never hold the key)."""
    return hashlib.sha256(token.encode()).hexdigest()[:32]


class KeyGuard:
    """``Authorization: Bearer KEY`` checked on the headers, before anything reads the body.

    With keys configured, every path but the open ones needs one of them; the owner digest of the key
    goes into the request's state (``request.state.key_owner``) for the routes. Without keys nothing is
    checked and every request shares the owner "".
    """

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...] | None) -> None:
        self.app = app
        self.keys = [key.encode() for key in api_keys] if api_keys is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.keys is None:
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        token = _bearer(scope)
        # Every key is compared, matched or not: the time taken says nothing about which one was close.
        matched = [hmac.compare_digest(token, key) for key in self.keys]
        if not any(matched):
            refused = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
            await JSONResponse(refused.body(), status_code=401)(scope, receive, send)
            return
        scope.setdefault("state", {})["key_owner"] = key_owner(token.decode("latin-1"))
        await self.app(scope, receive, send)


def _bearer(scope: Scope) -> bytes:
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            return value[7:] if value[:7].lower() == b"bearer " else b""
    return b""


class BodyLimit:
    """413 for bodies over the limit (declared or streamed).

    The body is read here, up to the limit, before the app sees it: the app's own body parsing would
    turn any error raised mid-read into a 400. What the app then parses (FastAPI decodes and validates
    the body on the event loop) is bounded by the limit, and only a client with a key gets that far; at
    the 4 MiB default a body of tens of thousands of tiny chat messages still costs the loop a fraction
    of a second to a second (measured on a busy 2-core host), which only a lower limit bounds further.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = APIError(
            413, f"the request body exceeds {self.max_body_bytes} bytes", code="request_too_large"
        )
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
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

        await self.app(scope, replay, send)
