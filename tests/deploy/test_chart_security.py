"""The chart fails closed: no API keys, no gateway, unless an open one is chosen by name; workers get no
namespace-wide pod access by default; the gateway's drain gets its full time."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from tests.deploy.support import (
    component,
    env_of,
    main_container,
    manifests,
    of_kind,
    pod_spec,
    render_chart,
)

# However the gateway is exposed (a NetworkPolicy admits the whole namespace at least), no key source
# fails the render.
EXPOSURES: list[dict[str, Any]] = [
    {},
    {"gateway": {"ingress": {"enabled": True}}},
    {"gateway": {"service": {"type": "LoadBalancer"}}},
    {"networkPolicy": {"enabled": False}},
]


def _api_keys_ref(objs: list[dict[str, Any]]) -> dict[str, Any]:
    ref: dict[str, Any] = env_of(main_container(component(objs, "gateway")), objs)["INFLIGHT_API_KEYS"][
        "secretKeyRef"
    ]
    return ref


@pytest.mark.parametrize("values", EXPOSURES, ids=["defaults", "ingress", "loadbalancer", "no-policy"])
def test_no_key_source_fails_the_render(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmRenderError) as err:
        render_chart(values, add_key=False)
    message = str(err.value)
    assert "no API keys" in message and "existingSecret" in message and "auth.allowAnonymous=true" in message
    # Each way out renders: keys, a Secret that holds them, or an open gateway chosen on purpose.
    for fix in ({"apiKeys": ["k"]}, {"existingSecret": "creds"}, {"auth": {"allowAnonymous": True}}):
        assert component(manifests(render_chart({**values, **fix}, add_key=False)), "gateway")


def test_an_existing_secret_must_hold_the_api_keys() -> None:
    """An existingSecret without INFLIGHT_API_KEYS keeps the gateway from starting, not open."""
    objs = manifests(render_chart({"existingSecret": "creds"}, add_key=False))
    ref = _api_keys_ref(objs)
    assert ref == {"name": "creds", "key": "INFLIGHT_API_KEYS", "optional": False}
    assert of_kind(objs, "Secret") == []


def test_chart_made_keys_are_required_too() -> None:
    objs = manifests(render_chart({"apiKeys": ["one", "two"]}, add_key=False))
    ref = _api_keys_ref(objs)
    (secret,) = of_kind(objs, "Secret")
    assert ref["name"] == secret["metadata"]["name"] and ref["optional"] is False
    assert secret["stringData"]["INFLIGHT_API_KEYS"] == "one,two"


def test_an_open_gateway_is_a_named_choice() -> None:
    rendered = render_chart({"existingSecret": "creds", "auth": {"allowAnonymous": True}}, add_key=False)
    assert _api_keys_ref(manifests(rendered))["optional"] is True
    assert "without API keys the gateway accepts every request" in rendered["inflight/templates/NOTES.txt"]


def _pod_write_rules(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rules of any Role or ClusterRole that let a subject change pods."""
    return [
        rule
        for role in objs
        if role["kind"] in ("Role", "ClusterRole")
        for rule in role.get("rules", [])
        if "" in rule.get("apiGroups", [])
        and {"pods", "*"} & set(rule.get("resources", []))
        and {"patch", "update", "*"} & set(rule.get("verbs", []))
    ]


def test_workers_get_no_pod_access_by_default() -> None:
    objs = manifests(render_chart())
    assert _pod_write_rules(objs) == []
    assert not of_kind(objs, "Role") and not of_kind(objs, "RoleBinding")
    assert pod_spec(component(objs, "worker"))["automountServiceAccountToken"] is False, "no API token"


def test_pod_deletion_cost_is_opt_in_and_patch_only() -> None:
    objs = manifests(render_chart({"worker": {"podDeletionCost": {"enabled": True}}}))
    (rule,) = _pod_write_rules(objs)
    assert rule["verbs"] == ["patch"] and rule["resources"] == ["pods"]
    assert not of_kind(objs, "ClusterRole"), "never beyond the release's namespace"
    assert pod_spec(component(objs, "worker"))["automountServiceAccountToken"] is True


def test_defaults_admit_only_the_namespace() -> None:
    objs = manifests(render_chart())
    policy = next(
        o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("gateway")
    )
    assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {}}]


def test_metrics_ports_admit_one_namespace_selector_only() -> None:
    """The metrics ports (gateway and worker) open to one namespace, picked by a value, never to every
    namespace: an empty value fails the render; explicit peers replace it."""
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    prom = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "obs"}}}]
    for values, expected in (
        ({}, monitoring),
        ({"networkPolicy": {"metricsNamespace": "obs"}}, prom),
        ({"networkPolicy": {"metricsFrom": [{"podSelector": {"matchLabels": {"app": "p"}}}]}}, None),
    ):
        objs = manifests(render_chart(values))
        for policy in (o for o in objs if o["kind"] == "NetworkPolicy"):
            (rule,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "metrics"]
            wanted = expected or values["networkPolicy"]["metricsFrom"]
            assert rule["from"] == wanted, (values, policy["metadata"]["name"])
            assert {"namespaceSelector": {}} not in rule["from"]
    with pytest.raises(Exception) as err:
        render_chart({"networkPolicy": {"metricsNamespace": ""}})
    assert "metricsNamespace is empty" in str(err.value)


def test_gateway_grace_period_covers_prestop_and_drain() -> None:
    objs = manifests(render_chart({"gateway": {"drainTimeoutSeconds": 50}}))
    gateway = component(objs, "gateway")
    assert env_of(main_container(gateway), objs)["INFLIGHT_DRAIN_TIMEOUT_S"] == "50"
    assert pod_spec(gateway)["terminationGracePeriodSeconds"] == 50 + 10 + 10
    with pytest.raises(Exception) as err:
        render_chart({"gateway": {"terminationGracePeriodSeconds": 55}})
    assert "gateway.terminationGracePeriodSeconds (55) must be greater than" in str(err.value)


def test_the_worker_cache_volume_is_sized_for_a_converted_model() -> None:
    """GGUF conversions land in XDG_CACHE_HOME (engine/paths.py): that volume, not /tmp, is the big one."""
    objs = manifests(render_chart({"worker": {"cacheSizeLimit": "80Gi"}}))
    worker = component(objs, "worker")
    env = env_of(main_container(worker), objs)
    mounts = {m["name"]: m["mountPath"] for m in main_container(worker)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(worker)["volumes"]}
    cache = next(name for name, path in mounts.items() if path == env["XDG_CACHE_HOME"])
    (claim,) = of_kind(objs, "PersistentVolumeClaim")  # the default: a claim that outlives the pod
    assert volumes[cache]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "80Gi"
    assert "INFLIGHT_HOME" not in env  # or it would take the models elsewhere
