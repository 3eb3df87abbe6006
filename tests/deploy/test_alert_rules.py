"""The alert rules (deploy/helm/crossflow/rules/alerts.yaml) as the chart ships them: promtool
checks them and runs their unit tests (tests/deploy/alerts.test.yaml: each alert fires on
synthetic series and clears); every alert has a runbook section and a unit test; every metric,
label and label value a rule names is one the processes export."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_helm_chart import ROOT, needs_helm, render
from tests.promql_catalog import RULES_FILE, exported, problems, rule_exprs

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not found: install Debian's prometheus package (.ci/run installs it)",
)
PROMETHEUS_RULE_API = "monitoring.coreos.com/v1/PrometheusRule"
UNIT_TESTS = Path(__file__).resolve().parent / "alerts.test.yaml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
DEFAULT_RUNBOOKS = "https://github.com/crossflow/crossflow/blob/main/docs/runbooks.md"


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def prometheus_rules(*args: str) -> list[dict[str, Any]]:
    return [d for d in render(*args) if d["kind"] == "PrometheusRule"]


def alerts_of(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for g in spec["groups"] for r in g["rules"] if "alert" in r]


def test_rules_name_only_exported_metrics_labels_and_values() -> None:
    catalog = exported()
    found = {alert: problems(expr, catalog) for alert, expr in rule_exprs().items()}
    assert {a: p for a, p in found.items() if p} == {}


@needs_promtool
def test_promtool_checks_the_rules_file() -> None:
    result = promtool("check", "rules", str(RULES_FILE), cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    print(result.stdout)


@needs_helm
def test_the_chart_ships_the_rules_file_as_a_prometheus_rule() -> None:
    (rule,) = prometheus_rules("--api-versions", PROMETHEUS_RULE_API)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["name"] == "cf-crossflow-alerts"
    assert rule["spec"] == yaml.safe_load(RULES_FILE.read_text())  # one source

    moved = "https://runbooks.example.com/crossflow.md"
    (rule,) = prometheus_rules(
        "--set", "observability.prometheusRule.force=true",
        "--set", f"observability.prometheusRule.runbookUrl={moved}",
        "--set", "observability.prometheusRule.labels.release=kube-prometheus",
    )  # fmt: skip
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"
    for alert in alerts_of(rule["spec"]):
        assert alert["annotations"]["runbook_url"] == f"{moved}#{alert['alert'].lower()}"


@needs_helm
def test_no_prometheus_rule_without_the_crd_unless_forced_or_when_disabled() -> None:
    assert prometheus_rules() == []
    assert len(prometheus_rules("--set", "observability.prometheusRule.force=true")) == 1
    off = ("--set", "observability.prometheusRule.enabled=false")
    assert prometheus_rules(*off, "--api-versions", PROMETHEUS_RULE_API) == []


@needs_helm
def test_service_monitors_label_targets_as_the_rules_expect() -> None:
    docs = render("--api-versions", "monitoring.coreos.com/v1/ServiceMonitor")
    components = {}
    for doc in docs:
        if doc["kind"] != "ServiceMonitor":
            continue
        (endpoint,) = doc["spec"]["endpoints"]
        relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
        components[doc["metadata"]["name"]] = relabel["crossflow_component"]["replacement"]
    assert components == {"cf-crossflow-broker": "broker", "cf-crossflow-agent-metrics": "agent"}
    pattern = re.compile(r'crossflow_component="(\w+)"')
    selected = {m for expr in rule_exprs().values() for m in pattern.findall(expr)}
    assert selected == {"broker", "agent"}


def test_every_alert_has_a_runbook_section_and_its_link() -> None:
    spec = yaml.safe_load(RULES_FILE.read_text())
    headings = {
        line.removeprefix("## ").strip()
        for line in RUNBOOKS.read_text().splitlines()
        if line.startswith("## ")
    }
    for alert in alerts_of(spec):
        name = alert["alert"]
        assert name in headings, f"docs/runbooks.md has no '## {name}' section"
        assert alert["annotations"]["runbook_url"] == f"{DEFAULT_RUNBOOKS}#{name.lower()}"
        assert alert["labels"]["severity"] in ("critical", "warning", "info")
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]


def test_every_alert_has_unit_tests_that_fire_and_clear_it() -> None:
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    fired: set[str] = set()
    cleared: set[str] = set()
    for test in tests:
        for case in test.get("alert_rule_test", []):
            (fired if case["exp_alerts"] else cleared).add(case["alertname"])
    names = set(rule_exprs())
    assert names - fired == set(), "alerts no unit test fires"
    assert names - cleared == set(), "alerts no unit test sees clear"


@needs_promtool
@needs_helm
def test_promtool_unit_tests_on_the_rendered_rules(tmp_path: Path) -> None:
    (rule,) = prometheus_rules("--api-versions", PROMETHEUS_RULE_API)
    (tmp_path / "alerts.rules.yaml").write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    checked = promtool("check", "rules", "alerts.rules.yaml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    result = promtool("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    print(checked.stdout + result.stdout)
