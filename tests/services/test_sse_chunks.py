"""The SSE writer's per-token path, without a stack: a plain text delta's chunk filled into the request's
pre-encoded envelope is byte for byte the chunk built as dicts, and events already buffered come out
before the writer is told to flush (so a backlog is one write)."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from typing import Any

import pytest

from services.common.wire import DeltaEvent, DoneEvent, Kind, encode_event
from services.gateway.openai_routes import _done_error
from services.gateway.responses import ResponseBuilder, sse_data
from services.gateway.sse import TokenStream
from services.gateway.token_streams import FLUSH, Subscription

TEXTS = ["", "a", ' "quoted" \\ back\nslash\t\x00\x1f', "héllo 😀 \u2028\u2029", "\ud800", "</script>"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("model", ["bench", 'we"ird/ü'])
def test_a_plain_delta_is_the_same_bytes_as_the_built_chunk(kind: Kind, model: str) -> None:
    rng = random.Random(7)
    fast = ResponseBuilder(kind, "cmpl-x", model, 123, 2, None)
    built = ResponseBuilder(kind, "cmpl-x", model, 123, 2, None)
    for seq in range(1, 200):
        finish = rng.choice([None, None, None, "stop", "length"])
        ev = DeltaEvent("cmpl-x", seq, rng.randrange(2), [seq], rng.choice(TEXTS), finish_reason=finish)
        assert fast.sse(ev) == sse_data(built.chunk(ev))


@pytest.mark.parametrize("tools", ["forced", "auto"])
def test_tool_calls_and_logprobs_take_the_built_chunk(tools: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("services.gateway.responses.new_call_id", lambda: "call_1")  # both builders alike
    for builder, ref in (
        (
            ResponseBuilder("chat", "c", "m", 1, 1, None, tools=tools),
            ResponseBuilder("chat", "c", "m", 1, 1, None, tools=tools),
        ),
        (
            ResponseBuilder("completion", "c", "m", 1, 1, None, 1),
            ResponseBuilder("completion", "c", "m", 1, 1, None, 1),
        ),
    ):
        for seq, text in enumerate(['<tool_call>{"name":', ' "f", "arguments": {}}', "</tool_call>"], 1):
            ev = DeltaEvent("c", seq, 0, [seq], text, logprobs=[[[seq, -0.5]]])
            assert builder.sse(ev) == sse_data(ref.chunk(ev))


class _Hub:
    buffer_bytes = 1 << 20
    buffered_bytes = 0
    outage_budget_s = 30.0

    def down_for(self) -> float:
        return 0.0


async def test_buffered_events_come_before_a_flush() -> None:
    sub = Subscription(_Hub(), "cmpl-x")  # type: ignore[arg-type]
    for seq in (1, 2, 3):
        sub.deliver(encode_event(DeltaEvent("cmpl-x", seq, 0, [seq], f"t{seq}")))
    stream = sub.events(600.0, flush=True)
    got = [await anext(stream) for _ in range(4)]
    assert [getattr(e, "seq", e) for e in got] == [1, 2, 3, FLUSH]
    sub.deliver(encode_event(DoneEvent("cmpl-x", 4, "completed")))
    assert isinstance(await anext(stream), DoneEvent)


async def test_the_sse_writer_sends_a_backlog_in_one_write() -> None:
    sub = Subscription(_Hub(), "cmpl-x")  # type: ignore[arg-type]
    builder = ResponseBuilder("completion", "cmpl-x", "bench", 1, 1, None)
    settings = SimpleNamespace(request_timeout_s=600.0, sse_keepalive_s=15.0)
    gw: Any = SimpleNamespace(settings=settings, spawn=lambda c: c.close())
    gw.hub = SimpleNamespace(unsubscribe=lambda s: asyncio.sleep(0))
    stream = TokenStream(gw, sub, builder, include_usage=False, cancel_on_exit=False, error_of=_done_error)
    writes = stream._events()
    sub.deliver(encode_event(DeltaEvent("cmpl-x", 1, 0, [1], "a")))
    first = await anext(writes)
    assert first is not None and first.count("data: ") == 1
    for seq in (2, 3, 4):
        sub.deliver(encode_event(DeltaEvent("cmpl-x", seq, 0, [seq], "b")))
    sub.deliver(encode_event(DoneEvent("cmpl-x", 5, "completed")))
    # The three deltas waited together; the done event follows them without a wait in between.
    rest = [w async for w in writes if w is not None]
    assert "".join(rest).count("data: ") == 4
    assert len(rest) == 1 and rest[0].endswith("data: [DONE]\n\n")
