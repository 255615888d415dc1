"""The SSE writer (services/gateway/sse.py) as an ASGI response, without a stack: what it writes around
idle spells, and its clean-up whenever the client leaves. The clock is the test's; the stream's events are
a script. (Through uvicorn and a real stack: test_sse_edges.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, MutableMapping
from types import SimpleNamespace
from typing import Any

import pytest

from services.common.wire import DeltaEvent, DoneEvent
from services.gateway import sse
from services.gateway.openai_routes import _done_error
from services.gateway.responses import ResponseBuilder
from services.gateway.token_streams import FLUSH


class _Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


class _Sub:
    """A subscription that plays ``script``: events, FLUSH, None (an idle tick), or a number of seconds
    for the clock to move; then waits forever (a stream still open)."""

    def __init__(self, script: list[Any], clock: _Clock) -> None:
        self.script = script
        self.clock = clock
        self.request_id = "cmpl-x"
        self.on_overflow: Any = None

    async def events(self, idle_timeout_s: float, *, flush: bool = False) -> AsyncIterator[Any]:
        for item in self.script:
            if isinstance(item, float):
                self.clock.now += item
                continue
            yield item
        await asyncio.Event().wait()


def _gateway(keepalive_s: float, spawned: list[str]) -> Any:
    def spawn(coro: Any) -> None:
        spawned.append(coro.cr_code.co_name)
        coro.close()

    async def unsubscribe(_: Any) -> None: ...
    async def cancel(_: str) -> str:
        return "cancelled"

    settings = SimpleNamespace(request_timeout_s=600.0, sse_keepalive_s=keepalive_s)
    return SimpleNamespace(
        settings=settings,
        spawn=spawn,
        hub=SimpleNamespace(unsubscribe=unsubscribe),
        dispatcher=SimpleNamespace(cancel=cancel),
    )


async def _run(
    script: list[Any], *, keepalive_s: float = 15.0, leave_after_s: float | None = None
) -> tuple[list[bytes], list[str], bool]:
    """The bodies written, what the clean-up spawned, and whether the response returned by itself."""
    clock = _Clock()
    spawned: list[str] = []
    sent: list[MutableMapping[str, Any]] = []
    builder = ResponseBuilder("completion", "cmpl-x", "m", 1, 1, None)
    stream = sse.TokenStream(
        _gateway(keepalive_s, spawned),
        _Sub(script, clock),  # type: ignore[arg-type]
        builder,
        include_usage=False,
        cancel_on_exit=True,
        error_of=_done_error,
    )
    left = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await left.wait()  # never set when the script ends the stream itself
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sse, "monotonic", clock)
        call = asyncio.ensure_future(stream({"type": "http"}, receive, send))
        if leave_after_s is None:
            await asyncio.wait_for(call, 5)  # the script ends the stream
        else:
            for _ in range(100):  # let the script play up to its wait
                await asyncio.sleep(0)
            left.set()
            await asyncio.wait_for(call, 5)
        finished = leave_after_s is None
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = [m["body"] for m in sent[1:] if m["body"]]
    return bodies, spawned, finished


def _delta(seq: int) -> DeltaEvent:
    return DeltaEvent("cmpl-x", seq, 0, [seq], f"t{seq}")


async def test_no_comment_before_the_first_data_event_and_one_only_after_the_idle_bound() -> None:
    done = DoneEvent("cmpl-x", 3, "completed")
    script = [None, 20.0, None, 20.0, None, _delta(1), FLUSH, 5.0, None, 11.0, None, _delta(2), FLUSH, done]
    bodies, spawned, finished = await _run(script)
    assert finished and spawned == ["unsubscribe"]  # a finished stream cancels nothing
    assert [b.startswith(b"data: ") for b in bodies] == [True, False, True, True]
    assert bodies[1] == sse.KEEPALIVE  # 16 s after the first write, not 5 s after it
    assert bodies[-1].endswith(b"data: [DONE]\n\n")


async def test_keepalive_zero_writes_none() -> None:
    done = DoneEvent("cmpl-x", 2, "completed")
    bodies, _, _ = await _run([_delta(1), FLUSH, 60.0, None, 60.0, None, done], keepalive_s=0.0)
    assert sse.KEEPALIVE not in bodies and len(bodies) == 2


@pytest.mark.parametrize(
    "script", [[], [None, 30.0, None], [_delta(1), FLUSH]], ids=["pending", "queued", "running"]
)
async def test_a_client_that_leaves_is_released_and_its_request_cancelled(script: list[Any]) -> None:
    """Already gone when the response starts (its first receive says so), gone while queued, or gone
    after the first token: the same clean-up, from the response itself."""
    _, spawned, _ = await _run(script, leave_after_s=0.0)
    assert spawned == ["unsubscribe", "cancel"]
