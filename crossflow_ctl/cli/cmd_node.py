"""``describe node`` (and ``describe pool``, from cmd_pool), ``delete node``, ``cordon``,
``uncordon`` and ``drain``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import click

from crossflow_ctl.cli.cmd_pool import describe_pool
from crossflow_ctl.cli.common import complete_node, output_option, run, state
from crossflow_ctl.cli.exit_codes import CliError, ExitCode
from crossflow_ctl.cli.output import Column, cell, key_values, render_object, table
from crossflow_ctl.cli.views import (
    RESERVATION_COLUMNS,
    age,
    age_s,
    credits_dict,
    duration,
    node_row,
    now_ms,
    reservation_row,
)
from crossflow_ctl.client import NodeDetailView, reporting_nodes
from crossflow_ctl.domain.models import CREDIT_NAMES, NodeRole, PoolLoad, PoolSnapshot
from crossflow_ctl.domain.online_calibration import StepModelReport

CREDIT_COLUMNS = [
    Column("CREDIT", "credit"),
    Column("LEASE", "lease"),
    Column("OPEN-DEBITS", "debits"),
    Column("AVAILABLE", "available"),
]
HISTORY_COLUMNS = [
    Column("EPOCH/VERSION", "ev"),
    Column("SNAPSHOT", "age"),
    Column("COMPUTE", "compute_tokens"),
    Column("KV", "kv_tokens"),
    Column("SLOTS", "slots"),
    Column("ZERO-REASON", "zero_reason"),
]
DEFAULT_CORDON_REASON = "cordoned by crossflowctl"
EVENT_COLUMNS = [
    Column("AGE", "age_s", text=lambda row: duration(row["age_s"])),
    Column("KIND", "kind"),
    Column("MESSAGE", "message"),
]
STEP_MODEL_COLUMNS = [
    Column("CONSTANT", "constant"),
    Column("PRIOR", "prior", text=lambda row: _number(row["prior"])),
    Column("FITTED", "fitted", text=lambda row: _number(row["fitted"])),
    Column("IN-USE", "active", text=lambda row: _number(row["active"])),
    Column("FITTED/PRIOR", "ratio", text=lambda row: _number(row["ratio"], "{:.3g}x")),
]


def _number(value: float | None, fmt: str = "{:.4g}") -> str:
    return "<none>" if value is None else fmt.format(value)


def step_model_rows(report: StepModelReport) -> list[dict[str, Any]]:
    """One row per constant: the prior's, the last fit's and the one leases use now."""
    rows = []
    for name in sorted({*report.prior, *report.fitted, *report.active}):
        prior, fitted = report.prior.get(name), report.fitted.get(name)
        ratio = fitted / prior if fitted is not None and prior else None
        rows.append(
            {"constant": name, "prior": prior, "fitted": fitted,
             "active": report.active.get(name), "ratio": ratio}
        )  # fmt: skip
    return rows


def _step_model_text(report: StepModelReport | None, at: int) -> str:
    """A decode node's online calibration, as its agent last told the broker."""
    if report is None:
        return "Step model:  <none> (the node's agent sent no calibration)"
    status = report.fit_status.value if report.fit_status is not None else "<no fit yet>"
    head = key_values(
        [
            ("Using", report.using.value),
            ("Prior", report.prior_name or "<unnamed>"),
            ("Fit", status + (f": {report.detail}" if report.detail else "")),
            ("Fit error", f"{report.fit_error:.1%} (prior's {report.prior_error:.1%})"),
            ("Windows / periods", f"{report.windows} / {report.periods}"),
            ("Reported", f"{age(report.at_unix_ms, at)} ago" if report.at_unix_ms else "<none>"),
        ],
        indent=2,
    )
    rows = table(step_model_rows(report), STEP_MODEL_COLUMNS, wide=False)
    return "Step model:\n" + head + "\n" + _indent(rows)


def load_report(detail: NodeDetailView, pools: Sequence[PoolSnapshot]) -> PoolLoad | None:
    """A prefill node's live load report in its own pool (None: none, or a decode node)."""
    info = detail.node.state.info
    if info.role is not NodeRole.PREFILL:
        return None
    reports = (r for p in pools if p.pool == info.pool for r in p.reports)
    return next((r for r in reports if r.node_id == info.node_id), None)


