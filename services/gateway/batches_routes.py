"""OpenAI's Batch API routes (batches.py holds the state and its progress).

POST /v1/batches              {"input_file_id", "endpoint", "completion_window": "24h", "metadata"}
GET  /v1/batches/{id}         the batch object: status, request_counts, output_file_id, error_file_id
POST /v1/batches/{id}/cancel  stops submitting, cancels its unfinished jobs; "cancelled" once they end
GET  /v1/batches              a key's batches, newest first (``limit``, ``after``)

A batch takes one slot of its key's job quota (INFLIGHT_MAX_JOBS_PER_KEY), however many lines it has.
Each gateway sweeps the active batches five times a second (started by its first batch request), and
any batch request advances that batch at once; batches.py paces how many lines a round submits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any, cast

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from services.common.store import REDIS_ERRORS
from services.gateway.batch_lines import encode_index, index_key, line_starts
from services.gateway.batches import (
    ENDPOINTS,
    FINISHED,
    SWEEP_S,
    active_key,
    advance,
    batch_key,
    batch_object,
    counts_of,
    owner_index,
    stop,
)
from services.gateway.errors import APIError
from services.gateway.files_routes import owned_file
from services.gateway.protocol import MetadataKey, MetadataValue
from services.gateway.quotas import Taken
from services.gateway.state import Gateway, gateway, job_quota, owner_of, quota_refusal

log = logging.getLogger(__name__)
router = APIRouter()


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str = Field(max_length=128)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)


def _sweeping(request: Request, gw: Gateway) -> None:
    """Start this gateway's sweep of the active batches, once."""
    if getattr(request.app.state, "batch_sweep", False):
        return
    request.app.state.batch_sweep = True

    async def sweep() -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                for batch_id in await gw.store.client.smembers(active_key(gw)):
                    await advance(gw, str(batch_id))
            except REDIS_ERRORS as exc:
                log.warning("batch sweep skipped a round: %r", exc)
            except Exception:
                log.exception("batch sweep failed a round")  # never let the sweep die

    gw.spawn(sweep())


@router.post("/v1/batches")
async def create_batch(body: BatchRequest, request: Request) -> dict[str, Any]:
    gw, owner = gateway(request), owner_of(request)
    _sweeping(request, gw)
    if body.endpoint not in ENDPOINTS:
        raise APIError(
            400, f"endpoint must be one of {', '.join(ENDPOINTS)}", code="invalid_value", param="endpoint"
        )
    if body.completion_window != "24h":
        raise APIError(
            400, "completion_window must be '24h'", code="invalid_value", param="completion_window"
        )
    file = await owned_file(gw, body.input_file_id, owner, content=True)
    if file["purpose"] != "batch":
        raise APIError(
            400, "the input file's purpose must be 'batch'", code="invalid_value", param="input_file_id"
        )
    starts = line_starts((file["content"] or "").encode())
    total = len(starts)
    if total == 0:
        raise APIError(400, "the input file has no requests", code="invalid_value", param="input_file_id")
    batch_id = f"batch_{uuid.uuid4().hex}"
    quota = job_quota(gw)
    taken = await quota.take(owner, batch_id)
    if taken is not Taken.OK:
        raise quota_refusal(quota, taken, "jobs and batches")
    now = int(time.time())
    record: dict[str, str | int] = {
        "id": batch_id,
        "owner": owner,
        "topic": gw.settings.kafka_topic,
        "endpoint": body.endpoint,
        "input_file_id": body.input_file_id,
        "completion_window": body.completion_window,
        "metadata": json.dumps(body.metadata),
        "status": "in_progress",
        "created_at": now,
        "in_progress_at": now,
        "expires_at": now + 24 * 3600,
        "cursor": 0,
        "total": total,
        "request_counts": json.dumps({"total": total, "completed": 0, "failed": 0}),
    }
    client = gw.store.client
    pipe = client.pipeline(transaction=True)
    pipe.hset(batch_key(batch_id), mapping=cast(Any, record))
    # Every key here lives as long as the batch record at least: a set a gateway never trims again (it
    # died, or the key has no batch for two days) expires instead of staying in Redis for good.
    kept_s = 2 * gw.settings.job_ttl_s
    pipe.expire(batch_key(batch_id), kept_s)
    pipe.set(index_key(batch_id), encode_index(starts), ex=kept_s)
    pipe.zremrangebyscore(owner_index(owner), "-inf", now - kept_s)  # records gone by now
    pipe.zadd(owner_index(owner), {batch_id: now})
    pipe.expire(owner_index(owner), kept_s)
    pipe.sadd(active_key(gw), batch_id)
    pipe.expire(active_key(gw), kept_s)
    await pipe.execute()
    await advance(gw, batch_id)
    return await _view(gw, batch_id, owner)


async def _view(gw: Gateway, batch_id: str, owner: str) -> dict[str, Any]:
    record = {str(k): str(v) for k, v in (await gw.store.client.hgetall(batch_key(batch_id))).items()}
    if not record or record.get("owner") != owner or not batch_id.startswith("batch_"):
        raise APIError(
            404, f"no batch {batch_id!r} (unknown, or expired)", code="not_found", param="batch_id"
        )
    counts = None
    if record["status"] not in FINISHED:
        counts = await counts_of(gw, record)
    return batch_object(record, counts)


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request) -> dict[str, Any]:
    gw, owner = gateway(request), owner_of(request)
    _sweeping(request, gw)
    await _view(gw, batch_id, owner)  # 404 before any work for a batch that is not this key's
    await advance(gw, batch_id)
    return await _view(gw, batch_id, owner)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
    gw, owner = gateway(request), owner_of(request)
    view = await _view(gw, batch_id, owner)
    if view["status"] in FINISHED or view["status"] == "cancelling":
        return view
    await stop(gw, batch_id)
    await advance(gw, batch_id)
    return await _view(gw, batch_id, owner)


@router.get("/v1/batches")
async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> dict[str, Any]:
    gw, owner = gateway(request), owner_of(request)
    limit = max(1, min(limit, 100))
    ids = [str(i) for i in await gw.store.client.zrevrange(owner_index(owner), 0, -1)]
    if after is not None and after in ids:
        ids = ids[ids.index(after) + 1 :]
    page = []
    for batch_id in ids[: limit + 1]:
        with contextlib.suppress(APIError):  # expired since it was listed
            page.append(await _view(gw, batch_id, owner))
    data = page[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(page) > limit,
    }
