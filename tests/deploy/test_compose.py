"""docker-compose.yml against the Compose Specification's JSON schema (check-jsonschema's vendored
copy), plus what the stack relies on: start order, GPU reservation, profiles, env names, and the
Prometheus and Grafana files it mounts. No Docker engine runs here."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from typing import Any

import pytest
import yaml

from tests.deploy.support import REPO, load_yaml, settings_env_names

COMPOSE = REPO / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = load_yaml(COMPOSE)  # PyYAML resolves the <<: merge keys as Compose does
    return data


def _services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = compose["services"]
    return services


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration))


def test_compose_matches_the_compose_spec_schema() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_stack_has_every_part(compose: dict[str, Any]) -> None:
    services = _services(compose)
    assert {"kafka", "kafka-init", "redis", "jaeger", "gateway", "worker", "worker-cpu"} <= set(services)
    assert services["worker"]["profiles"] == ["gpu"]
    assert services["worker-cpu"]["profiles"] == ["cpu"]
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["observability"]
    for name, service in services.items():
        image = service["image"]
        if not image.startswith("inflight-"):  # third-party images carry a version tag
            tag = image.rpartition(":")[2]
            assert ":" in image and tag != "latest" and re.match(r"v?\d+\.\d+", tag), f"{name}: {image}"


def test_kafka_runs_kraft_and_the_topic_is_created_first(compose: dict[str, Any]) -> None:
    services = _services(compose)
    kafka = services["kafka"]["environment"]
    assert kafka["KAFKA_PROCESS_ROLES"] == "broker,controller" and "CONTROLLER" in kafka["KAFKA_LISTENERS"]
    assert "healthcheck" in services["kafka"]
    init = services["kafka-init"]
    assert init["depends_on"] == {"kafka": {"condition": "service_healthy"}}
    topic = next(a.split("=", 1)[1] for a in init["command"] if a.startswith("--topic="))
    for name in ("gateway", "worker", "worker-cpu"):
        assert services[name]["environment"]["INFLIGHT_KAFKA_TOPIC"] == topic


def test_start_order_follows_health(compose: dict[str, Any]) -> None:
    services = _services(compose)
    for name in ("gateway", "worker", "worker-cpu"):
        depends = services[name]["depends_on"]
        assert depends["kafka-init"] == {"condition": "service_completed_successfully"}
        assert depends["redis"] == {"condition": "service_healthy"}
        assert "healthcheck" in services[name]
    assert services["worker-cpu"]["depends_on"]["tiny-model"] == {
        "condition": "service_completed_successfully"
    }
    for name, service in services.items():
        for dependency, condition in service.get("depends_on", {}).items():
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name} waits on {dependency}'s health"


def test_gpu_worker_reserves_a_gpu_and_the_cpu_one_does_not(compose: dict[str, Any]) -> None:
    services = _services(compose)
    (device,) = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] >= 1
    assert "deploy" not in services["worker-cpu"]
    assert services["worker"]["build"]["target"] == services["worker-cpu"]["build"]["target"] == "worker"
    assert services["gateway"]["build"]["target"] == "gateway"


def test_env_names_and_drain(compose: dict[str, Any]) -> None:
    known, source = settings_env_names()
    for name, service in _services(compose).items():
        env = service.get("environment", {})
        unknown = sorted(n for n in env if n.startswith("INFLIGHT_") and n not in known)
        assert not unknown, f"{name} sets {unknown}, which {source} does not read"
    for name in ("worker", "worker-cpu"):
        service = _services(compose)[name]
        env = service["environment"]
        assert isinstance(json.loads(env["INFLIGHT_ENGINE_ARGS"]), dict)
        # `docker compose stop` must wait for the drain before it kills the worker.
        assert _seconds(service["stop_grace_period"]) > float(env["INFLIGHT_DRAIN_TIMEOUT_S"])
        assert env["INFLIGHT_KAFKA_IDEMPOTENCE"] == "true", "real Apache Kafka supports it"
        assert service["user"] == "10001:10001" and service["read_only"] is True


def test_tiny_model_lands_where_the_cpu_worker_reads_it(compose: dict[str, Any]) -> None:
    services = _services(compose)
    init, worker = services["tiny-model"], services["worker-cpu"]
    script = init["command"][0]
    ast.parse(script)
    assert "write_tiny_checkpoint" in script
    tiny = ast.parse((REPO / "engine" / "models" / "tiny.py").read_text())
    assert "write_tiny_checkpoint" in {f.name for f in tiny.body if isinstance(f, ast.FunctionDef)}
    model = worker["environment"]["INFLIGHT_MODEL"]
    assert f'Path("{model}")' in script
    assert init["volumes"][0].split(":")[0] == worker["volumes"][0].split(":")[0] == "tiny-model"


def test_prometheus_scrapes_both_components(compose: dict[str, Any]) -> None:
    services = _services(compose)
    mount = services["prometheus"]["volumes"][0].split(":")
    config = yaml.safe_load((REPO / mount[0]).read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    gateway = services["gateway"]
    # The gateway's metrics port: /metrics on its API port needs a key once INFLIGHT_API_KEYS is set,
    # and Prometheus sends none.
    metrics_port = gateway["environment"]["INFLIGHT_GATEWAY_METRICS_PORT"]
    assert metrics_port != gateway["environment"]["INFLIGHT_GATEWAY_PORT"]
    assert jobs["inflight-gateway"]["static_configs"][0]["targets"] == [f"gateway:{metrics_port}"]
    assert "authorization" not in jobs["inflight-gateway"]
    assert metrics_port in gateway["expose"], "reachable from the prometheus container"
    (sd,) = jobs["inflight-worker"]["dns_sd_configs"]
    assert set(sd["names"]) == {"worker", "worker-cpu"}
    assert str(sd["port"]) == services["worker"]["environment"]["INFLIGHT_WORKER_PORT"]


def test_grafana_provisioning_points_at_prometheus_and_the_dashboards(compose: dict[str, Any]) -> None:
    grafana = _services(compose)["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":") for v in grafana["volumes"])  # host -> container
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert all((REPO / host).is_dir() for host in mounts)
    datasources = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/inflight.yml").read_text())
    assert providers["providers"][0]["options"]["path"] == mounts["./charts/inflight/dashboards"]
    dashboards = sorted((REPO / "charts/inflight/dashboards").glob("*.json"))
    assert dashboards
    for path in dashboards:
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] and dashboard["title"]


def _published(port: str | dict[str, Any]) -> tuple[str, str]:
    """(host address, host port) of a `ports` entry; address '' when it binds every interface."""
    if isinstance(port, dict):
        return str(port.get("host_ip", "")), str(port.get("published", ""))
    parts = str(port).rsplit(":", 2)
    return (parts[0] if len(parts) == 3 else ""), (parts[-2] if len(parts) >= 2 else "")


def test_nothing_is_published_beyond_this_host(compose: dict[str, Any]) -> None:
    """The gateway runs without API keys unless INFLIGHT_API_KEYS is set, Redis with a known dev
    password, Kafka with none: every published port binds to loopback."""
    published = {
        (name, _published(port))
        for name, service in _services(compose).items()
        for port in service.get("ports", [])
    }
    assert ("gateway", ("127.0.0.1", "8000")) in published
    assert {(name, host) for name, (host, _) in published if host != "127.0.0.1"} == set()


def test_kafka_takes_the_largest_request_the_gateway_accepts(compose: dict[str, Any]) -> None:
    from services.common.kafka import max_message_bytes
    from services.common.settings import Settings

    services = _services(compose)
    body = services["gateway"]["environment"]["INFLIGHT_MAX_BODY_BYTES"]
    for name in ("worker", "worker-cpu"):
        assert services[name]["environment"]["INFLIGHT_MAX_BODY_BYTES"] == body, "one limit for both sides"
    largest = max_message_bytes(Settings.from_env({"INFLIGHT_MAX_BODY_BYTES": body}))
    assert int(body) >= 4 * 1024 * 1024 and largest > 8 * 1024 * 1024
    configs = dict(
        a.split("=", 2)[1:] for a in services["kafka-init"]["command"] if a.startswith("--config=")
    )
    topic = int(configs["max.message.bytes"])
    assert int(configs["retention.ms"]) == Settings().kafka_retention_ms  # prompts kept a day, not a week
    broker = services["kafka"]["environment"]
    assert topic >= largest, f"the topic refuses messages over {topic} bytes; a request may take {largest}"
    assert int(broker["KAFKA_MESSAGE_MAX_BYTES"]) >= topic
    assert int(broker["KAFKA_REPLICA_FETCH_MAX_BYTES"]) >= topic
