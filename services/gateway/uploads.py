"""A batch file's upload, streamed into Redis as it arrives instead of read whole under the body limit.

``POST /v1/files`` is the one route that takes large bodies (OpenAI allows 200 MB and 50,000 lines a
file). Its multipart body is parsed as it is received, and the file part's bytes are appended to the file's
content key chunk by chunk, so the gateway holds one chunk at a time whatever the file's size:

    receive() chunk -> MultipartParser.write -> on_part_data (file part) -> pending
                    -> bounds checked (bytes, lines, UTF-8) -> APPEND inflight:file:{id}:content

Its bounds (INFLIGHT_MAX_FILE_BYTES, INFLIGHT_MAX_FILE_LINES) are checked before each append: a file past
either is refused (413, OpenAI's error JSON) and what was appended is deleted, so a refused upload leaves
nothing behind. The partial content key carries a short TTL from its first append, so a gateway that dies
mid-upload leaves nothing for long either. Every other request keeps the JSON body limit
(``BodyLimitButUploads``).
"""

from __future__ import annotations

import codecs
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from services.common import keys
from services.common.store import REDIS_ERRORS
from services.gateway.edge import BodyLimit
from services.gateway.errors import APIError
from services.gateway.state import Gateway

UPLOAD_PATH = "/v1/files"
# What a multipart body carries besides the file's bytes: the boundaries, each part's headers and the
# purpose field. A declared Content-Length past the file bound plus this is refused before any is read.
FORM_SLACK_BYTES = 64 * 1024
_PARTIAL_TTL_S = 600  # an upload that has not finished by then was abandoned (its gateway died)
_MAX_FIELD_BYTES = 256  # a form field other than the file ("purpose"): a short word


def file_key(file_id: str) -> str:
    """The file's record (id, bytes, created_at, filename, purpose, owner)."""
    return f"{keys.PREFIX}:file:{{{file_id}}}"


def content_key(file_id: str) -> str:
    """The file's bytes: a string key of their own, appended to as an upload streams in."""
    return file_key(file_id) + ":content"


