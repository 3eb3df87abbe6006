"""The Grafana dashboard: generated from scripts/gen_dashboard.py (the committed JSON is not
stale), every panel's PromQL parses (promql-parser) and names only exported metrics, labels and
label values, and the chart ships it as a ConfigMap for Grafana's sidecar."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.deploy.test_helm_chart import ROOT, needs_helm, render
from tests.promql_catalog import DASHBOARD_FILE, exported, problems, selectors

# What the issue asks the dashboard to show, each by the metric that carries it.
REQUIRED = {
    "fleet lending by credit": "crossflow_broker_node_available_credits",
    "borrowed share": "crossflow_broker_admissions_total",
    "Admit decisions by reason": "crossflow_broker_admissions_total",
    "TTFT by path": "crossflow_gateway_ttft_seconds_bucket",
    "ITL per node": "crossflow_broker_node_itl_seconds",
    "ITL SLO per node": "crossflow_broker_node_itl_slo_seconds",
    "reservations open": "crossflow_broker_open_reservations",
    "store latency": "crossflow_broker_store_operation_duration_seconds_bucket",
}


def panels() -> list[dict[str, Any]]:
    board = json.loads(DASHBOARD_FILE.read_text())
    return [p for p in board["panels"] if p["type"] != "row"]


def test_committed_dashboard_is_what_the_generator_makes() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/gen_dashboard.py", "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_every_query_parses_and_names_exported_metrics() -> None:
    catalog = exported()
    found: dict[str, list[str]] = {}
    used: set[str] = set()
    for panel in panels():
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            found[f"{panel['title']}: {target['expr']}"] = problems(target["expr"], catalog)
            used.update(s.metric for s in selectors(target["expr"]))
    assert {k: v for k, v in found.items() if v} == {}
    assert {what: m for what, m in REQUIRED.items() if m not in used} == {}


def test_panels_have_titles_units_and_a_datasource_variable() -> None:
    board = json.loads(DASHBOARD_FILE.read_text())
    assert board["uid"] == "crossflow-overview"
    (variable,) = board["templating"]["list"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    for panel in panels():
        assert panel["title"] and panel["description"]
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["fieldConfig"]["defaults"]["unit"]


@needs_helm
def test_chart_ships_the_dashboard_for_grafanas_sidecar() -> None:
    (cm,) = [
        d
        for d in render()
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["crossflow.json"]) == json.loads(DASHBOARD_FILE.read_text())

    moved = render(
        "--set", "observability.grafanaDashboard.namespace=monitoring",
        "--set", "observability.grafanaDashboard.annotations.grafana_folder=Crossflow",
    )  # fmt: skip
    (cm,) = [d for d in moved if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Crossflow"}

    off = render("--set", "observability.grafanaDashboard.enabled=false")
    assert not [d for d in off if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]]
