"""One request's stream of delta outputs, for both engine front ends (a thread or a core process).

Each front end keeps a queue per request id, fed with the engine's outputs (or the exception that
killed its loop); this generator registers the queue, adds the request, yields until the last output,
and aborts the request in the engine if the caller leaves early.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from engine.outputs import RequestOutput

Stream = asyncio.Queue[RequestOutput | BaseException]


async def stream_outputs(
    streams: dict[str, Stream],
    request_id: str,
    add: Callable[[], Awaitable[object]],
    abort: Callable[[], None],
    engine_dead: Callable[[], bool],
) -> AsyncIterator[RequestOutput]:
    """``add`` puts the request into the engine (raising what the engine refused); ``abort`` is
    called, without waiting, when the caller stops reading before the request finished."""
    if request_id in streams:
        raise ValueError(f"request id {request_id!r} is already in flight")
    stream: Stream = asyncio.Queue()
    streams[request_id] = stream
    finished = added = False
    try:
        await add()
        added = True
        while True:
            item = await stream.get()
            if isinstance(item, BaseException):
                raise RuntimeError("the engine loop has died") from item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        streams.pop(request_id, None)
        if added and not finished and not engine_dead():
            abort()