def detail_data(
    detail: NodeDetailView, at: int, pools: Sequence[PoolSnapshot] = ()
) -> dict[str, Any]:
    """``pools``: the live pool loads (a prefill node's status and load report come from
    them, as in ``get nodes``)."""
    report = load_report(detail, pools)
    view = detail.node
    node = view.state
    lease = node.lease.effective_credits(at) if node.lease else None
    available = view.available
    credits = [
        {
            "credit": name,
            "lease": getattr(lease, name) if lease is not None else 0,
            "debits": getattr(node.open_debits, name),
            "available": getattr(available, name),
        }
        for name in CREDIT_NAMES
    ]
    return {
        **node_row(view, at, reporting_nodes(list(pools))),
        "load_report": report.model_dump(mode="json") if report is not None else None,
        "credits": credits,
        "reservations": [reservation_row(r, at) for r in detail.reservations],
        "recent_leases": [lease.model_dump(mode="json") for lease in detail.recent_leases],
        "events": [
            {"at_ms": e.at_ms, "age_s": age_s(e.at_ms, at), "kind": e.kind, "message": e.message}
            for e in detail.events
        ],
        "step_model": (
            detail.step_model.model_dump(mode="json") if detail.step_model is not None else None
        ),
    }


def _itl_text(itl_ms: float) -> str:
    """A lease's ITL; 0 is the agent's "no decode step measured" (an idle node), not 0 ms."""
    return f"{itl_ms:.1f}" if itl_ms > 0 else "none measured (idle)"


def describe_text(detail: NodeDetailView, at: int, pools: Sequence[PoolSnapshot] = ()) -> str:
    data = detail_data(detail, at, pools)
    report = load_report(detail, pools)
    node = detail.node.state
    stored = node.lease
    head = [
        ("Name", data["name"]),
        ("Role", data["role"]),
        ("Pool", data["pool"]),
        ("Labels", data["labels"]),
        ("Registered", f"{duration(data['age_s'])} ago" if data["age_s"] is not None else "<none>"),
        ("Status", data["status"]),
        ("Cordoned", _cordon_text(detail)),
        ("Notice seq", node.info.notice_seq),
    ]
    parts = [key_values(head)]
    if node.info.role is NodeRole.PREFILL:
        parts += [_load_report_text(report), _events_text(data["events"])]
        return "\n".join(parts)
    if stored is None:
        parts.append("Latest lease:  <none> (the node's agent has not sent one)")
    else:
        lease = stored.lease
        reason = "<none>"
        if lease.zero_reason is not None:
            reason = lease.zero_reason.value + (
                f": {lease.zero_detail}" if lease.zero_detail else ""
            )
        elif stored.expired(at):
            reason = "expired (counts as zero)"
        parts.append(
            "Latest lease:\n"
            + key_values(
                [
                    ("Epoch/version", f"{lease.epoch}/{lease.version}"),
                    ("Received", f"{age(stored.received_at_ms, at)} ago"),
                    ("Expires in", f"{max(0, stored.expires_at_ms - at)} ms"),
                    ("Zero reason", reason),
                    ("Queue wait", f"{lease.queue_wait_ms:.1f} ms"),
                    ("Borrowed prefill rate", f"{lease.borrowed_prefill_rate_tps:.0f} tokens/s"),
                    ("ITL / SLO", f"{_itl_text(lease.itl_ms)} / {lease.itl_slo_ms:.1f} ms"),
                    ("Last notice seen", lease.last_notice_seq),
                ],
                indent=2,
            )
        )
    parts.append(_step_model_text(detail.step_model, at))
    parts.append("Credits:\n" + _indent(table(data["credits"], CREDIT_COLUMNS, wide=False)))
    res_rows = data["reservations"]
    parts.append(
        "Open reservations:"
        + (
            "\n" + _indent(table(res_rows, RESERVATION_COLUMNS, wide=True))
            if res_rows
            else "  <none>"
        )
    )
    hist = [
        {
            "ev": f"{lease.epoch}/{lease.version}",
            "age": f"{age(lease.snapshot_unix_ms, at)} ago" if lease.snapshot_unix_ms else "<none>",
            "zero_reason": lease.zero_reason.value if lease.zero_reason else "",
            **credits_dict(lease.credits),
        }
        for lease in detail.recent_leases
    ]
    parts.append(
        "Recent leases:"
        + ("\n" + _indent(table(hist, HISTORY_COLUMNS, wide=False)) if hist else "  <none>")
    )
    parts.append(_events_text(data["events"]))
    return "\n".join(parts)


def _events_text(events: list[dict[str, Any]]) -> str:
    body = "\n" + _indent(table(events, EVENT_COLUMNS, wide=False)) if events else "  <none>"
    return "Events:" + body


def _load_report_text(report: PoolLoad | None) -> str:
    """A prefill node's side of describe: it sends load reports to its pool, not leases."""
    if report is None:
        return (
            "Load report:  <none> (no live report from the node's agent: its pool's wait does "
            "not count it)"
        )
    return "Load report:\n" + key_values(
        [
            ("Outstanding", f"{report.outstanding_uncached_tokens} uncached tokens"),
            ("Queued requests", report.queued_requests),
            ("Processing rate", f"{report.processing_rate_tps:.0f} tokens/s"),
            ("Per-request rate", f"{report.prefill_rate_tps:.0f} tokens/s"),
            ("TTL", f"{report.ttl_ms} ms"),
        ],
        indent=2,
    )


