"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, as the official client expects them."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.common.wire import CANCELLED, COMPLETED, DeltaEvent, DoneEvent, Kind
from services.gateway import fanout
from services.gateway.deadlines import start_within
from services.gateway.errors import APIError, error_body
from services.gateway.prompts import (
    ModelInfo,
    Prepared,
    prepare_chat,
    prepare_completion,
    split_prompts,
)
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from services.gateway.responses import ResponseBuilder
from services.gateway.sse import TokenStream
from services.gateway.state import Gateway, gateway, owner_of
from services.gateway.token_streams import StreamError, Subscription
from services.gateway.tools import tool_mode

log = logging.getLogger(__name__)
router = APIRouter()
T = TypeVar("T")

# Bodies up to this size are prepared on the event loop: tokenizing or rendering a chat template of a
# couple of kilobytes takes well under a millisecond, less than the hop to a worker thread and back
# costs. Larger ones (a body of megabytes takes seconds) go to a thread, where probes and streams do
# not wait on them.
INLINE_PREPARE_BYTES = 2048
# Likewise a whole response of up to this many tokens without logprobs is encoded on the loop.
INLINE_RENDER_TOKENS = 512


def check_model(gw: Gateway, model: str) -> None:
    if model not in (gw.info.name, gw.settings.model):
        raise APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(gateway(request))]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> dict[str, Any]:
    gw = gateway(request)
    check_model(gw, model)
    return _model_card(gw)


def _model_card(gw: Gateway) -> dict[str, Any]:
    return {
        "id": gw.info.name,
        "object": "model",
        "created": 0,
        "owned_by": "inflight",
        "max_model_len": gw.info.max_model_len,
    }


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    gw = gateway(request)
    check_model(gw, body.model)
    prepared = [await prepare(request, prepare_completion, one, gw.info) for one in split_prompts(body)]
    echo = [p.echo or "" for p in prepared] if body.echo else None
    return await _serve(gw, request, "completion", body, prepared, body.logprobs, echo)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    gw = gateway(request)
    check_model(gw, body.model)
    prepared = await prepare(request, prepare_chat, body, gw.info)
    return await _serve(gw, request, "chat", body, [prepared], prepared.params.logprobs)


async def prepare(
    request: Request, fn: Callable[[T, ModelInfo], Prepared], body: T, info: ModelInfo
) -> Prepared:
    """``fn(body, info)``: on the event loop for a small body, else off it (INLINE_PREPARE_BYTES)."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) <= INLINE_PREPARE_BYTES:
        return fn(body, info)
    return await asyncio.to_thread(fn, body, info)


async def _serve(
    gw: Gateway,
    request: Request,
    kind: Kind,
    body: _Sampling,
    prepared: list[Prepared],
    logprobs: int | None,
    echo: list[str] | None = None,
) -> Any:
    """One engine request per prompt (a batched ``prompt`` has several), answered as one (fanout.py)."""
    within_s = start_within(request, gw.settings.max_queue_wait_s)
    subs: list[Subscription] = []
    try:
        for one in prepared:
            msg, sub = await gw.enqueue(
                kind,
                one,
                job=False,
                subscribe=True,
                stream=bool(body.stream),
                start_within_s=within_s,
                owner=owner_of(request),
            )
            assert sub is not None
            subs.append(sub)
    except BaseException:
        for sub in subs:  # the prompts already queued: nobody will read them
            gw.spawn(gw.hub.unsubscribe(sub))
            gw.spawn(gw.dispatcher.cancel(sub.request_id))
        raise
    tools = tool_mode(
        getattr(body, "tools", None), getattr(body, "tool_choice", None), prepared[0].tool_calls
    )
    builder = ResponseBuilder(
        kind,
        msg.id,
        msg.model,
        int(msg.created),
        body.n * len(subs),
        gw.info.tokenizer,
        logprobs,
        tools,
        echo,
        prepared[0].tool_parser,
        prepared[0].parallel_tool_calls,
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return TokenStream(
            gw,
            subs,
            builder,
            include_usage=include_usage,
            cancel_on_exit=True,
            error_of=_done_error,
            n=body.n,
        )
    try:
        done = await _until_disconnect(request, _collect(gw, subs, builder, body.n))
    except _ClientGone:
        for sub in subs:
            gw.spawn(gw.dispatcher.cancel(sub.request_id))
        return JSONResponse(error_body(499, "client closed the request"), status_code=499)
    finally:
        for sub in subs:
            await gw.hub.unsubscribe(sub)
    if done.status != COMPLETED:
        raise _done_error(done)
    if builder.logprobs is None and done.completion_tokens <= INLINE_RENDER_TOKENS:
        payload = _render(builder, done)
    else:
        # n x tokens x top logprobs can be a large body: build and serialize it off the event loop.
        payload = await asyncio.to_thread(_render, builder, done)
    return Response(payload, media_type="application/json")


def _render(builder: ResponseBuilder, done: DoneEvent) -> bytes:
    body = builder.response(done)
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


async def _collect(gw: Gateway, subs: list[Subscription], builder: ResponseBuilder, n: int) -> DoneEvent:
    try:
        async for event in fanout.events(subs, n, gw.settings.request_timeout_s):
            if isinstance(event, DeltaEvent):
                builder.add(event)
            elif isinstance(event, DoneEvent):
                return event
    except StreamError as exc:
        for sub in subs:
            gw.spawn(gw.dispatcher.cancel(sub.request_id))
        raise APIError(503, f"the request did not complete: {exc}", code=exc.code) from None
    raise APIError(500, "the token stream ended without a result", code="stream_ended")


def _done_error(done: DoneEvent) -> APIError:
    if done.status == CANCELLED:
        return APIError(409, "the request was cancelled", code="cancelled")
    if done.code == "invalid_request":
        return APIError(400, done.error or "invalid request", code="invalid_value", param=done.param)
    if done.code == "output_too_large":  # its token log passed INFLIGHT_MAX_LOG_BYTES: ask for less
        return APIError(400, done.error or "the output is too large", code="output_too_large")
    if done.code == "timeout":  # no engine started it by its deadline (deadlines.py)
        return APIError(504, done.error or "the request timed out waiting for an engine", code="timeout")
    # slo_ttft_unmet: the engine's slo policy dropped it because its deadline could no longer be met,
    # which is overload, not a fault: retryable, like a broker that lost it.
    status = 503 if done.code in ("lost_by_broker", "store_unavailable", "slo_ttft_unmet") else 500
    return APIError(status, done.error or "the request failed", code=done.code)


class _ClientGone(Exception):
    pass


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first (then cancel it and raise _ClientGone)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    raise _ClientGone
