"""OpenAI's Files API, for the Batch API's input and output: files live in Redis, owned by an API key.

POST   /v1/files               multipart (file, purpose="batch"): the file object
GET    /v1/files/{id}          the file object
GET    /v1/files/{id}/content  the bytes
DELETE /v1/files/{id}          {"id", "object": "file", "deleted": true}

Why Redis: the stack already runs it, every gateway reads it, and a batch's input and output are small
next to the memory it has (a file is bounded by INFLIGHT_MAX_FILE_BYTES, 64 MiB by default, and
INFLIGHT_MAX_FILE_LINES; uploads stream into it chunk by chunk, uploads.py). Files expire (``job_ttl_s``
after the batch that uses them ends, twice that for an input) rather than live until deleted, so Redis
never fills with forgotten files. An object store would lift the size bound to OpenAI's 200 MB; it is not
needed at these sizes.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.gateway.errors import APIError
from services.gateway.state import Gateway, gateway, owner_of
from services.gateway.uploads import content_key, file_key, receive_upload

__all__ = ["content_key", "file_key", "router", "store_file"]

router = APIRouter()

_FIELDS = ("id", "bytes", "created_at", "filename", "purpose")


async def store_file(
    gw: Gateway, owner: str, filename: str, purpose: str, content: bytes, ttl_s: int
) -> dict[str, Any]:
    """A file the gateway writes itself (a batch's output and error files)."""
    file_id = f"file-{uuid.uuid4().hex}"
    fields = {
        "id": file_id,
        "bytes": len(content),
        "created_at": int(time.time()),
        "filename": filename,
        "purpose": purpose,
        "owner": owner,
    }
    pipe = gw.store.client.pipeline(transaction=True)
    pipe.hset(file_key(file_id), mapping=cast(Any, fields))
    pipe.set(content_key(file_id), content, ex=ttl_s)
    pipe.expire(file_key(file_id), ttl_s)
    await pipe.execute()
    return file_object({k: str(v) for k, v in fields.items()})


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
    names = [*_FIELDS, "owner"]
    values = await gw.store.client.hmget(file_key(file_id), names)
    record = {k: v.decode() if isinstance(v, bytes) else v for k, v in zip(names, values, strict=True)}
    if record["id"] is None or record["owner"] != owner:
        raise APIError(404, f"no file {file_id!r} (unknown, or expired)", code="not_found", param="file_id")
    if content:
        data = await gw.store.client.get(content_key(file_id))
        record["content"] = data.decode() if isinstance(data, bytes) else data
    return {k: v or "" for k, v in record.items()}


# The body is read by receive_upload as it streams, not by FastAPI: its shape is described here instead.
_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }
}


@router.post("/v1/files", openapi_extra=_UPLOAD_BODY)
async def create_file(request: Request) -> dict[str, Any]:
    gw = gateway(request)
    ttl_s = 2 * gw.settings.job_ttl_s  # outlives a batch that starts near its end
    return file_object(await receive_upload(request, gw, owner_of(request), ttl_s))


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
    await gw.store.client.delete(file_key(file_id), content_key(file_id))
    return {"id": file_id, "object": "file", "deleted": True}
