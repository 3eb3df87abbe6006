"""Generate the Grafana dashboard deploy/helm/crossflow/dashboards/crossflow.json.

Built with grafana-foundation-sdk (Grafana's own typed builders); the chart ships the JSON in a
ConfigMap for Grafana's dashboard sidecar (templates/grafana-dashboard.yaml). Every query names
only metrics the broker, the agents and the gateway export: tests/deploy/test_dashboard.py
parses each one and checks it against the exported names and labels.

    python scripts/gen_dashboard.py           # write the JSON
    python scripts/gen_dashboard.py --check   # exit 1 when the committed file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import GraphDrawStyle, StackingMode, TimeZoneBrowser
from grafana_foundation_sdk.models.dashboard import DataSourceRef

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_FILE = ROOT / "deploy" / "helm" / "crossflow" / "dashboards" / "crossflow.json"
UID = "crossflow-overview"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
CREDIT_UNITS = {
    "compute_tokens": "short",
    "kv_tokens": "short",
    "kv_transfer_bytes": "bytes",
    "output_tokens": "short",
    "slots": "short",
}
"""Each credit in its own unit (crossflow_ctl.domain.models.CREDIT_NAMES)."""


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Graph:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    width: int = 12
    stacked: bool = False
    bars: bool = False


def quantiles(metric: str, by: str, what: str) -> tuple[Query, ...]:
    """p50 and p99 of a histogram, per ``by`` (a label list, may be empty)."""
    group = f"{by}, le" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket[{RATE}])))",
            f"{legend}p{int(q * 100)} {what}".strip(),
        )
        for q in (0.5, 0.99)
    )


def credit_graph(credit: str) -> Graph:
    return Graph(
        title=f"Fleet lending: {credit}",
        description=(
            f"{credit} offered by the decode nodes' latest leases (agents) and still available "
            "to borrow (lease x share - open debits, as the broker sees it)."
        ),
        queries=(
            Query(f'sum(crossflow_agent_lease_credits{{credit="{credit}"}})', "offered"),
            Query(
                "sum(max by (node) "
                f'(crossflow_broker_node_available_credits{{credit="{credit}"}}))',
                "available",
            ),
        ),
        unit=CREDIT_UNITS[credit],
        width=8,
    )


ROWS: tuple[tuple[str, tuple[Graph, ...]], ...] = (
    (
        "Lending",
        (
            Graph(
                "Decode nodes by lease state",
                "What each decode node's latest lease says: lending, or why it lends nothing "
                "(its zero reason, expired, no_lease). Broker replicas share one store: max over "
                "them.",
                (Query("max by (state) (crossflow_broker_decode_nodes)", "{{state}}"),),
                stacked=True,
            ),
            Graph(
                "Borrowed share",
                "Share of Admit answers that borrowed (broker), and of requests the gateway sent "
                "on the borrowed path.",
                (
                    Query(
                        f'sum(rate(crossflow_broker_admissions_total{{decision="borrow"}}[{RATE}]))'
                        f" / sum(rate(crossflow_broker_admissions_total[{RATE}]))",
                        "Admit: borrow",
                    ),
                    Query(
                        f'sum(rate(crossflow_gateway_requests_total{{path="borrowed"}}[{RATE}]))'
                        f" / sum(rate(crossflow_gateway_requests_total[{RATE}]))",
                        "gateway: borrowed path",
                    ),
                ),
                unit="percentunit",
            ),
            *(credit_graph(c) for c in CREDIT_UNITS),
        ),
    ),
    (
        "Admission",
        (
            Graph(
                "Admit decisions by reason",
                "Admit answers per second, by decision and reason (store_unavailable and "
                "timeout: failing closed).",
                (
                    Query(
                        "sum by (decision, reason) "
                        f"(rate(crossflow_broker_admissions_total[{RATE}])) > 0",
                        "{{decision}} {{reason}}",
                    ),
                ),
                unit="reqps",
                stacked=True,
            ),
            Graph(
                "Admit latency",
                "Time to answer one Admit, at the broker.",
                quantiles("crossflow_broker_admission_duration_seconds", "", "Admit"),
                unit="s",
            ),
        ),
    ),
    (
        "Latency",
        (
            Graph(
                "TTFT by path (gateway)",
                "From a request's arrival at the gateway to the engine's first byte, by the path "
                "it took: borrowed (prefilled on a decode node) or normal (P/D).",
                quantiles("crossflow_gateway_ttft_seconds", "path", "TTFT"),
                unit="s",
            ),
            Graph(
                "ITL against SLO per node",
                "Each decode node's ITL and its SLO, from its latest live lease.",
                (
                    Query("max by (node) (crossflow_broker_node_itl_seconds)", "{{node}} ITL"),
                    Query("max by (node) (crossflow_broker_node_itl_slo_seconds)", "{{node}} SLO"),
                ),
                unit="s",
            ),
            Graph(
                "Gateway added latency",
                "From arrival to the first engine hop (tokenize, Admit, Commit), time held by late "
                "binding excluded.",
                quantiles("crossflow_gateway_overhead_seconds", "", "overhead"),
                unit="s",
            ),
            Graph(
                "Borrowed work per node",
                "Reservations that still count on each decode node.",
                (
                    Query(
                        "max by (node) (crossflow_broker_node_open_reservations)",
                        "{{node}}",
                    ),
                ),
                stacked=True,
            ),
        ),
    ),
    (
        "Reservations and store",
        (
            Graph(
                "Reservations open",
                "Reservations that still count (broker, store-wide), and those the gateways "
                "committed and have not released.",
                (
                    Query("max(crossflow_broker_open_reservations)", "broker"),
                    Query("sum(crossflow_gateway_reservations_open)", "gateways"),
                ),
            ),
            Graph(
                "Reservation events",
                "Commits, releases, expiries (held past their TTL) and late commits/releases, "
                "per second.",
                (
                    Query(
                        f"sum by (event) (rate(crossflow_broker_reservation_events_total[{RATE}]))",
                        "{{event}}",
                    ),
                ),
                unit="ops",
            ),
            Graph(
                "Store latency (p99) by operation",
                "Time of one store (Redis) operation at the brokers.",
                (
                    Query(
                        "histogram_quantile(0.99, sum by (operation, le) "
                        "(rate(crossflow_broker_store_operation_duration_seconds_bucket"
                        f"[{RATE}])))",
                        "{{operation}}",
                    ),
                ),
                unit="s",
            ),
            Graph(
                "Store errors by operation",
                "Store operations that failed or timed out, per second.",
                (
                    Query(
                        "sum by (operation) "
                        f"(rate(crossflow_broker_store_errors_total[{RATE}])) > 0",
                        "{{operation}}",
                    ),
                ),
                unit="ops",
            ),
        ),
    ),
    (
        "Processes",
        (
            Graph(
                "Brokers and agents",
                "Broker replicas up, lease streams open on the brokers, and agents whose stream "
                "is up.",
                (
                    Query('sum(up{crossflow_component="broker"})', "broker replicas up"),
                    Query("sum(crossflow_broker_stream_connections)", "streams on brokers"),
                    Query("sum(crossflow_agent_stream_connected)", "agents connected"),
                ),
            ),
            Graph(
                "Gateway requests",
                "Requests per second by path and HTTP status.",
                (
                    Query(
                        f"sum by (path, code) (rate(crossflow_gateway_requests_total[{RATE}]))",
                        "{{path}} {{code}}",
                    ),
                ),
                unit="reqps",
                stacked=True,
            ),
        ),
    ),
)


def panel(graph: Graph) -> timeseries.Panel:
    p = (
        timeseries.Panel()
        .title(graph.title)
        .description(graph.description)
        .datasource(DATASOURCE)
        .unit(graph.unit)
        .span(graph.width)
        .height(8)
        .fill_opacity(10)
        .line_width(1)
    )
    if graph.stacked:
        p = p.stacking(common_builders.StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(40)
    if graph.bars:
        p = p.draw_style(GraphDrawStyle.BARS)
    for i, q in enumerate(graph.queries):
        p = p.with_target(
            prometheus.Dataquery()
            .expr(q.expr)
            .legend_format(q.legend)
            .ref_id(chr(ord("A") + i))
            .datasource(DATASOURCE)
        )
    return p


def build() -> dict[str, Any]:
    board = (
        dash.Dashboard("Crossflow")
        .uid(UID)
        .description(
            "Crossflow control plane: decode nodes lending spare room to prompt work. Alerts and "
            "runbooks: deploy/helm/crossflow/rules/alerts.yaml, docs/runbooks.md."
        )
        .tags(["crossflow", "generated"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone(TimeZoneBrowser)
        .with_variable(
            dash.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
    )
    for title, graphs in ROWS:
        board = board.with_row(dash.Row(title))
        for graph in graphs:
            board = board.with_panel(panel(graph))
    out: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return out


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = DASHBOARD_FILE.read_text(encoding="utf-8") if DASHBOARD_FILE.exists() else ""
        if current != text:
            print(
                f"{DASHBOARD_FILE.relative_to(ROOT)} is stale: run python scripts/gen_dashboard.py",
                file=sys.stderr,
            )
            return 1
        return 0
    DASHBOARD_FILE.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD_FILE.write_text(text, encoding="utf-8")
    print(f"wrote {DASHBOARD_FILE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
