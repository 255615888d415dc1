"""The Helm chart itself: lint, schema, the options and what they turn on (rendered by Helm's Go SDK)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from tests.deploy.support import (
    CHART,
    component,
    env_of,
    load_yaml,
    main_container,
    manifests,
    named,
    of_kind,
    pod_spec,
    render_chart,
    with_key,
)

ALL_ON = CHART / "ci" / "all-on-values.yaml"
CPU = CHART / "ci" / "cpu-existing-secret-values.yaml"
WRONG = Path(__file__).parent / "data" / "wrong-values.yaml"


@pytest.fixture(scope="module")
def all_on() -> dict[str, str]:
    return render_chart(load_yaml(ALL_ON))


@pytest.mark.parametrize("values_file", [None, ALL_ON, CPU], ids=["defaults", "all-on", "cpu"])
def test_chart_lints_clean(values_file: Path | None) -> None:
    values = with_key(load_yaml(values_file) if values_file else None)
    report = helm.lint(CHART, values, strict=True, namespace="serving")
    assert report["errors"] == []
    # Severity 1 is informational ("icon is recommended"); warnings and errors fail.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_every_template_renders_something_with_all_options_on(all_on: dict[str, str]) -> None:
    empty = [path for path, text in all_on.items() if path.endswith(".yaml") and not text.strip()]
    assert empty == []
    kinds = {o["kind"] for o in manifests(all_on)}
    assert {
        "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Ingress", "ScaledObject",
        "TriggerAuthentication", "ServiceMonitor", "NetworkPolicy", "ConfigMap", "Secret", "ServiceAccount",
        "Role", "RoleBinding",
    } <= kinds  # fmt: skip


def test_defaults_keep_the_optional_parts_off() -> None:
    objs = manifests(render_chart())
    kinds = {o["kind"] for o in objs}
    assert not {"Ingress", "ScaledObject", "TriggerAuthentication", "ServiceMonitor"} & kinds
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    # Kafka and Redis are external: the chart runs nothing but inflight's own two components.
    assert sorted(d["metadata"]["name"] for d in of_kind(objs, "Deployment")) == [
        "rel-inflight-gateway",
        "rel-inflight-worker",
    ]


def test_values_reach_the_environment(all_on: dict[str, str]) -> None:
    values = load_yaml(ALL_ON)
    objs = manifests(all_on)
    worker = env_of(main_container(component(objs, "worker")), objs)
    assert json.loads(worker["INFLIGHT_ENGINE_ARGS"]) == values["worker"]["engineArgs"]
    assert worker["INFLIGHT_DRAIN_TIMEOUT_S"] == str(values["worker"]["drainTimeoutSeconds"])
    assert worker["INFLIGHT_MODEL"] == values["model"]["path"]
    assert worker["INFLIGHT_KAFKA_BOOTSTRAP"] == values["kafka"]["bootstrapServers"]
    assert worker["INFLIGHT_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert worker["INFLIGHT_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512"
    assert worker["OTEL_EXPORTER_OTLP_ENDPOINT"] == values["telemetry"]["otlpEndpoint"]
    gateway = env_of(main_container(component(objs, "gateway")), objs)
    assert gateway["INFLIGHT_MODEL"] == values["model"]["path"]  # model.mountOnGateway
    secret = of_kind(objs, "Secret")[0]["stringData"]
    assert secret == {
        "INFLIGHT_API_KEYS": "key-one,key-two",
        "INFLIGHT_REDIS_PASSWORD": "redis-secret",
        "INFLIGHT_KAFKA_SASL_USERNAME": "inflight",
        "INFLIGHT_KAFKA_SASL_PASSWORD": "kafka-secret",
    }
    for name in ("INFLIGHT_API_KEYS", "INFLIGHT_REDIS_PASSWORD", "INFLIGHT_KAFKA_SASL_PASSWORD"):
        assert gateway[name]["secretKeyRef"]["key"] == name  # credentials never appear as literals
    assert main_container(component(objs, "gateway"))["image"].endswith(
        "@" + values["gateway"]["image"]["digest"]
    )


def test_keda_scales_workers_on_the_consumer_group_lag(all_on: dict[str, str]) -> None:
    objs = manifests(all_on)
    scaled = of_kind(objs, "ScaledObject")[0]
    worker = component(objs, "worker")
    assert "replicas" not in worker["spec"], "KEDA owns the replica count"
    assert scaled["spec"]["scaleTargetRef"]["name"] == worker["metadata"]["name"]
    env = env_of(main_container(worker), objs)
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "kafka"
    meta = trigger["metadata"]
    assert meta["topic"] == env["INFLIGHT_KAFKA_TOPIC"]
    assert meta["consumerGroup"] == env["INFLIGHT_KAFKA_CONSUMER_GROUP"]
    assert meta["bootstrapServers"] == env["INFLIGHT_KAFKA_BOOTSTRAP"]
    assert (meta["sasl"], meta["tls"]) == ("scram_sha512", "enable")
    auth = named(objs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    refs = {r["parameter"]: r["key"] for r in auth["spec"]["secretTargetRef"]}
    assert refs == {"username": "INFLIGHT_KAFKA_SASL_USERNAME", "password": "INFLIGHT_KAFKA_SASL_PASSWORD"}
    # Scale-in removes one pod at a time, each chosen by its pod-deletion-cost and then drained.
    behavior = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert behavior["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 60}]


def test_hpa_owns_gateway_replicas_only_when_enabled() -> None:
    default = component(manifests(render_chart()), "gateway")
    assert "replicas" not in default["spec"]
    fixed = component(
        manifests(render_chart({"gateway": {"autoscaling": {"enabled": False}, "replicas": 3}})), "gateway"
    )
    assert fixed["spec"]["replicas"] == 3


def test_cpu_workers_drop_the_gpu_and_its_toleration() -> None:
    objs = manifests(render_chart(load_yaml(CPU)))
    spec = pod_spec(component(objs, "worker"))
    assert "tolerations" not in spec
    assert all(v.get("name") != "model" for v in spec["volumes"]), "model.volume: null mounts nothing"
    assert of_kind(objs, "Secret") == [], "existingSecret: the chart makes no Secret"
    ref = env_of(main_container(component(objs, "worker")), objs)["INFLIGHT_REDIS_PASSWORD"]
    assert ref["secretKeyRef"]["name"] == "inflight-credentials"


def test_a_grace_period_shorter_than_the_drain_fails_the_render() -> None:
    with pytest.raises(helm.HelmRenderError) as caught:
        render_chart({"worker": {"terminationGracePeriodSeconds": 60, "drainTimeoutSeconds": 60}})
    message = str(caught.value)
    assert "worker.terminationGracePeriodSeconds (60) must be greater than" in message
    assert "drainTimeoutSeconds + worker.preStopSleepSeconds (65)" in message


def test_one_port_for_api_and_metrics_fails_the_render() -> None:
    # The gateway would refuse to start (its settings check the same); the render says why first.
    with pytest.raises(helm.HelmRenderError, match=r"gateway\.metricsPort must differ from gateway\.port"):
        render_chart({"gateway": {"port": 9464}})
    objs = manifests(render_chart({"gateway": {"metricsPort": 9100}}))
    container = main_container(component(objs, "gateway"))
    assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in container["ports"]
    assert env_of(container, objs)["INFLIGHT_GATEWAY_METRICS_PORT"] == "9100"
    service = named(objs, "Service", "inflight-gateway")
    metrics = {"name": "metrics", "port": 9100, "targetPort": "metrics", "protocol": "TCP"}
    assert metrics in service["spec"]["ports"]


def test_a_wrong_values_file_is_rejected_with_a_readable_message() -> None:
    wrong: dict[str, Any] = load_yaml(WRONG)
    with pytest.raises(helm.HelmValuesError) as caught:
        render_chart(wrong)
    message = str(caught.value)
    # Each mistake in the file is named by its path and what was expected.
    for expected in (
        "at '/worker/gpu/count': got string, want integer",
        "at '/worker': additional properties 'replica' not allowed",
        "at '/kafka/securityProtocol': value must be one of",
        "at '/securityContext/runAsUser': minimum: got 0, want 1",
        "at '/redis/url'",
    ):
        assert expected in message, f"{expected!r} not in:\n{message}"
    # helm lint reports the same, as errors.
    report = helm.lint(CHART, wrong, namespace="serving")
    assert any("additional properties 'replica' not allowed" in e for e in report["errors"])


def test_sasl_needs_a_mechanism() -> None:
    with pytest.raises(helm.HelmValuesError, match="/kafka/sasl/mechanism"):
        render_chart({"kafka": {"securityProtocol": "SASL_SSL"}})


def test_notes_tell_the_operator_what_is_missing() -> None:
    notes = render_chart()["inflight/templates/NOTES.txt"]
    assert "accepts every request" not in notes
    open_notes = render_chart({"auth": {"allowAnonymous": True}})["inflight/templates/NOTES.txt"]
    assert "without API keys the gateway accepts every request" in open_notes
    assert 'PersistentVolumeClaim "inflight-model"' in notes
    assert "grace period 95 s" in notes
    crowded = render_chart({"worker": {"keda": {"enabled": True, "maxReplicas": 20}}})[
        "inflight/templates/NOTES.txt"
    ]
    assert "exceeds kafka.partitions (8)" in crowded


def _cache_volume(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (volume,) = [v for v in pod_spec(component(objs, "worker"))["volumes"] if v["name"] == "cache"]
    return dict(volume)


def test_the_worker_cache_outlives_the_pod() -> None:
    # Default: a claim the chart creates, sized as the cache, that every worker mounts on /cache.
    objs = manifests(render_chart())
    (claim,) = of_kind(objs, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "rel-inflight-worker-cache"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert "storageClassName" not in claim["spec"]  # the cluster's default class
    assert _cache_volume(objs) == {
        "name": "cache",
        "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]},
    }
    # A claim of the operator's: mounted, none created.
    objs = manifests(
        render_chart({"worker": {"cacheVolume": {"persistent": True, "existingClaim": "models"}}})
    )
    assert of_kind(objs, "PersistentVolumeClaim") == []
    assert _cache_volume(objs)["persistentVolumeClaim"] == {"claimName": "models"}
    # Off: the pod's own emptyDir, as large as the cache may grow.
    off = {"worker": {"cacheVolume": {"persistent": False}, "cacheSizeLimit": "20Gi"}}
    objs = manifests(render_chart(off))
    assert of_kind(objs, "PersistentVolumeClaim") == []
    assert _cache_volume(objs)["emptyDir"] == {"sizeLimit": "20Gi"}
