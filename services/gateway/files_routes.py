"""OpenAI's Files API, for the Batch API's input and output: files live in Redis, owned by an API key.

POST   /v1/files               multipart (file, purpose="batch"): the file object
GET    /v1/files/{id}          the file object
GET    /v1/files/{id}/content  the bytes
DELETE /v1/files/{id}          {"id", "object": "file", "deleted": true}

Why Redis: the stack already runs it, every gateway reads it, and a batch's input and output are small
next to what it stores for jobs (a file is bounded by the gateway's body limit, INFLIGHT_MAX_BODY_BYTES,
and MAX_LINES lines). Files expire (``job_ttl_s`` after the batch that uses them ends, twice that for an
input) rather than live until deleted, so Redis never fills with forgotten files. An object store would
lift the size bound; it is not needed at these sizes.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, cast

from fastapi import APIRouter, Form, Request, UploadFile
from fastapi.responses import Response

from services.common import keys
from services.gateway.errors import APIError
from services.gateway.jobs_routes import owner_of
from services.gateway.state import Gateway, gateway

router = APIRouter()

MAX_LINES = 50_000  # OpenAI's bound on a batch's requests
_FIELDS = ("id", "bytes", "created_at", "filename", "purpose")


def file_key(file_id: str) -> str:
    return f"{keys.PREFIX}:file:{{{file_id}}}"


async def store_file(
    gw: Gateway, owner: str, filename: str, purpose: str, content: bytes, ttl_s: int
) -> dict[str, Any]:
    file_id = f"file-{uuid.uuid4().hex}"
    fields = {
        "id": file_id,
        "bytes": len(content),
        "created_at": int(time.time()),
        "filename": filename,
        "purpose": purpose,
        "owner": owner,
        "content": content,
    }
    name = file_key(file_id)
    pipe = gw.store.client.pipeline(transaction=True)
    pipe.hset(name, mapping=cast(Any, fields))
    pipe.expire(name, ttl_s)
    await pipe.execute()
    return file_object({k: str(v) for k, v in fields.items() if k != "content"})


def file_object(record: dict[str, str]) -> dict[str, Any]:
    return {
        "id": record["id"],
        "object": "file",
        "bytes": int(record["bytes"]),
        "created_at": int(record["created_at"]),
        "filename": record["filename"],
        "purpose": record["purpose"],
        "status": "processed",
    }


async def owned_file(gw: Gateway, file_id: str, owner: str, *, content: bool = False) -> dict[str, str]:
    """The file's fields (and content, as text, if asked); another key's file answers as a missing one."""
    names = [*_FIELDS, "owner", *(("content",) if content else ())]
    values = await gw.store.client.hmget(file_key(file_id), names)
    record = {k: v.decode() if isinstance(v, bytes) else v for k, v in zip(names, values, strict=True)}
    if record["id"] is None or record["owner"] != owner:
        raise APIError(404, f"no file {file_id!r} (unknown, or expired)", code="not_found", param="file_id")
    return {k: v or "" for k, v in record.items()}


@router.post("/v1/files")
async def create_file(
    request: Request, file: UploadFile, purpose: Annotated[str, Form()] = ""
) -> dict[str, Any]:
    gw = gateway(request)
    if purpose != "batch":
        raise APIError(400, "purpose must be 'batch'", code="invalid_value", param="purpose")
    content = await file.read()
    lines = content.count(b"\n") + (0 if content.endswith(b"\n") or not content else 1)
    if lines > MAX_LINES:
        message = f"a batch file has at most {MAX_LINES} lines; this one has {lines}"
        raise APIError(400, message, code="invalid_value", param="file")
    try:
        content.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "a batch file is UTF-8 JSONL", code="invalid_value", param="file") from None
    ttl_s = 2 * gw.settings.job_ttl_s  # outlives a batch that starts near its end
    return await store_file(gw, owner_of(request), file.filename or "upload.jsonl", purpose, content, ttl_s)


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request) -> dict[str, Any]:
    return file_object(await owned_file(gateway(request), file_id, owner_of(request)))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    record = await owned_file(gateway(request), file_id, owner_of(request), content=True)
    return Response(record["content"] or "", media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
    gw = gateway(request)
    await owned_file(gw, file_id, owner_of(request))
    await gw.store.client.delete(file_key(file_id))
    return {"id": file_id, "object": "file", "deleted": True}
