"""Token streams at their edges, through uvicorn on a real stack: strict SSE readers read a queued stream
whole, and a client that leaves at any moment leaves nothing behind.

The stack's one worker runs one request at a time (``max_num_seqs`` 1) on a paced engine (20 ms a step),
so a request sent while another runs waits in the engine's queue for at least the rest of that one's
steps, on any host: a stream that stays silent for seconds before its first token, where a keep-alive
comment used to go out after 5 s. Redis is this module's own, so the channels it lists are these tests'.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.servers import ServerProcess, start_redis
from services.common import keys
from tests.services.stack import MODEL_NAME, REDIS_PASSWORD, Stack, new_stack, wait_for, worker_stats

pytestmark = pytest.mark.timeout(240)

HOLD_TOKENS = 400  # the request that holds the engine: at least 8 s at 20 ms a step
QUEUED_TOKENS = 24


@pytest.fixture(scope="module")
def one_at_a_time(
    kafka: ServerProcess, model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    with start_redis(password=REDIS_PASSWORD, workdir=tmp_path_factory.mktemp("redis")) as redis_server:
        stack = new_stack(
            kafka,
            redis_server,
            model_path,
            tmp_path_factory.mktemp("sse-edges"),
            INFLIGHT_FAULT_STEP_DELAY_S="0.02",
            INFLIGHT_ENGINE_ARGS='{"max_num_seqs": 1}',
        )
        try:
            yield stack
        finally:
            stack.close()


def _body(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }


@contextmanager
def engine_held(stack: Stack) -> Iterator[None]:
    """A long stream runs in the engine (its first token has come) while the block runs; it is closed
    after, and the engine is idle again."""
    started = threading.Event()
    stop = threading.Event()

    def hold() -> None:
        body = _body("hold the engine", HOLD_TOKENS, stream=True)
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                if stop.is_set():
                    return

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert started.wait(60), "the holding request never started"
    try:
        yield
    finally:
        stop.set()
        holder.join(60)
        wait_for(lambda: _engine_idle(stack), 60, interval_s=0.2, message="the engine to be idle")


def _engine_idle(stack: Stack) -> bool:
    stats = worker_stats(stack.workers[0])
    return not stats["requests"] and stats["kv"]["usage"] == 0


# ---- strict readers ---------------------------------------------------------------------------------
def read_like_benchmark_serving(response: httpx.Response) -> list[dict[str, Any]]:
    """vLLM's benchmark_serving.py: every piece the response yields is stripped, skipped when empty, and
    otherwise must be a data line: the "data: " prefix removed, it is [DONE] or JSON (else it raises)."""
    out = []
    for piece in response.iter_lines():
        chunk_bytes = piece.encode().strip()
        if not chunk_bytes:
            continue
        chunk = chunk_bytes.decode("utf-8").removeprefix("data: ")
        if chunk != "[DONE]":
            out.append(json.loads(chunk))
    return out


def read_like_vllm_bench_serve(response: httpx.Response) -> list[dict[str, Any]]:
    """``vllm bench serve``'s reader: each raw network chunk is stripped, added to a buffer and split on
    blank lines; what is left starting with "data: " counts once it parses whole. A comment stripped of
    its blank line stays glued in front of the next event, which then no longer starts with "data: "."""
    out = []
    buffer = ""
    for raw in response.iter_raw():
        chunk_bytes = raw.strip()
        if not chunk_bytes:
            continue
        buffer += chunk_bytes.decode("utf-8")
        messages = []
        while "\n\n" in buffer:
            message, buffer = buffer.split("\n\n", 1)
            if message.strip():
                messages.append(message.strip())
        if buffer.startswith("data: "):
            content = buffer.removeprefix("data: ").strip()
            if content == "[DONE]":
                messages.append(content)
            elif content:
                try:
                    json.loads(content)
                    messages.append(content)
                    buffer = ""
                except json.JSONDecodeError:
                    pass
        for message in messages:
            if message.startswith(":"):
                continue
            chunk = message.removeprefix("data: ")
            if chunk != "[DONE]":
                out.append(json.loads(chunk))
    return out


READERS = {"benchmark_serving": read_like_benchmark_serving, "bench_serve": read_like_vllm_bench_serve}


def test_strict_readers_read_every_token_of_a_queued_stream(one_at_a_time: Stack) -> None:
    stack = one_at_a_time
    results: dict[str, tuple[list[dict[str, Any]], float]] = {}
    errors: list[BaseException] = []

    def queued(name: str) -> None:
        body = _body(f"queued for {name}", QUEUED_TOKENS, stream=True, stream_options={"include_usage": True})
        sent = time.monotonic()
        try:
            with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=120) as resp:
                assert resp.status_code == 200
                results[name] = (READERS[name](resp), time.monotonic() - sent)
        except BaseException as exc:
            errors.append(exc)

    with engine_held(stack):
        clients = [threading.Thread(target=queued, args=(name,)) for name in READERS]
        for client in clients:
            client.start()
        for client in clients:
            client.join(120)
    assert not errors, errors
    for name, (chunks, took_s) in results.items():
        # Queued behind the holding request's remaining steps: silent for more than the 5 s after which
        # a keep-alive used to be written.
        assert took_s > 5.0, (name, took_s)
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == QUEUED_TOKENS, (name, usage)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        reference = httpx.post(
            f"{stack.url}/v1/completions", json=_body(f"queued for {name}", QUEUED_TOKENS), timeout=120
        ).json()
        assert text == reference["choices"][0]["text"], name
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_a_queued_stream_writes_nothing_but_data_events(one_at_a_time: Stack) -> None:
    stack = one_at_a_time
    body = _body("raw bytes", 4, stream=True)
    with (
        engine_held(stack),
        httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=120) as resp,
    ):
        raw = b"".join(resp.iter_raw())
    assert raw.startswith(b"data: {"), raw[:80]
    assert not [line for line in raw.split(b"\n") if line.startswith(b":")]


# ---- clients that leave ----------------------------------------------------------------------------
def _raw_stream_request(stack: Stack, body: dict[str, Any]) -> socket.socket:
    payload = json.dumps(body).encode()
    assert stack.gateway is not None
    sock = socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=60)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    got = b""
    while marker not in got:
        data = sock.recv(65536)
        assert data, f"the connection closed before {marker!r}: {got!r}"
        got += data
    return got


def _gateway_gauges(stack: Stack) -> dict[str, float]:
    text = httpx.get(f"{stack.url}/metrics", timeout=10).text
    wanted = ("inflight:gateway_streams ", "inflight:gateway_stream_buffered_bytes ")
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith(wanted)}


def _records(stack: Stack) -> dict[str, dict[str, str]]:
    client = stack.redis_client()
    names = [k for k in client.scan_iter(f"{keys.PREFIX}:req:*") if k.endswith("}")]
    return {name: client.hgetall(name) for name in names}


@pytest.mark.parametrize("leaves", ["at_once", "after_the_headers", "after_the_first_token"])
def test_a_client_that_leaves_releases_everything_and_cancels(one_at_a_time: Stack, leaves: str) -> None:
    """at_once: the request is sent whole and the socket closed in the same breath, so the disconnect is
    already pending when the route returns (the response body never starts); after_the_headers: queued,
    nothing written yet; after_the_first_token: running."""
    stack = one_at_a_time
    body = _body(f"leaves {leaves}", 1000, stream=True)
    if leaves == "after_the_first_token":
        before = set(_records(stack))
        sock = _raw_stream_request(stack, body)
        _read_until(sock, b"data: {")
        sock.close()
    else:
        with engine_held(stack):
            before = set(_records(stack))
            sock = _raw_stream_request(stack, body)
            if leaves == "after_the_headers":
                assert b" 200 OK" in _read_until(sock, b"\r\n\r\n")
            sock.close()
            # Still queued behind the holder when it left: its record says so, or says it was cancelled.
            wait_for(lambda: set(_records(stack)) - before, 30, message="the request's record")
            (name,) = set(_records(stack)) - before
            wait_for(
                lambda: _records(stack)[name].get("status") == "cancelled",
                30,
                interval_s=0.2,
                message="the queued request to be cancelled",
            )
    (name,) = set(_records(stack)) - before
    client = stack.redis_client()
    wait_for(
        lambda: (
            _gateway_gauges(stack)
            == {"inflight:gateway_streams": 0.0, "inflight:gateway_stream_buffered_bytes": 0.0}
        ),
        30,
        interval_s=0.2,
        message="the gateway to release its streams and buffers",
    )
    wait_for(
        lambda: not client.pubsub_channels(f"{keys.PREFIX}:events:*"),
        30,
        interval_s=0.2,
        message="no token-stream subscription left in Redis",
    )
    request_id = name.split("{", 1)[1].rstrip("}")
    assert client.pubsub_numsub(keys.events(request_id)) == [(keys.events(request_id), 0)]
    wait_for(lambda: _engine_idle(stack), 30, interval_s=0.2, message="the engine to free the request")
    assert _records(stack)[name]["status"] == "cancelled"
