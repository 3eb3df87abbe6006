"""What the alert rules and the dashboard may name: the metrics the broker, the agents and the
gateway really export, with their labels, and the selectors a PromQL expression uses.

:func:`exported` renders the processes' own instrument holders (``BrokerMetrics``,
``AgentMetrics`` through OpenTelemetry's Prometheus reader, as ``setup_metrics`` serves them;
``GatewayMetrics``' registry) and reads back every sample name with its label names, and the
label values the broker and agent series carry from the start. :func:`selectors` walks an
expression with promql-parser (Prometheus's grammar) and returns each vector selector and the
grouping labels of the aggregations around it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import promql_parser
import yaml
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from crossflow_ctl.domain.admission import Decision, Reason
from crossflow_ctl.domain.models import Credits
from crossflow_ctl.gateway.metrics import GatewayMetrics
from crossflow_ctl.observability import AgentMetrics, BrokerMetrics

ROOT = Path(__file__).resolve().parents[1]
RULES_FILE = ROOT / "deploy" / "helm" / "crossflow" / "rules" / "alerts.yaml"
DASHBOARD_FILE = ROOT / "deploy" / "helm" / "crossflow" / "dashboards" / "crossflow.json"

TARGET_LABELS = frozenset({"namespace", "instance", "job", "pod", "service", "node"})
"""Labels Prometheus (or the chart's ServiceMonitors) put on every scraped series; ``node`` is
the agents' (the ServiceMonitor relabels the pod's node onto it)."""
UP_LABELS = TARGET_LABELS | {"crossflow_component"}
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
_WORDS = re.compile(r"^[A-Za-z0-9_]+(\|[A-Za-z0-9_]+)*$")


@dataclass
class Catalog:
    labels: dict[str, set[str]] = field(default_factory=dict)
    """Sample name -> its label names (le included for _bucket)."""
    values: dict[str, dict[str, set[str]]] = field(default_factory=dict)
    """Sample name -> label -> the values its series carry from the start (broker, agents)."""


def _read(text: str, catalog: Catalog, *, keep_values: bool) -> None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            catalog.labels.setdefault(sample.name, set()).update(sample.labels)
            if keep_values:
                per = catalog.values.setdefault(sample.name, {})
                for k, v in sample.labels.items():
                    per.setdefault(k, set()).add(v)


@cache
def exported() -> Catalog:
    catalog = Catalog()
    registry = CollectorRegistry(auto_describe=True)
    reader = PrometheusMetricReader(scope_info_enabled=False, registry=registry)
    provider = MeterProvider(metric_readers=[reader])
    try:
        broker = BrokerMetrics(provider)
        broker.record_admission(Decision.BORROW, Reason.BORROWED, 0.001)
        broker.record_store_operation("debit", 0.001)
        broker.record_lease("accepted")
        broker.set_open_reservations(1)
        broker.set_borrowed_tokens(1)
        broker.set_node_credits("n", Credits(slots=1))
        broker.set_node_load("n", itl_ms=20.0, itl_slo_ms=50.0, open_reservations=1)
        broker.stream_opened()
        agent = AgentMetrics(provider)
        agent.record_scrape(0.01)
        agent.record_lease_sent(Credits(slots=1))
        agent.stream_connected()
        text = generate_latest(registry).decode()
    finally:
        provider.shutdown()
    _read(text, catalog, keep_values=True)
    for name in [n for n in catalog.values if n not in ("target_info",)]:
        # Per-node series carry whatever node ids a cluster has.
        catalog.values[name].pop("node", None)
    catalog.labels.pop("target_info", None)

    gateway = GatewayMetrics()
    for metric in gateway.registry._collector_to_names:  # the declared label names
        names: tuple[str, ...] = getattr(metric, "_labelnames", ())
        child: Any = metric.labels(*("x" for _ in names)) if names else metric
        for method in ("inc", "observe", "set"):
            if hasattr(child, method):
                getattr(child, method)(1)
                break
    _read(gateway.render().decode(), catalog, keep_values=False)
    return catalog


@dataclass(frozen=True)
class Selector:
    metric: str
    matchers: tuple[tuple[str, str, str], ...]
    """(label, op, value), op one of = != =~ !~."""
    grouping: tuple[str, ...]
    """Labels the enclosing aggregations group by."""

    @property
    def text(self) -> str:
        inner = ", ".join(f'{k}{op}"{v}"' for k, op, v in self.matchers)
        return f"{self.metric}{{{inner}}}" if inner else self.metric


_OPS = {"Equal": "=", "NotEqual": "!=", "Re": "=~", "NotRe": "!~"}


def parse(expr: str) -> promql_parser.Expr:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    return promql_parser.parse(expr)


def selectors(expr: str) -> list[Selector]:
    """Every vector selector of ``expr``, with the ``by`` labels of its aggregations."""
    found: list[Selector] = []

    def visit(node: Any, grouping: tuple[str, ...]) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = tuple(
                (m.name, _OPS[str(m.op).rsplit(".", 1)[-1]], m.value)
                for m in node.matchers.matchers
                if m.name != "__name__"
            )
            found.append(Selector(node.name, matchers, grouping))
        elif isinstance(node, promql_parser.MatrixSelector):
            visit(node.vector_selector, grouping)
        elif isinstance(node, promql_parser.AggregateExpr):
            modifier = node.modifier
            by = tuple(modifier.labels) if modifier and str(modifier.type).endswith("By") else ()
            visit(node.expr, grouping + by)
        elif isinstance(node, promql_parser.BinaryExpr):
            visit(node.lhs, grouping)
            visit(node.rhs, grouping)
        elif isinstance(node, promql_parser.Call):
            for arg in node.args:
                visit(arg, grouping)
        elif isinstance(
            node, promql_parser.ParenExpr | promql_parser.UnaryExpr | promql_parser.SubqueryExpr
        ):
            visit(node.expr, grouping)

    visit(parse(expr), ())
    return found


def problems(expr: str, catalog: Catalog) -> list[str]:
    """What in ``expr`` names a metric, label or label value no process exports."""
    out = []
    for sel in selectors(expr):
        if sel.metric == "up":
            allowed = UP_LABELS
        elif sel.metric in catalog.labels:
            allowed = catalog.labels[sel.metric] | TARGET_LABELS
        else:
            out.append(f"{sel.metric}: not exported")
            continue
        known = catalog.values.get(sel.metric, {})
        for label, _op, value in sel.matchers:
            if label not in allowed:
                out.append(f"{sel.text}: no label {label}")
            elif label in known and _WORDS.match(value):  # plain words, or a|b|c
                missing = set(value.split("|")) - known[label]
                if missing:
                    out.append(f"{sel.text}: {label} is never {sorted(missing)}")
        for label in sel.grouping:
            if label not in allowed | {"le"}:
                out.append(f"{sel.text}: grouped by {label}, which it does not carry")
    return out


def rule_exprs() -> dict[str, str]:
    """Alert name -> expression, from the rules file."""
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return {r["alert"]: r["expr"] for g in groups for r in g["rules"]}


def rule_selectors() -> list[Selector]:
    return [s for expr in rule_exprs().values() for s in selectors(expr)]
