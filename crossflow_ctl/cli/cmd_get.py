"""``crossflowctl get nodes|leases|reservations|pools`` with -o, --watch, -l and --role."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import click

from crossflow_ctl.cli.api import BrokerSession
from crossflow_ctl.cli.common import complete_node, output_option, run, state
from crossflow_ctl.cli.output import OutputFormat, render_list
from crossflow_ctl.cli.views import (
    LEASE_COLUMNS,
    NODE_COLUMNS,
    POOL_COLUMNS,
    RESERVATION_COLUMNS,
    lease_row,
    node_row,
    now_ms,
    pool_row,
    reservation_row,
)
from crossflow_ctl.client import reporting_nodes
from crossflow_ctl.domain.models import NodeRole

Render = Callable[[BrokerSession], Awaitable[str]]
CLEAR = "\x1b[H\x1b[2J"


async def _nodes_text(
    session: BrokerSession, fmt: OutputFormat, role: str | None, selector: str, leases: bool
) -> str:
    nodes = await session.list_nodes(NodeRole(role) if role else None, selector)
    at = now_ms()
    if leases:
        rows = [r for r in (lease_row(n, at) for n in nodes) if r is not None]
        return render_list(rows, LEASE_COLUMNS, fmt, kind="LeaseList")
    reporting: frozenset[tuple[str, str]] = frozenset()
    if any(n.state.info.role is NodeRole.PREFILL for n in nodes):
        reporting = reporting_nodes(await session.list_pools())
    rows = [node_row(n, at, reporting) for n in nodes]
    return render_list(rows, NODE_COLUMNS, fmt, kind="NodeList")


async def _watch(
    session_factory: Callable[[], BrokerSession],
    render: Render,
    interval_s: float,
    watch: bool,
    count: int,
) -> None:
    async with session_factory() as session:
        shown = 0
        while True:
            text = await render(session)
            if watch and sys.stdout.isatty():
                click.echo(CLEAR, nl=False)
            elif shown:
                click.echo("")
            click.echo(text)
            shown += 1
            if not watch or (count and shown >= count):
                return
            await asyncio.sleep(interval_s)


def _run_listing(
    ctx: click.Context, render: Render, watch: bool, interval: float, count: int
) -> None:
    if count and not watch:
        raise click.UsageError("--watch-count counts refreshes of a watch: add -w/--watch")
    st = state(ctx)
    try:
        run(_watch(st.session, render, interval, watch, count))
    except KeyboardInterrupt:
        if not watch:
            raise
        # Ctrl-C is how a watch ends: not an error.


def _watch_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option(
        "-w",
        "--watch",
        is_flag=True,
        help="Print again every --interval seconds, changed or not, until Ctrl-C or --watch-count.",
    )(func)
    func = click.option(
        "--interval",
        type=click.FloatRange(min=0.05),
        default=2.0,
        show_default=True,
        help="Seconds between refreshes with --watch.",
    )(func)
    func = click.option(
        "--watch-count",
        type=click.IntRange(min=0),
        default=0,
        help="Stop after this many refreshes (0: until Ctrl-C).",
    )(func)
    return output_option()(func)


def _filter_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("-l", "--selector", default="", help="Label selector, k=v,k2!=v2.")(func)
    func = click.option(
        "--role",
        type=click.Choice([r.value for r in NodeRole]),
        default=None,
        help="Only nodes of this role.",
    )(func)
    return func


@click.group()
def get() -> None:
    """List nodes, leases, reservations or pools."""


def _node_listing(name: str, doc: str, *, leases: bool) -> None:
    """Register ``get NAME``: nodes and leases are the same listing with different columns."""

    @get.command(name, help=doc)
    @_watch_options
    @_filter_options
    @click.pass_context
    def command(
        ctx: click.Context,
        output: str | None,
        watch: bool,
        interval: float,
        watch_count: int,
        selector: str,
        role: str | None,
    ) -> None:
        fmt = state(ctx).output(output)

        async def render(session: BrokerSession) -> str:
            return await _nodes_text(session, fmt, role, selector, leases=leases)

        _run_listing(ctx, render, watch, interval, watch_count)


_node_listing(
    "nodes", "Every node with its status, latest lease and what it has left to lend.", leases=False
)
_node_listing("leases", "The latest lease of every node that sent one.", leases=True)


@get.command("reservations")
@_watch_options
@click.option(
    "--node", default=None, shell_complete=complete_node, help="Only this node's reservations."
)
@click.pass_context
def get_reservations(
    ctx: click.Context,
    output: str | None,
    watch: bool,
    interval: float,
    watch_count: int,
    node: str | None,
) -> None:
    """Open reservations (held, committed, released-not-yet-seen)."""
    fmt = state(ctx).output(output)

    async def render(session: BrokerSession) -> str:
        items = await session.list_reservations(node)
        at = now_ms()
        rows = [reservation_row(r, at) for r in items]
        return render_list(rows, RESERVATION_COLUMNS, fmt, kind="ReservationList")

    _run_listing(ctx, render, watch, interval, watch_count)


@get.command("pools")
@_watch_options
@click.pass_context
def get_pools(
    ctx: click.Context, output: str | None, watch: bool, interval: float, watch_count: int
) -> None:
    """Prefill pools: live load reports, outstanding work and estimated wait."""
    fmt = state(ctx).output(output)

    async def render(session: BrokerSession) -> str:
        pools = await session.list_pools()
        return render_list([pool_row(p) for p in pools], POOL_COLUMNS, fmt, kind="PoolList")

    _run_listing(ctx, render, watch, interval, watch_count)
