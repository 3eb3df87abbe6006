"""``crossflowctl get nodes|leases|reservations|pools`` with -o, --watch, -l and --role."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import click

from crossflow_ctl.cli.api import BrokerSession
from crossflow_ctl.cli.common import complete_node, output_option, run, state
from crossflow_ctl.cli.exit_codes import CliError, ExitCode
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


class NotFoundNames(CliError):
    """Some names a ``get`` asked for do not exist; what was found is printed first."""

    def __init__(self, kind: str, missing: Sequence[str], text: str) -> None:
        listed = ", ".join(repr(n) for n in missing)
        super().__init__(
            f"{kind} not found: {listed} (`crossflowctl get {kind}` lists them)",
            ExitCode.NOT_FOUND,
        )
        self.text = text
        """The listing of the names that were found ("" when none was)."""


def _picked(
    rows: list[dict[str, Any]], names: Sequence[str], kind: str, render: Callable[..., str]
) -> str:
    """The rows named ``names`` (all of them without names), in the order asked, rendered;
    NotFoundNames when some name has no row."""
    if not names:
        return render(rows)
    by_name = {r["name"]: r for r in rows}
    asked = list(dict.fromkeys(names))
    missing = [n for n in asked if n not in by_name]
    found = [by_name[n] for n in asked if n in by_name]
    if missing:
        raise NotFoundNames(kind, missing, render(found) if found else "")
    return render(found)


async def _nodes_text(
    session: BrokerSession,
    fmt: OutputFormat,
    role: str | None,
    selector: str,
    leases: bool,
    names: Sequence[str] = (),
) -> str:
    if names:
        nodes, missing = await session.find_nodes(names)
    else:
        nodes, missing = await session.list_nodes(NodeRole(role) if role else None, selector), []
    at = now_ms()
    if leases:
        rows = [r for r in (lease_row(n, at) for n in nodes) if r is not None]
        kind, columns, list_kind = "leases", LEASE_COLUMNS, "LeaseList"
    else:
        reporting: frozenset[tuple[str, str]] = frozenset()
        if any(n.state.info.role is NodeRole.PREFILL for n in nodes):
            reporting = reporting_nodes(await session.list_pools())
        rows = [node_row(n, at, reporting) for n in nodes]
        kind, columns, list_kind = "nodes", NODE_COLUMNS, "NodeList"

    def render(picked: list[dict[str, Any]]) -> str:
        return render_list(picked, columns, fmt, kind=list_kind)

    try:
        return _picked(rows, names, kind, render)
    except NotFoundNames as exc:
        if missing:  # unknown to the broker, not merely without a lease
            raise NotFoundNames("nodes", missing, exc.text) from None
        raise


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
            try:
                text = await render(session)
            except NotFoundNames as exc:
                if exc.text:  # what was found, then the one-line error (as kubectl does)
                    click.echo(exc.text)
                raise
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
    @click.argument("names", nargs=-1, metavar="[NAME]...", shell_complete=complete_node)
    @_watch_options
    @_filter_options
    @click.pass_context
    def command(
        ctx: click.Context,
        names: tuple[str, ...],
        output: str | None,
        watch: bool,
        interval: float,
        watch_count: int,
        selector: str,
        role: str | None,
    ) -> None:
        if names and (selector or role):
            raise click.UsageError("give node names, or -l/--role to choose nodes: not both")
        fmt = state(ctx).output(output)

        async def render(session: BrokerSession) -> str:
            return await _nodes_text(session, fmt, role, selector, leases=leases, names=names)

        _run_listing(ctx, render, watch, interval, watch_count)


_node_listing(
    "nodes",
    """Every node (or those named) with its status, latest lease and what it has left to lend.

    \b
    AVAIL-COMPUTE, AVAIL-KV, AVAIL-SLOTS (and -o wide's AVAIL-OUTPUT,
    AVAIL-KV-XFER-BYTES): what the broker would lend now, the latest lease's
    credit x the policy's borrow share, minus the open reservations' debits
    (0 when the lease is zero, expired or cordoned). `get leases` shows the
    credits as the agent sent them. AGE: time since the node registered (its
    first agent Hello; kept across agent restarts until the node is deleted;
    <none> when an older broker registered it). An unknown NAME is an error
    (exit 3), after the rows of the names found.""",
    leases=False,
)
_node_listing(
    "leases",
    """The latest lease of every node that sent one (or of those named).

    \b
    COMPUTE, KV, OUTPUT, SLOTS: the lease's credits as its agent sent them,
    before the borrow share and open debits (`get nodes` shows what is left
    to lend). A NAME unknown to the broker, or that has sent no lease, is an
    error (exit 3), after the rows of the names found.""",
    leases=True,
)


@get.command("reservations")
@click.argument("ids", nargs=-1, metavar="[ID]...")
@_watch_options
@click.option(
    "--node", default=None, shell_complete=complete_node, help="Only this node's reservations."
)
@click.pass_context
def get_reservations(
    ctx: click.Context,
    ids: tuple[str, ...],
    output: str | None,
    watch: bool,
    interval: float,
    watch_count: int,
    node: str | None,
) -> None:
    """Open reservations (held, committed, released-not-yet-seen), or those with the IDs given
    (an ID not open is an error, exit 3, after the rows of those found)."""
    fmt = state(ctx).output(output)

    async def render(session: BrokerSession) -> str:
        items = await session.list_reservations(node)
        at = now_ms()
        rows = [{"name": r.reservation_id, **reservation_row(r, at)} for r in items]

        def table(picked: list[dict[str, Any]]) -> str:
            out = [{k: v for k, v in r.items() if k != "name"} for r in picked]
            return render_list(out, RESERVATION_COLUMNS, fmt, kind="ReservationList")

        return _picked(rows, ids, "reservations", table)

    _run_listing(ctx, render, watch, interval, watch_count)


@get.command("pools")
@click.argument("names", nargs=-1, metavar="[NAME]...")
@_watch_options
@click.pass_context
def get_pools(
    ctx: click.Context,
    names: tuple[str, ...],
    output: str | None,
    watch: bool,
    interval: float,
    watch_count: int,
) -> None:
    """Prefill pools (or those named): live load reports, outstanding work and estimated
    wait. A pool with no live report is not listed: naming one is an error (exit 3)."""
    fmt = state(ctx).output(output)

    async def render(session: BrokerSession) -> str:
        rows = [pool_row(p) for p in await session.list_pools()]

        def table(picked: list[dict[str, Any]]) -> str:
            return render_list(picked, POOL_COLUMNS, fmt, kind="PoolList")

        return _picked(rows, names, "pools", table)

    _run_listing(ctx, render, watch, interval, watch_count)