def _cordon_text(detail: NodeDetailView) -> str:
    info = detail.node.state.info
    if not info.cordoned:
        return "no"
    reason = info.cordon_reason or next(
        (e.message.removeprefix("cordoned: ") for e in detail.events if e.kind == "cordon"), ""
    )
    return f"yes ({reason})" if reason else "yes"


def _indent(text: str, by: int = 2) -> str:
    return "\n".join(" " * by + line for line in text.splitlines())


@click.group()
def describe() -> None:
    """Show everything known about one resource."""


@describe.command("node")
@click.argument("name", shell_complete=complete_node)
@output_option()
@click.pass_context
def describe_node(ctx: click.Context, name: str, output: str | None) -> None:
    """Latest lease, credits and debits, zero-lease reason, history, reservations, events."""
    st = state(ctx)
    fmt = st.output(output)

    async def go() -> tuple[NodeDetailView, list[PoolSnapshot]]:
        async with st.session() as session:
            detail = await session.describe_node(name)
            if detail.node.state.info.role is not NodeRole.PREFILL:
                return detail, []
            return detail, await session.list_pools()

    detail, pools = run(go())
    at = now_ms()
    text = describe_text(detail, at, pools)
    click.echo(render_object(detail_data(detail, at, pools), fmt, text))


describe.add_command(describe_pool)


@click.group()
def delete() -> None:
    """Remove a resource."""


@delete.command("node")
@click.argument("name", shell_complete=complete_node)
@click.option("--force", is_flag=True, help="Delete even with open reservations.")
@click.pass_context
def delete_node(ctx: click.Context, name: str, force: bool) -> None:
    """Remove NAME and all its state (a node that has gone away). Refused while it has open
    reservations unless --force. An agent still streaming brings the node back at once: its
    next lease or load report ends its stream, and it reconnects and registers again."""
    st = state(ctx)

    async def go() -> int:
        async with st.session() as session:
            return await session.delete_node(name, force)

    dropped = run(go())
    extra = f" ({dropped} open reservation(s) dropped)" if dropped else ""
    click.echo(f"node/{name} deleted{extra}")


@click.command()
@click.argument("name", shell_complete=complete_node)
@click.option(
    "--reason",
    default=None,
    help="Why (shown in describe); on a cordoned node it replaces the reason. [default: "
    f"{DEFAULT_CORDON_REASON!r}]",
)
@click.pass_context
def cordon(ctx: click.Context, name: str, reason: str | None) -> None:
    """Stop lending from NAME: its lease counts as zero until uncordoned."""
    st = state(ctx)

    async def go() -> bool:
        async with st.session() as session:
            info = (await session.get_node(name)).state.info
            kept = info.cordon_reason if info.cordoned else ""  # a plain cordon again keeps it
            # Always sent, so the node is cordoned even if someone uncordoned it meanwhile.
            await session.cordon(
                name, reason if reason is not None else kept or DEFAULT_CORDON_REASON
            )
            return info.cordoned

    was_cordoned = run(go())
    click.echo(f"node/{name} {'already cordoned' if was_cordoned else 'cordoned'}")


@click.command()
@click.argument("name", shell_complete=complete_node)
@click.pass_context
def uncordon(ctx: click.Context, name: str) -> None:
    """Let NAME lend again."""
    st = state(ctx)

    async def go() -> bool:
        async with st.session() as session:
            was = (await session.get_node(name)).state.info.cordoned
            await session.uncordon(name)
            return was

    was_cordoned = run(go())
    click.echo(f"node/{name} {'uncordoned' if was_cordoned else 'already uncordoned'}")


@click.command()
@click.argument("name", shell_complete=complete_node)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0.0),
    default=60.0,
    show_default=True,
    help="Seconds to wait for open reservations to end (exit 5 after).",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.05),
    default=0.5,
    show_default=True,
    help="Seconds between checks.",
)
@click.pass_context
def drain(ctx: click.Context, name: str, timeout_s: float, interval: float) -> None:
    """Cordon NAME (its lease counts as zero), then wait until its open reservations are gone."""
    st = state(ctx)

    async def go() -> int:
        async with st.session() as session:
            if (await session.get_node(name)).state.info.cordoned:
                # keep the operator's cordon and its reason (a drain's "drain" overwrote it)
                click.echo(f"node/{name} already cordoned")
            else:
                await session.cordon(name, "drain")
                click.echo(f"node/{name} cordoned")
            deadline = time.monotonic() + timeout_s
            while True:
                node = await session.get_node(name)
                if node.state.open_reservations == 0:
                    return 0
                if time.monotonic() >= deadline:
                    return node.state.open_reservations
                await asyncio.sleep(interval)

    left = run(go())
    if left:
        raise CliError(
            f"node/{name} still has {left} open reservation(s) after {cell(timeout_s)} s",
            ExitCode.TIMEOUT,
        )
    click.echo(f"node/{name} drained")
