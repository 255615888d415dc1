"""One token stream as server-sent events: an ASGI response that owns the stream's subscription.

What strict clients need, and what a vanished client must not leave behind:

- Nothing but data events until the first one. A comment (``: keep-alive``) is valid SSE, but readers
  that strip each network chunk before splitting on blank lines (vLLM's benchmark client among them)
  glue it to the next event and lose every event after it. The headers go out at once (the client
  knows it was admitted); the body starts with the first data event, however long the request queues.
- Comments only after ``keepalive_s`` without a write, once data has flowed (0: never): enough for a
  proxy with an idle timeout, rare enough that no stream of a working engine carries one.
- A client that leaves is noticed from the server's ``http.disconnect`` (``receive()``), at once, not
  from a write that fails: a queued stream writes nothing for a long while.
- The clean-up (the subscription, its buffer, the hub's entry, and the cancel of a request nobody reads)
  runs in this response's own ``finally``, not in a generator's: a client already gone when the route
  returns still gets the response called, and the ``finally`` runs whether a byte was written or not.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from time import monotonic
from typing import TYPE_CHECKING

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from services.common.wire import CANCELLED, COMPLETED, DeltaEvent, DoneEvent
from services.gateway import fanout
from services.gateway.errors import APIError, error_body
from services.gateway.responses import ResponseBuilder, sse_data
from services.gateway.token_streams import FLUSH, StreamError, Subscription

if TYPE_CHECKING:
    from services.gateway.state import Gateway

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = b": keep-alive\n\n"


class TokenStream(Response):
    """``StreamingResponse``'s place for one request's token events (see the module docstring).

    ``error_of`` turns a DoneEvent that did not complete into the API error its stream ends with;
    ``cancel_on_exit``: the stream owns its request (a completion route's), so a client that leaves
    before the end cancels it; a job's follower does not.
    """

    def __init__(
        self,
        gw: Gateway,
        subs: Subscription | list[Subscription],  # several: a batched prompt (services/gateway/fanout.py)
        builder: ResponseBuilder,
        *,
        include_usage: bool,
        cancel_on_exit: bool,
        error_of: Callable[[DoneEvent], APIError],
        headers: Mapping[str, str] = SSE_HEADERS,
        n: int = 1,  # choices per prompt
    ) -> None:
        self.gw = gw
        self.subs = subs if isinstance(subs, list) else [subs]
        self.n = n
        self.builder = builder
        self.include_usage = include_usage
        self.cancel_on_exit = cancel_on_exit
        self.error_of = error_of
        self.keepalive_s = gw.settings.sse_keepalive_s
        self.finished = False  # the DoneEvent was read: the request needs no cancel
        # What FastAPI and Starlette expect of a Response (no body of its own, no background task).
        self.status_code = 200
        self.background = None
        self.media_type = "text/event-stream"
        self.init_headers(headers)
        if cancel_on_exit:
            # At once: the writer may be stuck on a client that stopped reading; nobody gets these tokens.
            for each in self.subs:
                each.on_overflow = self._cancel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await send(start)
            writer = asyncio.ensure_future(self._write(send))
            watcher = asyncio.ensure_future(_disconnected(receive))
            try:
                await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                writer.cancel()
                watcher.cancel()
                await asyncio.gather(writer, watcher, return_exceptions=True)
            failed = None if writer.cancelled() else writer.exception()
            if failed is not None and not isinstance(failed, OSError):  # OSError: the client is gone
                raise failed
        finally:
            # Never awaited here: this runs also when the response task itself is cancelled.
            for each in self.subs:
                self.gw.spawn(self.gw.hub.unsubscribe(each))
            if self.cancel_on_exit and not self.finished:
                self._cancel()

    def _cancel(self) -> None:
        for each in self.subs:
            self.gw.spawn(self.gw.dispatcher.cancel(each.request_id))

    async def _write(self, send: Send) -> None:
        last_write: float | None = None  # None until the first data event went out

        async def write(text: str | bytes) -> None:
            nonlocal last_write
            body = text.encode() if isinstance(text, str) else text
            await send({"type": "http.response.body", "body": body, "more_body": True})
            last_write = monotonic()

        async for text in self._events():
            if text is None:
                # Idle (a tick every few seconds while nothing arrives): never before the first data.
                due = last_write is not None and monotonic() - last_write >= self.keepalive_s
                if self.keepalive_s > 0 and due:
                    await write(KEEPALIVE)
                continue
            await write(text)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _events(self) -> AsyncIterator[str | None]:
        """The stream's writes: text to send, or None where it has been idle a while (a keep-alive may
        go out). Chunks of events that arrived together (a backlog, a page of the log) are one write:
        the same bytes, fewer trips through the ASGI stack and fewer socket writes."""
        parts: list[str] = []
        builder = self.builder
        try:
            async for event in fanout.events(
                self.subs, self.n, self.gw.settings.request_timeout_s, flush=True
            ):
                if isinstance(event, DeltaEvent):
                    parts.append(builder.sse(event))
                elif event is FLUSH:
                    if parts:
                        yield "".join(parts)
                        parts.clear()
                elif event is None:
                    yield None
                elif isinstance(event, DoneEvent):
                    self.finished = True
                    if event.status == COMPLETED or event.status == CANCELLED:
                        if self.include_usage:
                            parts.append(sse_data(builder.usage_chunk(event)))
                        parts.append("data: [DONE]\n\n")
                    else:
                        parts.append(sse_data(self.error_of(event).body()))
                    yield "".join(parts)
                    return
        except StreamError as exc:
            # Not finished: the request itself runs on, for nobody, unless the clean-up cancels it.
            parts.append(sse_data(error_body(503, f"the stream was interrupted: {exc}", code=exc.code)))
            yield "".join(parts)


async def _disconnected(receive: Receive) -> None:
    """Returns once the server says the client has gone (the request body was read before)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
