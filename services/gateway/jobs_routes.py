"""Async jobs: submit without holding a connection, poll, follow the tokens, cancel.

POST   /v1/jobs              202, {"id", "status": "queued", ...}, Location: /v1/jobs/{id}
GET    /v1/jobs/{id}         status, result (the OpenAI response), usage, error, timings
GET    /v1/jobs/{id}/events  SSE: the tokens so far, then live, as stream=true chunks, then [DONE]
DELETE /v1/jobs/{id}         cancel wherever the job is (queued, running); a finished job is unchanged

Each API key may have ``INFLIGHT_MAX_JOBS_PER_KEY`` unfinished jobs (429 past it); a job created with
``X-Request-Timeout`` fails with code ``timeout`` if no engine starts it in time (deadlines.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from services.common import keys
from services.common.wire import TERMINAL, DoneEvent, Kind, WireError, decode_event
from services.gateway.deadlines import start_within
from services.gateway.errors import APIError, error_body
from services.gateway.openai_routes import _done_error, check_model, prepare
from services.gateway.prompts import Prepared, prepare_chat, prepare_completion
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest, JobRequest
from services.gateway.quotas import Taken
from services.gateway.responses import (
    ResponseBuilder,
    record_tool_reading,
    record_tools,
    response_from_record,
    sse_data,
)
from services.gateway.sse import SSE_HEADERS, TokenStream
from services.gateway.state import Gateway, gateway, job_quota, new_request_id, owner_of, quota_refusal
from services.gateway.tools import ToolMode, tool_mode

router = APIRouter()


@router.post("/v1/jobs", status_code=202, response_model=None)
async def create_job(body: JobRequest, request: Request) -> JSONResponse:
    gw = gateway(request)
    kind, prepared, tools = await prepare_job(gw, body.endpoint, body.body, request)
    within_s = start_within(request, None)
    owner = owner_of(request)
    extra: dict[str, str | int | float] = {
        "endpoint": body.endpoint,
        "metadata": json.dumps(body.metadata or {}),
        "owner": owner,
        "tools": tools or "",  # how its result answers tool calls (tools.py): as the chat response does
        **tool_reading(prepared),
    }
    job_id = new_request_id(kind, job=True)
    quota = job_quota(gw)
    taken = await quota.take(owner, job_id)
    if taken is not Taken.OK:
        raise quota_refusal(quota, taken, "jobs")
    try:
        msg, _ = await gw.enqueue(
            kind,
            prepared,
            job=True,
            subscribe=False,
            extra=extra,
            start_within_s=within_s,
            request_id=job_id,
            owner=owner,
        )
    except BaseException:
        gw.spawn(quota.give_back(owner, job_id))
        raise
    record = await gw.store.get_record(msg.id) or {}
    return JSONResponse(
        _job_view(msg.id, record), status_code=202, headers={"Location": f"/v1/jobs/{msg.id}"}
    )


@router.get("/v1/jobs/{job_id}")
async def get_job(job_id: str, request: Request) -> dict[str, Any]:
    gw = gateway(request)
    view = _job_view(job_id, await _job_record(gw, job_id, request))
    # A cancel the worker has not acted on yet: say so, as DELETE did, rather than "in_progress".
    if view["status"] not in TERMINAL and await gw.store.client.exists(keys.cancel(job_id)):
        view["status"] = "cancelling"
    return view


@router.delete("/v1/jobs/{job_id}")
async def cancel_job(job_id: str, request: Request) -> dict[str, Any]:
    gw = gateway(request)
    await _job_record(gw, job_id, request)
    status = await gw.dispatcher.cancel(job_id)
    record = await _job_record(gw, job_id, request)
    view = _job_view(job_id, record)
    if status == "cancelling":
        view["status"] = "cancelling"  # a worker is aborting it; GET shows "cancelled" once it has
    return view


@router.get("/v1/jobs/{job_id}/events", response_model=None)
async def job_events(job_id: str, request: Request) -> StreamingResponse | TokenStream:
    gw = gateway(request)
    record = await _job_record(gw, job_id, request)
    kind: Kind = "chat" if record.get("kind") == "chat" else "completion"
    logprobs = int(record["logprobs"]) if record.get("logprobs") else None
    builder = ResponseBuilder(
        kind, job_id, record.get("model", ""), int(float(record.get("created", 0))), int(record.get("n", 1)),
        gw.info.tokenizer, logprobs, record_tools(record), **record_tool_reading(record),
    )  # fmt: skip
    sub = await gw.hub.subscribe(job_id)
    try:
        answered = record.get("status") in TERMINAL and not await _log_ends_done(gw, job_id)
    except BaseException:
        await gw.hub.unsubscribe(sub)
        raise
    if answered:
        # Finished without a token log (never enqueued, or the log expired first): answer from the record.
        await gw.hub.unsubscribe(sub)
        return StreamingResponse(
            _from_record(job_id, record), media_type="text/event-stream", headers=SSE_HEADERS
        )
    sub.resync()  # the tokens so far from the log, then live
    # Following a job does not own it: a client that stops reading leaves the job running.
    return TokenStream(gw, sub, builder, include_usage=True, cancel_on_exit=False, error_of=_done_error)


async def _log_ends_done(gw: Gateway, job_id: str) -> bool:
    """Whether the job's token log ends with its terminal event (its last entry: the whole log is read
    only by the stream, page by page)."""
    last = await gw.store.client.lindex(keys.log(job_id), -1)
    try:
        return last is not None and isinstance(decode_event(last), DoneEvent)
    except WireError:
        return False


async def _from_record(job_id: str, record: dict[str, str]) -> AsyncIterator[str]:
    view = _job_view(job_id, record)
    result = view["result"]
    if result is None:
        message = (view["error"] or {}).get("message") or f"the job ended {view['status']} without a result"
        yield sse_data(error_body(500, message, code="job_failed"))
        return
    chat = result["object"] == "chat.completion"
    for choice in result["choices"]:
        if chat:
            message = choice["message"]
            delta = {"role": "assistant", "content": message["content"]}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
            body = {"index": choice["index"], "delta": delta, "finish_reason": choice["finish_reason"]}
        else:
            body = {
                "index": choice["index"],
                "text": choice["text"],
                "finish_reason": choice["finish_reason"],
            }
        obj = "chat.completion.chunk" if chat else "text_completion"
        yield sse_data({**result, "object": obj, "choices": [body], "usage": None})
    yield sse_data(
        {**result, "object": "chat.completion.chunk" if chat else "text_completion", "choices": []}
    )
    yield "data: [DONE]\n\n"


async def prepare_job(
    gw: Gateway, endpoint: str, body: dict[str, Any], request: Request | None = None
) -> tuple[Kind, Prepared, ToolMode]:
    """A job's body validated and prepared as its endpoint's (a job or a batch's line); APIError if not.
    Without ``request`` (a batch's lines) it is prepared on the event loop: each line is one request."""
    try:
        if endpoint == "/v1/completions":
            completion = CompletionRequest.model_validate(body)
            check_model(gw, completion.model)
            if completion.echo:  # a job's result is rebuilt from the worker's record, which has no prompt
                raise APIError(400, "a job does not take echo", code="invalid_value", param="echo")
            if request is None:
                return "completion", prepare_completion(completion, gw.info), None
            return "completion", await prepare(request, prepare_completion, completion, gw.info), None
        chat = ChatCompletionRequest.model_validate(body)
        check_model(gw, chat.model)
        if request is None:
            prepared = prepare_chat(chat, gw.info)
        else:
            prepared = await prepare(request, prepare_chat, chat, gw.info)
        return "chat", prepared, tool_mode(chat.tools, chat.tool_choice, prepared.tool_calls)
    except ValidationError as exc:
        first = exc.errors()[0]
        message = f"body.{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
        raise APIError(422, message, code="invalid_value", param="body") from None


def tool_reading(prepared: Prepared) -> dict[str, str | int]:
    """The record fields that say how a job's tool calls read back (responses.record_tool_reading)."""
    return {"tool_parser": prepared.tool_parser, "parallel_tool_calls": int(prepared.parallel_tool_calls)}


async def _job_record(gw: Gateway, job_id: str, request: Request) -> dict[str, str]:
    record = await gw.store.get_record(job_id) if job_id.startswith("job-") else None
    # Another key's job answers exactly as a missing one: its existence is not disclosed either.
    if record is None or record.get("job") != "1" or record.get("owner", "") != owner_of(request):
        raise APIError(404, f"no job {job_id!r} (unknown, or expired)", code="not_found", param="job_id")
    return record


def _job_view(job_id: str, record: dict[str, str]) -> dict[str, Any]:
    status = record.get("status", "queued")
    created = _float(record.get("created"))
    started, finished = _float(record.get("started")), _float(record.get("finished"))
    timings: dict[str, float | None] = {
        "queue_s": None if started is None or created is None else round(started - created, 6),
        "ttft_s": _float(record.get("ttft_worker_s")),
        "total_s": None if finished is None or created is None else round(finished - created, 6),
    }
    error = None
    if record.get("error"):
        error = {"message": record["error"], "code": record.get("code") or None}
    result = response_from_record(record, job_id) if status in TERMINAL and "result" in record else None
    return {
        "id": job_id,
        "object": "job",
        "endpoint": record.get("endpoint"),
        "model": record.get("model"),
        "status": status,
        "created_at": created,
        "started_at": started,
        "finished_at": finished,
        "result": result,
        "usage": result["usage"] if result else None,
        "error": error,
        "timings": timings,
        "metadata": json.loads(record.get("metadata") or "{}"),
    }


def _float(value: str | None) -> float | None:
    try:
        return None if value is None or value == "" else float(value)
    except ValueError:
        return None
