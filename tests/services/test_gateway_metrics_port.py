"""The gateway's metrics port: Prometheus scrapes it without a key while API keys guard everything on
the API port, /metrics included; it serves nothing but GET /metrics and listens on INFLIGHT_BIND_HOST.

One keyed gateway for the module, no worker and no checkpoint: metrics need neither.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.servers import ServerProcess, free_port
from services.common.settings import Settings, SettingsError
from tests.services.stack import Stack, new_stack

pytestmark = pytest.mark.timeout(120)

KEY = {"Authorization": "Bearer scrape-test-key"}
# Families the gateway registers at start-up (services/common/metrics.py), before any traffic.
GATEWAY_FAMILIES = {
    "inflight:gateway_responses",
    "inflight:admission_rejections",
    "inflight:gateway_stream_buffered_bytes",
    "inflight:gateway_streams_cut",
}


@pytest.fixture(scope="module")
def keyed(
    kafka: ServerProcess,
    redis_server: ServerProcess,
    model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Stack, int]]:
    metrics_port = free_port()
    stack = new_stack(
        kafka,
        redis_server,
        model_path,
        tmp_path_factory.mktemp("metrics-port"),
        workers=0,
        INFLIGHT_MODEL="",  # no tokenizer to load: the gateway forwards text
        INFLIGHT_API_KEYS="scrape-test-key",
        INFLIGHT_GATEWAY_METRICS_PORT=str(metrics_port),
    )
    yield stack, metrics_port
    stack.close()


def _families(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """family name -> {sorted labels: value} of a Prometheus text payload."""
    return {
        family.name: {tuple(sorted(s.labels.items())): s.value for s in family.samples}
        for family in text_string_to_metric_families(text)
    }


def test_the_metrics_port_needs_no_key_and_the_api_port_still_does(keyed: tuple[Stack, int]) -> None:
    stack, metrics_port = keyed
    with httpx.Client(timeout=30) as http:
        refused = http.get(f"{stack.url}/metrics")
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert http.get(f"{stack.url}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401

        scraped = http.get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert scraped.status_code == 200, scraped.text
        assert scraped.headers["content-type"].startswith("text/plain")
        families = _families(scraped.text)
        assert set(families) >= GATEWAY_FAMILIES, sorted(families)
        # One registry behind both ports: the API port's refusals above are counted in this scrape.
        responses = families["inflight:gateway_responses"]
        assert responses[(("route", "/metrics"), ("status", "401"))] >= 2

        with_key = http.get(f"{stack.url}/metrics", headers=KEY)
        assert with_key.status_code == 200
        assert set(_families(with_key.text)) >= GATEWAY_FAMILIES


def test_the_metrics_port_serves_nothing_else(keyed: tuple[Stack, int]) -> None:
    _, metrics_port = keyed
    with httpx.Client(base_url=f"http://127.0.0.1:{metrics_port}", timeout=30) as http:
        for path in ("/", "/healthz", "/readyz", "/docs", "/openapi.json", "/v1/models", "/v1/live/events"):
            assert http.get(path).status_code == 404, path
            assert http.get(path, headers=KEY).status_code == 404, f"{path} with a key"
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        assert http.post("/v1/chat/completions", json=chat, headers=KEY).status_code == 404
        assert http.post("/metrics").status_code == 405


def test_the_metrics_port_listens_on_the_bind_host_only(keyed: tuple[Stack, int]) -> None:
    stack, metrics_port = keyed
    assert stack.env["INFLIGHT_BIND_HOST"] == "127.0.0.1"
    # All of 127/8 reaches this host's loopback: a socket bound to every address would answer on
    # 127.0.0.2 too; one bound to INFLIGHT_BIND_HOST refuses.
    for port in (metrics_port, stack.gateways[0].port):
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=5).close()


def test_sigterm_closes_both_ports_and_exits_cleanly(keyed: tuple[Stack, int]) -> None:
    stack, _ = keyed
    metrics_port = free_port()
    gateway = stack.add_gateway(INFLIGHT_GATEWAY_METRICS_PORT=str(metrics_port))
    assert httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).status_code == 200
    assert gateway.stop(signal.SIGTERM, timeout_s=30) == 0, gateway.tail_log()
    for port in (gateway.port, metrics_port):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert "Traceback" not in gateway.tail_log(20_000)


def test_the_metrics_port_setting() -> None:
    assert Settings.from_env({}).gateway_metrics_port == 9464
    assert Settings.from_env({"INFLIGHT_GATEWAY_METRICS_PORT": "0"}).gateway_metrics_port == 0  # none
    for bad in ({"INFLIGHT_GATEWAY_METRICS_PORT": "8000"}, {"INFLIGHT_GATEWAY_METRICS_PORT": "-1"}):
        with pytest.raises(SettingsError, match="INFLIGHT_GATEWAY_METRICS_PORT"):
            Settings.from_env(bad)
    with pytest.raises(SettingsError, match="INFLIGHT_GATEWAY_METRICS_PORT"):
        Settings.from_env({"INFLIGHT_GATEWAY_PORT": "9464"})
