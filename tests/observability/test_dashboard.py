"""The Grafana dashboard: every query names a metric the services export, every promised metric has a
panel, and the chart ships the same JSON that docker-compose mounts."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.common.metrics import EngineFamilies, ServiceFamilies

REPO = Path(__file__).resolve().parents[2]
# One file serves both the chart (Helm reads files only from inside the chart) and compose's Grafana.
DASHBOARD = REPO / "charts/inflight/dashboards/inflight.json"
METRIC = re.compile(r"\binflight:[a-z0-9_:]+")
PROMISED = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
    "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
    "time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "iteration_tokens_total", "admission_rejections_total",
    "requests_cancelled_total", "kafka_consumer_lag",
]  # fmt: skip


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def exported_names() -> set[str]:
    """Every sample name a scrape can show (counters' _total, histograms' _bucket/_sum/_count)."""
    registry = CollectorRegistry()
    engine, service = EngineFamilies(registry), ServiceFamilies(registry)
    names = set()
    for family in [*vars(engine).values(), *vars(service).values()]:
        for metric in getattr(family, "describe", lambda: [])():
            kind, base = metric.type, metric.name
            if kind == "counter":
                names.add(base + "_total")
            elif kind == "histogram":
                names.update(base + s for s in ("_bucket", "_sum", "_count"))
            else:
                names.add(base)
    return names


def queries(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_every_query_names_an_exported_metric(dashboard: dict[str, Any]) -> None:
    known = exported_names()
    used = {m for expr in queries(dashboard) for m in METRIC.findall(expr)}
    assert used and used - known == set()


def test_every_promised_metric_has_a_panel(dashboard: dict[str, Any]) -> None:
    text = " ".join(queries(dashboard))
    missing = [name for name in PROMISED if f"inflight:{name}" not in text]
    assert missing == []


def test_layout_and_datasource(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        for target in panel.get("targets", []):
            # A templated data source: the same JSON works in compose and in a cluster's Grafana.
            assert target["datasource"]["uid"] == "${datasource}"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"


def test_the_chart_ships_the_dashboard() -> None:
    pytest.importorskip("helm_python")
    from tests.deploy.support import manifests, render_chart

    objs = manifests(render_chart({"grafanaDashboard": {"enabled": True}}))
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["inflight.json"]) == json.loads(DASHBOARD.read_text())
    off = manifests(render_chart())
    assert not [o for o in off if o["metadata"]["name"].endswith("-dashboard")]
