"""The gateway's edge against clients without a key, through uvicorn: a bounded set of metric series
whatever paths they send, a 401 before any byte of the body is read, and a gateway whose keys are set
but empty that refuses to start instead of running open.

One keyed gateway for the module, without a worker (nothing here reaches an engine), with a small body
limit so that "over the limit" is cheap to send.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.servers import ServerProcess
from harness.stack import launch
from services.common.settings import Settings
from tests.services.stack import Stack, new_stack

pytestmark = pytest.mark.timeout(180)

KEY = {"Authorization": "Bearer edge-key"}
LIMIT = 65_536


@pytest.fixture(scope="module")
def keyed(
    kafka: ServerProcess,
    redis_server: ServerProcess,
    model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    stack = new_stack(
        kafka,
        redis_server,
        model_path,
        tmp_path_factory.mktemp("edge"),
        workers=0,
        INFLIGHT_API_KEYS="edge-key,other-key",
        INFLIGHT_MAX_BODY_BYTES=str(LIMIT),
    )
    try:
        yield stack
    finally:
        stack.close()


def _series(http: httpx.Client) -> list[str]:
    """Every sample line of a scrape, without its value: one per series."""
    text = http.get("/metrics", headers=KEY).text
    return sorted(line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#"))


def _responses(series: list[str]) -> set[str]:
    return {s for s in series if s.startswith("inflight:gateway_responses_total{")}


def test_random_paths_add_no_metric_series(keyed: Stack) -> None:
    rng = random.Random(43)
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        # One of each kind first: the series they add ("other" 401 and 404, a template's 401) exist from
        # now on, whatever the path.
        assert http.get("/v1/warm-up").status_code == 401
        assert http.get("/v1/warm-up", headers=KEY).status_code == 404
        assert http.post("/v1/completions", json={}).status_code == 401
        assert http.get("/v1/jobs/job-warm-up").status_code == 401
        _series(http)  # a scrape counts itself once it has answered
        before = _series(http)
        for i in range(3_000):
            path = "/v1/" + "/".join(f"{rng.getrandbits(48):x}" for _ in range(rng.randint(1, 4)))
            if i % 3 == 0:
                path = f"/v1/jobs/job-{rng.getrandbits(64):x}"  # a template, with a new id every time
            headers = KEY if i % 2 and not path.startswith("/v1/jobs/") else {}
            status = http.request(rng.choice(["GET", "POST", "DELETE"]), path, headers=headers).status_code
            assert status in (401, 404, 405), (path, status)
        after = _series(http)
    assert after == before, sorted(set(after) ^ set(before))
    routes = {s.split('route="', 1)[1].split('"', 1)[0] for s in _responses(after)}
    # The templates of the routes asked for (and the readiness probe the harness polled), and "other".
    assert routes == {"other", "/v1/completions", "/v1/jobs/{job_id}", "/metrics", "/readyz"}, routes


def _raw(stack: Stack, head: str, body: bytes = b"") -> socket.socket:
    assert stack.gateway is not None
    sock = socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=30)
    sock.sendall(head.encode() + body)
    return sock


def _status_line(sock: socket.socket) -> tuple[str, bytes]:
    got = b""
    while b"\r\n\r\n" not in got:
        data = sock.recv(65536)
        assert data, got
        got += data
    head, _, rest = got.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0].decode(), rest


def test_a_request_without_a_key_is_refused_before_its_body_is_read(keyed: Stack) -> None:
    # A chunked body of which only the first 16 KiB are ever sent: the answer comes without the rest.
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    first = b"a" * 16_384
    with _raw(keyed, head, b"%x\r\n" % len(first) + first + b"\r\n") as sock:
        status, rest = _status_line(sock)
        assert status == "HTTP/1.1 401 Unauthorized", status
        assert b"invalid_api_key" in rest or b"invalid_api_key" in sock.recv(65536)
    # A body declared far over the limit is not even measured without a key: 401, not 413.
    huge = f"Content-Length: {100 * LIMIT}\r\n"
    for auth, expected in (("", "401 Unauthorized"), ("Authorization: Bearer edge-key\r\n", "413")):
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n{huge}\r\n"
        )
        with _raw(keyed, head, b"{") as sock:
            status, _ = _status_line(sock)
            assert status.startswith(f"HTTP/1.1 {expected}"), (auth, status)
    # The key also opens the way to the body's other bound: streamed past the limit, 413.
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        over = http.post("/v1/completions", content=iter([b"x" * LIMIT, b"x"]), headers=KEY)
        assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"
        refused = http.post("/v1/completions", content=b"{}", headers={"Authorization": "Bearer nope"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        # Probes and the live page stay open.
        assert http.get("/healthz").status_code == 200
        assert http.get("/").status_code == 200
        assert http.get("/static/live.js").status_code == 200


@pytest.mark.parametrize("value", ["", " ", ", ", " ,, "])
def test_keys_set_but_empty_refuse_to_start(keyed: Stack, value: str, tmp_path: Path) -> None:
    assert Settings.from_env({"INFLIGHT_API_KEYS": value}).api_keys == ()
    gateway = launch("gateway", {**keyed.env, "INFLIGHT_API_KEYS": value}, tmp_path)
    try:
        code = gateway.proc.wait(60)
    finally:
        gateway.stop()
    assert code != 0
    assert "INFLIGHT_API_KEYS is set but holds no key" in gateway.tail_log()
    assert not gateway.ready()


def test_keys_unset_leave_the_gateway_open_on_purpose() -> None:
    assert Settings.from_env({}).api_keys is None
    assert Settings.from_env({"INFLIGHT_API_KEYS": " k1 ,k2"}).api_keys == ("k1", "k2")
