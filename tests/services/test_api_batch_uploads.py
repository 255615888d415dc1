"""Batch file uploads stream into Redis under their own bounds, not the JSON body limit: through the
``openai`` package against a real gateway with small bounds (a 64 KiB body limit, 256 KiB and 1,000-line
files)."""

from __future__ import annotations

import io
import json
from typing import Any

import httpx
import openai
import pytest

from tests.services.conftest import ExtraGateway
from tests.services.stack import MODEL_NAME, Stack

pytestmark = pytest.mark.timeout(180)

BODY_LIMIT = 64 * 1024
FILE_BYTES = 256 * 1024
FILE_LINES = 1000


@pytest.fixture(scope="module")
def url(extra_gateway: ExtraGateway) -> str:
    gateway = extra_gateway(
        INFLIGHT_MAX_BODY_BYTES=str(BODY_LIMIT),
        INFLIGHT_MAX_FILE_BYTES=str(FILE_BYTES),
        INFLIGHT_MAX_FILE_LINES=str(FILE_LINES),
    )
    return str(gateway.url)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _file_keys(stack: Stack) -> set[Any]:
    return set(stack.redis_client().scan_iter("inflight:file:*"))


def _lines(num_lines: int, width: int) -> bytes:
    """JSONL of ``num_lines`` batch requests, each line ``width`` bytes with its newline."""
    out = []
    for i in range(num_lines):
        line = {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL_NAME},
        }
        text = json.dumps({**line, "pad": ""})
        line["pad"] = "x" * (width - 1 - len(text))
        out.append(json.dumps(line))
    data = ("\n".join(out) + "\n").encode()
    assert len(data) == num_lines * width
    return data


def test_a_file_larger_than_the_body_limit_uploads_whole(url: str, stack: Stack) -> None:
    data = _lines(100, 2000)  # 200,000 bytes: three times the body limit, under the file bound
    assert BODY_LIMIT < len(data) < FILE_BYTES
    client = _client(url)
    upload = client.files.create(file=("big.jsonl", io.BytesIO(data)), purpose="batch")
    assert (upload.bytes, upload.filename, upload.purpose) == (len(data), "big.jsonl", "batch")
    assert client.files.content(upload.id).content == data
    # JSON endpoints keep the body limit.
    resp = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x" * BODY_LIMIT})
    assert resp.status_code == 413
    assert client.files.delete(upload.id).deleted
    assert not {k for k in _file_keys(stack) if upload.id in k}


@pytest.mark.parametrize(
    ("data", "what"),
    [
        (_lines(1, FILE_BYTES) + b"x", "bytes"),  # one byte over, within the form's slack: seen mid-stream
        (_lines(FILE_LINES + 1, 120), "lines"),  # 120,120 bytes: under the byte bound
        (b"x" * (4 * FILE_BYTES), "bytes"),  # refused from its declared length, before any is read
    ],
)
def test_a_file_over_its_bounds_is_refused_and_leaves_nothing(
    url: str, stack: Stack, data: bytes, what: str
) -> None:
    before = _file_keys(stack)
    with pytest.raises(openai.APIStatusError) as refused:
        _client(url).files.create(file=("over.jsonl", io.BytesIO(data)), purpose="batch")
    assert refused.value.status_code == 413
    error = refused.value.response.json()["error"]
    assert error["code"] == "file_too_large" and error["param"] == "file" and what in error["message"]
    assert _file_keys(stack) == before


def test_an_upload_without_a_declared_length_is_bounded_while_it_streams(url: str, stack: Stack) -> None:
    before = _file_keys(stack)
    boundary = "b0undary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="f.jsonl"\r\n\r\n'
    ).encode()

    def body() -> Any:  # chunked: no Content-Length, so only the stream's own count can stop it
        yield head
        for _ in range(FILE_BYTES // 1000 + 2):
            yield b"y" * 999 + b"\n"
        yield f"\r\n--{boundary}--\r\n".encode()

    resp = httpx.post(
        f"{url}/v1/files",
        content=body(),
        headers={"content-type": f"multipart/form-data; boundary={boundary}"},
        timeout=60,
    )
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "file_too_large"
    assert _file_keys(stack) == before


def test_purpose_and_encoding_are_checked(url: str, stack: Stack) -> None:
    client = _client(url)
    before = _file_keys(stack)
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", io.BytesIO(b"\xff\xfe{}\n")), purpose="batch")
    assert _file_keys(stack) == before
    empty = client.files.create(file=("e.jsonl", io.BytesIO(b"")), purpose="batch")
    assert empty.bytes == 0 and client.files.content(empty.id).content == b""


def test_a_malformed_multipart_body_is_a_400(url: str, stack: Stack) -> None:
    before = _file_keys(stack)
    for content_type, body in (
        ("multipart/form-data; boundary=b0", b"garbage\r\n--zz"),
        ("application/json", b"{}"),
        ("multipart/form-data", b""),  # no boundary
    ):
        resp = httpx.post(f"{url}/v1/files", content=body, headers={"content-type": content_type})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "file"
    two = httpx.post(
        f"{url}/v1/files",
        data={"purpose": "batch"},
        files=[("file", ("a.jsonl", b"{}\n")), ("file", ("b.jsonl", b"{}\n"))],
    )
    assert two.status_code == 400 and "one file" in two.json()["error"]["message"]
    assert _file_keys(stack) == before