class BodyLimitButUploads:
    """The gateway's body limit (edge.BodyLimit) for every request but an upload, which streams under
    bounds of its own (this module)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.limited = BodyLimit(app, max_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == UPLOAD_PATH:
            await self.app(scope, receive, send)
        else:
            await self.limited(scope, receive, send)


def _too_large(message: str) -> APIError:
    return APIError(413, message, code="file_too_large", param="file")


@dataclass
class _Form:
    """The parser's callbacks' state: which part is being read, and what it has given so far."""

    headers: dict[bytes, bytes] = field(default_factory=dict)
    header_field: bytes = b""
    header_value: bytes = b""
    part: str | None = None  # the current part's form name
    filename: str | None = None  # set once the file part has begun
    purpose: bytes = b""
    pending: list[bytes] = field(default_factory=list)  # the file's bytes not yet appended
    fields_too_large: bool = False
    num_files: int = 0  # file parts begun: one upload is one file

    def callbacks(self) -> dict[str, Any]:
        def on_header_field(data: bytes, start: int, end: int) -> None:
            self.header_field += data[start:end]

        def on_header_value(data: bytes, start: int, end: int) -> None:
            self.header_value += data[start:end]

        def on_header_end() -> None:
            self.headers[self.header_field.lower()] = self.header_value
            self.header_field, self.header_value = b"", b""

        def on_headers_finished() -> None:
            _, params = parse_options_header(self.headers.get(b"content-disposition", b""))
            self.part = params.get(b"name", b"").decode("latin-1")
            if self.part == "file":
                self.num_files += 1
                self.filename = params.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")
            self.headers = {}

        def on_part_data(data: bytes, start: int, end: int) -> None:
            if self.part == "file":
                self.pending.append(data[start:end])
            elif self.part == "purpose":
                self.purpose += data[start:end]
                self.fields_too_large = self.fields_too_large or len(self.purpose) > _MAX_FIELD_BYTES

        def on_part_end() -> None:
            self.part = None

        return {
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        }


def _parse(step: Any, data: bytes) -> None:
    """One step of the multipart parser; a body that is not multipart as it says answers 400."""
    try:
        step(data)
    except MultipartParseError as exc:
        raise APIError(
            400, f"a malformed multipart body: {exc}", code="invalid_value", param="file"
        ) from None


async def receive_upload(request: Request, gw: Gateway, owner: str, ttl_s: int) -> dict[str, Any]:
    """Stream the request's multipart body (``file``, ``purpose``) into a new file; its record's fields.
    Refusals (400, 413) leave no key behind."""
    max_bytes, max_lines = gw.settings.max_file_bytes, gw.settings.max_file_lines
    kind, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise APIError(400, "an upload is a multipart/form-data body", code="invalid_value", param="file")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes + FORM_SLACK_BYTES:
        raise _too_large(f"a file has at most {max_bytes} bytes; this body has {declared}")
    form = _Form()
    parser = MultipartParser(boundary, cast(Any, form.callbacks()))
    file_id = f"file-{uuid.uuid4().hex}"
    client = gw.store.client
    utf8 = codecs.getincrementaldecoder("utf-8")()
    size = newlines = 0
    last = b""
    stream = request.stream()
    try:
        async for chunk in stream:
            _parse(parser.write, chunk)
            if form.fields_too_large:
                raise APIError(400, "purpose must be 'batch'", code="invalid_value", param="purpose")
            if form.num_files > 1:
                raise APIError(400, "an upload holds one file", code="invalid_value", param="file")
            data = b"".join(form.pending)
            form.pending.clear()
            if not data:
                continue
            size += len(data)
            newlines += data.count(b"\n")
            last = data[-1:]
            if size > max_bytes:
                raise _too_large(f"a file has at most {max_bytes} bytes; this one has more")
            if newlines > max_lines:
                raise _too_large(f"a batch file has at most {max_lines} lines; this one has more")
            try:
                utf8.decode(data)
            except UnicodeDecodeError:
                raise APIError(
                    400, "a batch file is UTF-8 JSONL", code="invalid_value", param="file"
                ) from None
            pipe = client.pipeline(transaction=True)
            pipe.append(content_key(file_id), data)
            pipe.expire(content_key(file_id), _PARTIAL_TTL_S)
            await pipe.execute()
        _parse(lambda _: parser.finalize(), b"")
        lines = newlines + (1 if size and last != b"\n" else 0)
        if lines > max_lines:
            raise _too_large(f"a batch file has at most {max_lines} lines; this one has {lines}")
        try:
            utf8.decode(b"", final=True)
        except UnicodeDecodeError:
            raise APIError(400, "a batch file is UTF-8 JSONL", code="invalid_value", param="file") from None
        if form.filename is None:
            raise APIError(400, "the upload has no file part", code="invalid_value", param="file")
        if form.purpose.decode("utf-8", "replace") != "batch":
            raise APIError(400, "purpose must be 'batch'", code="invalid_value", param="purpose")
        fields = {
            "id": file_id,
            "bytes": size,
            "created_at": int(time.time()),
            "filename": form.filename,
            "purpose": "batch",
            "owner": owner,
        }
        pipe = client.pipeline(transaction=True)
        pipe.hset(file_key(file_id), mapping=cast(Any, fields))
        pipe.expire(file_key(file_id), ttl_s)
        pipe.set(content_key(file_id), b"", nx=True)  # an empty file has a content key too
        pipe.expire(content_key(file_id), ttl_s)
        await pipe.execute()
        return {k: str(v) for k, v in fields.items()}
    except APIError:
        await client.delete(content_key(file_id))
        # The client may still be sending: what it declared (at most the bound and the slack) is read to
        # the end, so that it reads the refusal rather than a connection reset mid-send; an undeclared
        # length, only as far as the slack.
        left = None if declared.isdigit() else FORM_SLACK_BYTES
        with contextlib.suppress(ClientDisconnect):
            async for chunk in stream:
                if left is not None:
                    left -= len(chunk)
                    if left < 0:
                        break
        raise
    except BaseException:  # the client left, or Redis failed: the partial key goes (or expires)
        with contextlib.suppress(*REDIS_ERRORS):
            await client.delete(content_key(file_id))
        raise
