"""PodDeletionCost against a FAKE Kubernetes API server.

No API server can run here (no cluster, no kube-apiserver binary), so these tests stand up an
in-process HTTP(S) server on loopback that answers the one call the worker makes, PATCH
/api/v1/namespaces/{ns}/pods/{name}, records it, and replies with a minimal Pod. What is checked is
what a real API server would receive from the real `kubernetes` client: path, content type (strategic
merge patch), body, bearer token, and how often it is sent.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from services.worker.k8s import DELETION_COST_ANNOTATION, PodDeletionCost

POD, NAMESPACE = "inflight-worker-0", "serving"
POD_PATH = f"/api/v1/namespaces/{NAMESPACE}/pods/{POD}"


@dataclass
class Recorded:
    method: str
    path: str
    content_type: str
    authorization: str
    body: dict[str, Any]


@dataclass
class FakeApiServer:
    """Records every request; answers PATCH on pods with `status` after `delay_s`."""

    status: int = 200
    delay_s: float = 0.0
    requests: list[Recorded] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.server_address[1]

    def patches(self) -> list[str]:
        """The deletion-cost values PATCHed so far, in order."""
        return [r.body["metadata"]["annotations"][DELETION_COST_ANNOTATION] for r in self.requests]


def _handler(fake: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            fake.requests.append(
                Recorded(
                    "PATCH",
                    self.path,
                    self.headers.get("Content-Type", ""),
                    self.headers.get("Authorization", ""),
                    body,
                )
            )
            time.sleep(fake.delay_s)
            if fake.status == 200:
                reply: dict[str, Any] = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": POD, "namespace": NAMESPACE, **body.get("metadata", {})},
                }
            else:
                reply = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": fake.status}
            payload = json.dumps(reply).encode()
            self.send_response(fake.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
            pass

    return Handler


def _serve(fake: FakeApiServer, wrap: Any = None) -> Iterator[FakeApiServer]:
    fake.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    if wrap is not None:
        fake.server.socket = wrap(fake.server.socket)
    thread = threading.Thread(target=fake.server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        fake.server.shutdown()
        fake.server.server_close()


@pytest.fixture
def fake_api() -> Iterator[FakeApiServer]:
    yield from _serve(FakeApiServer())


def _cost(fake: FakeApiServer, min_interval_s: float = 0.0) -> PodDeletionCost:
    def api() -> client.CoreV1Api:
        return client.CoreV1Api(client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{fake.port}")))

    return PodDeletionCost(api, POD, NAMESPACE, min_interval_s=min_interval_s)


async def test_outside_a_cluster_it_is_a_noop() -> None:
    cost = PodDeletionCost.from_env({"POD_NAME": POD, "POD_NAMESPACE": NAMESPACE})  # no service host
    assert not cost.enabled
    await cost.update(7)  # would raise on any network use: there is no client at all
    assert cost.published is None
    assert not PodDeletionCost.from_env({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}).enabled  # no pod name


def test_in_a_cluster_without_a_token_it_is_a_noop(tmp_path: Path) -> None:
    environ = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    environ |= {"POD_NAME": POD, "POD_NAMESPACE": NAMESPACE}  # automountServiceAccountToken: false
    assert not PodDeletionCost.from_env(environ, token_path=str(tmp_path / "token")).enabled


async def test_patch_is_a_strategic_merge_of_one_annotation(fake_api: FakeApiServer) -> None:
    cost = _cost(fake_api)
    await cost.update(3)
    await cost.flush()
    assert len(fake_api.requests) == 1
    sent = fake_api.requests[0]
    assert (sent.method, sent.path) == ("PATCH", POD_PATH)
    assert sent.content_type == "application/strategic-merge-patch+json"
    assert sent.body == {"metadata": {"annotations": {DELETION_COST_ANNOTATION: "3"}}}
    assert cost.published == 3


async def test_only_changes_are_written_and_values_are_clamped(fake_api: FakeApiServer) -> None:
    cost = _cost(fake_api)
    for load in (2, 2, 2, 0, 0, -4, 2**40):
        await cost.update(load)
        await cost.flush()
    # -4 clamps to 0, which is already published; 2**40 clamps to the int32 maximum.
    assert fake_api.patches() == ["2", "0", str(2**31 - 1)]


async def test_bursts_are_throttled_and_the_last_value_lands(fake_api: FakeApiServer) -> None:
    cost = _cost(fake_api, min_interval_s=3.0)
    # The interval counts from the first PATCH's start, which comes after this and before its (slow,
    # first-client) flush returns: the trailing write is due no earlier than started + 3 s.
    started = time.monotonic()
    await cost.update(1)  # the first write goes out at once
    await cost.flush()
    for load in (2, 3, 4, 0):  # a burst inside the interval: nothing is sent yet
        await cost.update(load)
    await asyncio.sleep(0.1)
    if time.monotonic() - started < 2.5:  # (a host stalled past the interval has sent the trailing write)
        assert fake_api.patches() == ["1"]
    await cost.flush()
    # Trailing edge: the idle value (0) is written once the interval has passed, the rest skipped.
    assert fake_api.patches() == ["1", "0"]
    assert time.monotonic() - started >= 2.8
    assert cost.published == 0


async def test_a_change_during_a_slow_patch_is_written_next(fake_api: FakeApiServer) -> None:
    fake_api.delay_s = 0.3
    cost = _cost(fake_api)
    await cost.update(1)
    for _ in range(500):  # until the fake has the PATCH of 1 (the client is built first)
        if fake_api.requests:
            break
        await asyncio.sleep(0.01)
    await cost.update(0)  # while that PATCH is still in flight
    await cost.flush()
    assert fake_api.patches() == ["1", "0"]
    assert cost.published == 0


async def test_aclose_cancels_a_pending_write(fake_api: FakeApiServer) -> None:
    cost = _cost(fake_api, min_interval_s=0.3)
    await cost.update(1)
    await cost.flush()
    await cost.update(5)
    await cost.aclose()
    await asyncio.sleep(0.4)
    assert fake_api.patches() == ["1"]


async def test_a_failed_patch_is_logged_not_raised_and_retried_later(fake_api: FakeApiServer) -> None:
    fake_api.status = 403  # e.g. the Role lacks "patch pods"
    cost = _cost(fake_api)
    await cost.update(4)
    await cost.flush()  # does not raise
    assert cost.published is None
    fake_api.status = 200
    await cost.update(4)  # same value, but it never landed: sent again
    await cost.flush()
    assert fake_api.patches() == ["4", "4"]
    assert cost.published == 4


async def test_the_patch_runs_off_the_event_loop(fake_api: FakeApiServer) -> None:
    fake_api.delay_s = 0.3  # a slow API server
    cost = _cost(fake_api)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    started = time.monotonic()
    await cost.update(1)
    assert time.monotonic() - started < 0.1, "update() returns without waiting for the API server"
    await cost.flush()
    task.cancel()
    assert ticks >= 10, f"the event loop was blocked during the PATCH ({ticks} ticks)"


@pytest.fixture
def tls_fake_api(tmp_path: Path) -> Iterator[tuple[FakeApiServer, Path]]:
    """The fake over TLS with a self-signed loopback certificate, as the in-cluster config needs."""
    import ssl

    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not found: cannot make a certificate for the TLS fake")
    cert, key = tmp_path / "ca.crt", tmp_path / "tls.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )  # fmt: skip
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    for fake in _serve(FakeApiServer(), wrap=lambda sock: context.wrap_socket(sock, server_side=True)):
        yield fake, cert


async def test_from_env_in_a_cluster_uses_the_service_account(
    tls_fake_api: tuple[FakeApiServer, Path], tmp_path: Path
) -> None:
    fake, ca = tls_fake_api
    token = tmp_path / "token"
    token.write_text("sa-token-123")
    environ = {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(fake.port),
        "POD_NAME": POD,
        "POD_NAMESPACE": NAMESPACE,
    }
    cost = PodDeletionCost.from_env(environ, token_path=str(token), ca_path=str(ca), min_interval_s=0)
    assert cost.enabled
    await cost.update(9)
    await cost.flush()
    assert len(fake.requests) == 1
    sent = fake.requests[0]
    assert sent.path == POD_PATH
    scheme, _, credential = sent.authorization.partition(" ")
    assert (scheme.lower(), credential) == ("bearer", "sa-token-123")
    assert sent.content_type == "application/strategic-merge-patch+json"
    assert fake.patches() == ["9"]
