"""``describe pool``: a prefill pool's servers and load, and who lends against it at what share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from crossflow_ctl.cli.common import output_option, run, state
from crossflow_ctl.cli.exit_codes import CliError, ExitCode
from crossflow_ctl.cli.output import Column, key_values, render_object, table
from crossflow_ctl.cli.views import credits_dict, now_ms, pool_row
from crossflow_ctl.client import NodeView, reporting_nodes
from crossflow_ctl.domain.models import CREDIT_NAMES, Credits, NodeRole, PoolSnapshot
from crossflow_ctl.domain.policy import VersionedPolicy

SERVER_COLUMNS = [
    Column("NODE", "name"),
    Column("STATUS", "status"),
    Column("OUTSTANDING", "outstanding_uncached_tokens"),
    Column("QUEUED", "queued_requests"),
    Column("RATE-TPS", "processing_rate_tps"),
    Column("PREFILL-TPS", "prefill_rate_tps"),
    Column("WAIT-MS", "queue_wait_ms"),
]
LENDER_COLUMNS = [
    Column("NODE", "name"),
    Column("STATUS", "status"),
    Column("LEASE-COMPUTE", "lease_compute_tokens"),
    Column("DEBITED", "debited_compute_tokens"),
    Column("AVAIL-COMPUTE", "compute_tokens"),
    Column("OPEN", "open_reservations"),
]


def pool_data(
    name: str, pools: Sequence[PoolSnapshot], nodes: Sequence[NodeView], policy: VersionedPolicy
) -> dict[str, Any]:
    """The pool ``name``: its live load (``get pools``' row), its prefill servers with their
    load reports, the decode nodes of the pool with what they lend, and the policy's shares.
    CliError (exit 3) when the broker knows neither a live report nor a node of that pool."""
    at = now_ms()
    snapshot = next((p for p in pools if p.pool == name), None)
    members = [n for n in nodes if n.state.info.pool == name]
    if snapshot is None and not members:
        known = sorted({p.pool for p in pools} | {n.state.info.pool for n in nodes})
        raise CliError(
            f"pool {name!r} not found: no live load report and no node in it "
            f"(known: {', '.join(known) or 'none'})",
            ExitCode.NOT_FOUND,
        )
    snapshot = snapshot or PoolSnapshot(pool=name)
    reports = {r.node_id: r for r in snapshot.reports}
    reporting = reporting_nodes(list(pools))
    servers = []
    for view in members:
        if view.state.info.role is not NodeRole.PREFILL:
            continue
        report = reports.get(view.state.info.node_id)
        servers.append(
            {
                "name": view.state.info.node_id,
                "status": view.status(at, reporting),
                **(report.model_dump(mode="json", exclude={"node_id", "pool"}) if report else {}),
            }
        )
    lenders = []
    leased, debited = Credits(), Credits()
    for view in members:
        node = view.state
        if node.info.role is not NodeRole.DECODE:
            continue
        lease = node.lease.effective_credits(at) if node.lease else Credits()
        leased, debited = leased.plus(lease), debited.plus(node.open_debits)
        lenders.append(
            {
                "name": node.info.node_id,
                "status": view.status(at),
                "lease_compute_tokens": lease.compute_tokens,
                "debited_compute_tokens": node.open_debits.compute_tokens,
                "compute_tokens": view.available.compute_tokens,
                "open_reservations": node.open_reservations,
                "available": credits_dict(view.available),
            }
        )
    p = policy.policy
    return {
        **pool_row(snapshot),
        "servers": servers,
        "lenders": lenders,
        "borrowing": {
            "borrow_share": p.borrow_share,
            "borrow_kv_share": p.borrow_kv_share,
            "shares": dict(zip(CREDIT_NAMES, p.shares, strict=True)),
            "leased": credits_dict(leased),
            "debited": credits_dict(debited),
            "enabled": p.enabled,
            "shadow_mode": p.shadow_mode,
        },
        "demand_threshold_ms": p.demand_threshold_ms,
        "demand_prefill_ratio": p.demand_prefill_ratio,
        "policy_version": policy.version,
    }


def _share_of(debited: int, leased: int) -> str:
    return f"{100.0 * debited / leased:.1f}%" if leased else "-"


def pool_text(data: dict[str, Any]) -> str:
    b = data["borrowing"]
    wait = (
        "no rate (work outstanding, no server reports a rate)"
        if data["no_rate"]
        else "<none> (no live report)"
        if data["estimated_wait_ms"] is None
        else f"{data['estimated_wait_ms']:.0f} ms"
    )
    ratio = data["demand_prefill_ratio"]
    threshold = f"{data['demand_threshold_ms']:g} ms" + (
        f", or {ratio:g} x a prompt's own prefill time when lower" if ratio is not None else ""
    )
    mode = "" if b["enabled"] else " (borrowing disabled)"
    mode += " (shadow mode: decided, never granted)" if b["shadow_mode"] else ""
    leased, debited = b["leased"], b["debited"]
    head = [
        ("Name", data["name"]),
        ("Prefill servers", f"{len(data['servers'])}, {data['reporting_nodes']} reporting"),
        ("Outstanding", f"{data['outstanding_uncached_tokens']} uncached tokens"),
        ("Queued requests", data["queued_requests"]),
        ("Processing rate", f"{data['processing_rate_tps']:.0f} tokens/s"),
        ("Estimated wait", wait),
        ("Demand threshold", threshold),
        (
            "Borrow share",
            f"{b['borrow_share']:g} of compute, output, slots; {b['borrow_kv_share']:g} of kv, "
            f"kv_transfer (policy v{data['policy_version']}){mode}",
        ),
        (
            "Lent now",
            f"{debited['compute_tokens']} of {leased['compute_tokens']} leased compute tokens "
            f"({_share_of(debited['compute_tokens'], leased['compute_tokens'])}), "
            f"{sum(r['open_reservations'] for r in data['lenders'])} open reservations on "
            f"{len(data['lenders'])} decode nodes",
        ),
    ]
    parts = [key_values(head)]
    for title, rows, columns in (
        ("Servers", data["servers"], SERVER_COLUMNS),
        ("Decode nodes", data["lenders"], LENDER_COLUMNS),
    ):
        if not rows:
            parts.append(f"{title}:  <none>")
            continue
        body = table(rows, columns, wide=False).splitlines()
        parts.append(f"{title}:\n" + "\n".join("  " + line for line in body))
    return "\n".join(parts)


@click.command("pool")
@click.argument("name", default=None, required=False, metavar="[NAME]")
@output_option()
@click.pass_context
def describe_pool(ctx: click.Context, name: str | None, output: str | None) -> None:
    """A prefill pool (default: the context's): its servers and their load reports,
    outstanding tokens, processing rate and wait, the Demand threshold, the policy's borrow
    shares, and the decode nodes of the pool with what they have lent."""
    st = state(ctx)
    fmt = st.output(output)
    pool = st.pool(name)

    async def go() -> dict[str, Any]:
        async with st.session() as session:
            pools = await session.list_pools()
            nodes = await session.list_nodes(None, "")
            policy = await session.get_policy()
        return pool_data(pool, pools, nodes, policy)

    data = run(go())
    click.echo(render_object(data, fmt, pool_text(data)))
