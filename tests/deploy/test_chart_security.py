"""The chart refuses an open gateway without API keys, and gives the gateway's drain its full time."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.support import component, env_of, main_container, manifests, pod_spec, render_chart

OPEN_WAYS: list[dict[str, Any]] = [
    {"gateway": {"ingress": {"enabled": True}}},
    {"gateway": {"service": {"type": "LoadBalancer"}}},
    {"gateway": {"service": {"type": "NodePort"}}},
    {"networkPolicy": {"enabled": False}},
    {"networkPolicy": {"gatewayFrom": []}},
]


@pytest.mark.parametrize("values", OPEN_WAYS, ids=["ingress", "loadbalancer", "nodeport", "no-policy", "all"])
def test_an_open_gateway_without_keys_fails_the_render(values: dict[str, Any]) -> None:
    with pytest.raises(Exception) as err:
        render_chart(values)
    assert "auth.allowAnonymous=true" in str(err.value)
    # Each way out renders: keys, a Secret that holds them, or anonymous access chosen on purpose.
    for fix in ({"apiKeys": ["k"]}, {"existingSecret": "creds"}, {"auth": {"allowAnonymous": True}}):
        assert component(manifests(render_chart({**values, **fix})), "gateway")


def test_defaults_admit_only_the_namespace() -> None:
    objs = manifests(render_chart())
    policy = next(
        o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("gateway")
    )
    assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {}}]


def test_gateway_grace_period_covers_prestop_and_drain() -> None:
    objs = manifests(render_chart({"gateway": {"drainTimeoutSeconds": 50}}))
    gateway = component(objs, "gateway")
    assert env_of(main_container(gateway), objs)["INFLIGHT_DRAIN_TIMEOUT_S"] == "50"
    assert pod_spec(gateway)["terminationGracePeriodSeconds"] == 50 + 10 + 10
    with pytest.raises(Exception) as err:
        render_chart({"gateway": {"terminationGracePeriodSeconds": 55}})
    assert "gateway.terminationGracePeriodSeconds (55) must be greater than" in str(err.value)
