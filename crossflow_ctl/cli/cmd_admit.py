"""``admit`` (decide and explain, condition by condition) and ``policy get|set``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from crossflow_ctl.cli.common import complete_node, output_option, run, state
from crossflow_ctl.cli.exit_codes import CliError, ExitCode
from crossflow_ctl.cli.output import Column, key_values, render_object, table
from crossflow_ctl.domain.admission import (
    Admission,
    AdmissionRequest,
    Decision,
    NodeCheck,
    Plan,
    Reason,
)
from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.models import validated
from crossflow_ctl.domain.policy import PolicySettings, VersionedPolicy

NODE_CHECK_COLUMNS = [
    Column("NODE", "node_id"),
    Column("VERDICT", "verdict"),
    Column("PREDICTED-MS", "predicted_ttft_ms"),
    Column("BENEFIT", "benefit"),
    Column("SAFE", "safe"),
    Column("SHORT-ON", "short_credits"),
    Column("DETAIL", "detail"),
]


def _holds(ok: bool) -> str:
    return "holds " if ok else "fails "


def _held(hold_ms: float) -> str:
    return f"held behind the router's queue {hold_ms:.1f} + " if hold_ms else ""


def priced(checks: Sequence[NodeCheck]) -> list[NodeCheck]:
    """The checks the policy priced: a node without a live lease (none, expired, zero,
    cordoned) is never priced, and its zero wait and service time mean nothing."""
    return [c for c in checks if c.verdict is not Reason.NO_LEASES]


def _short(c: NodeCheck) -> str:
    if c.short_credits:
        return f"{c.node_id} short on {', '.join(c.short_credits)}"
    return f"{c.node_id}: {c.detail}"


def conditions(plan: Plan, asked: Sequence[str] = ()) -> list[str]:
    """Demand, Benefit and Safety, each with the numbers behind it (DESIGN.md §4).

    ``asked``: the candidate nodes the caller named; those the broker does not know are said
    so (it plans only over known nodes)."""
    d = plan.demand
    lines = []
    if d.pool_wait_ms is None:
        source = f"prefill server {d.prefill_node_id}" if d.prefill_node_id else "prefill pool"
        lines.append(f"1. Demand   fails  no live load report from the {source}")
    else:
        cmp = ">" if d.holds else "<="
        wait = "unbounded (no rate)" if d.no_rate else f"{d.pool_wait_ms:.1f} ms"
        sent = (
            f" + {d.pending_uncached_tokens} sent since the reports"
            if d.pending_uncached_tokens
            else ""
        )
        if d.timed:
            server = d.prefill_node_id or "the least-loaded server"
            basis = (
                f"reported wait of {server}{sent} at {d.processing_rate_tps:.0f} tokens/s, "
                f"{d.reporting_nodes} reporting"
            )
        else:
            basis = (
                f"{d.outstanding_uncached_tokens} outstanding tokens"
                f"{sent} / {d.processing_rate_tps:.0f} tokens/s, {d.reporting_nodes} reporting"
            )
        lines.append(
            f"1. Demand   {_holds(d.holds)} prefill wait {wait} {cmp} threshold "
            f"{d.threshold_ms:.1f} ms ({basis})"
        )
    normal = plan.normal_path
    normal_text = (
        f"normal {normal.total_ms:.1f} ms ({_held(normal.hold_ms)}wait {normal.wait_ms:.1f} "
        f"+ prefill {normal.prefill_ms:.1f} + KV transfer {normal.kv_transfer_ms:.1f})"
        if normal
        else "normal path unknown"
    )
    with_benefit = [c for c in plan.nodes if c.benefit]
    best = min(priced(plan.nodes), key=lambda c: c.predicted_ttft_ms, default=None)
    known = {c.node_id for c in plan.nodes}
    unknown = [n for n in dict.fromkeys(asked) if n not in known]
    why = f" (unknown nodes, not planned: {', '.join(unknown)})" if unknown else ""
    if best is None:
        lines.append(f"2. Benefit  fails  no candidate node has a live lease{why}; {normal_text}")
        if plan.nodes:  # cordoned, zero, expired or no lease: say which
            lines.append(f"3. Safety   fails  {'; '.join(_short(c) for c in plan.nodes[:4])}")
        else:
            lines.append("3. Safety   fails  no candidate node")
        return lines
    pick = min(with_benefit, key=lambda c: c.predicted_ttft_ms) if with_benefit else best
    lines.append(
        f"2. Benefit  {_holds(bool(with_benefit))} {len(with_benefit)}/{len(plan.nodes)} nodes"
        f"{why} beat the normal path; best {pick.node_id} predicted "
        f"{pick.predicted_ttft_ms:.1f} ms (wait {pick.queue_wait_ms:.1f} + service "
        f"{pick.service_ms:.1f}) vs {normal_text}"
    )
    # Safety is judged on the nodes with Benefit; with none, on every node (on its own).
    judged = with_benefit or list(plan.nodes)
    safe = [c for c in judged if c.safe]
    if safe:
        node = min(safe, key=lambda c: c.predicted_ttft_ms)
        need = ", ".join(
            f"{k} {getattr(node.debit, k)}<={getattr(node.available, k)}"
            for k in ("compute_tokens", "kv_tokens", "output_tokens", "slots")
        )
        lines.append(f"3. Safety   holds  {node.node_id} has room on every credit ({need})")
    else:
        shorts = "; ".join(_short(c) for c in judged[:4])
        lines.append(f"3. Safety   fails  {shorts}")
    return lines


def would_borrow(a: Admission) -> bool:
    """A dry run answers NORMAL (nothing debited) but names the node it would have used."""
    return a.decision is Decision.BORROW or (a.reason is Reason.DRY_RUN and bool(a.node_id))


def reason_text(a: Admission) -> str:
    """``reason: message``, once: some messages already start with their reason."""
    reason = a.reason.value
    if not a.message or a.message.startswith(f"{reason}:"):
        return a.message or reason
    return f"{reason}: {a.message}"


def _verdict(c: NodeCheck, a: Admission) -> str:
    """A node that passes Benefit and Safety but was not the one used is eligible, not
    borrowed."""
    if c.verdict is Reason.BORROWED and c.node_id != a.node_id:
        return "eligible"
    return c.verdict.value


def _normal_ttft(a: Admission) -> str:
    """The normal path's TTFT, or that none was estimated: an answer given before any plan
    (borrowing disabled, store down, timeout) carries 0, which is no estimate."""
    if a.plan is not None and a.plan.normal_path is not None:
        return f"{a.normal_ttft_ms:.1f} ms"
    return "<none> (not estimated)"


def admission_text(a: Admission, explain: bool, asked: Sequence[str] = ()) -> str:
    if a.decision is not Decision.BORROW and would_borrow(a):
        head = [
            ("Decision", f"would BORROW on {a.node_id} (dry run: nothing debited)"),
            ("Lease", f"{a.lease_epoch}/{a.lease_version}"),
            ("Predicted TTFT", f"{a.predicted_ttft_ms:.1f} ms"),
            ("Normal-path TTFT", _normal_ttft(a)),
        ]
    elif a.decision is Decision.BORROW:
        head = [
            ("Decision", f"BORROW on {a.node_id}"),
            ("Reservation", a.reservation_id or "<none> (dry run)"),
            ("Lease", f"{a.lease_epoch}/{a.lease_version}"),
            ("Predicted TTFT", f"{a.predicted_ttft_ms:.1f} ms"),
            ("Normal-path TTFT", _normal_ttft(a)),
        ]
    else:
        head = [("Decision", "NORMAL"), ("Normal-path TTFT", _normal_ttft(a))]
    head.append(("Reason", reason_text(a)))
    if a.shadow_decision is not None:
        head.append(("Shadow decision", a.shadow_decision.value.upper()))
    parts = [key_values(head)]
    if explain and a.plan is not None:
        lines = conditions(a.plan, asked)
        parts.append("Conditions:\n" + "\n".join("  " + line for line in lines))
        rows = [
            {
                **c.model_dump(mode="json"),
                "detail": c.text(a.plan.normal_ms),
                "verdict": _verdict(c, a),
                # a node without a live lease was never priced: no 0.0 ms prediction
                "predicted_ttft_ms": None if c.verdict is Reason.NO_LEASES else c.predicted_ttft_ms,
            }
            for c in a.plan.nodes
        ]
        if rows:
            parts.append(
                "Nodes:\n"
                + "\n".join(
                    "  " + line for line in table(rows, NODE_CHECK_COLUMNS, wide=False).splitlines()
                )
            )
    return "\n".join(parts)


def admission_data(a: Admission, asked: Sequence[str] = ()) -> dict[str, Any]:
    data = a.model_dump(mode="json")
    data["would_borrow"] = would_borrow(a)
    if a.plan is not None:
        data["conditions"] = conditions(a.plan, asked)
        for node, check in zip(data["plan"]["nodes"], a.plan.nodes, strict=True):
            node["detail"] = check.text(a.plan.normal_ms)  # as on the wire
    return data


ADMIT_FLAGS = {
    "uncached_prompt_tokens": "--uncached",
    "cached_prefix_tokens": "--cached",
    "cached_prefix_node_id": "--prefix-node",
    "expected_output_tokens": "--output-tokens",
    "held_ahead_tokens": "--held-ahead",
    "prefill_node_id": "--prefill-node",
    "candidate_node_ids": "--node",
    "pool": "--pool",
}
"""AdmissionRequest field -> the admit flag that sets it, for refusals."""


def _flag_of(field: str | None) -> str:
    """The flag behind a refused request field (``candidate_node_ids.1`` -> ``--node``)."""
    name = (field or "").split(".")[0]
    return ADMIT_FLAGS.get(name, field or "request")


@click.command()
@click.option(
    "--uncached", type=click.IntRange(min=0), required=True, help="Uncached prompt tokens."
)
@click.option("--cached", type=click.IntRange(min=0), default=0, help="Cached prefix tokens.")
@click.option(
    "--output-tokens",
    type=click.IntRange(min=0),
    default=0,
    help="Expected output tokens (-o/--output is the output format, as on every command).",
)
@click.option(
    "--prefix-node",
    default=None,
    shell_complete=complete_node,
    help="Decode node holding the cached prefix.",
)
@click.option(
    "--held-ahead",
    type=click.IntRange(min=0),
    default=0,
    help="Uncached tokens the router holds ahead of this prompt (late binding).",
)
@click.option(
    "--prefill-node",
    default=None,
    shell_complete=complete_node,
    help="Prefill server the prompt would go to on the normal path (default: least-loaded).",
)
@click.option(
    "--node",
    "nodes",
    multiple=True,
    shell_complete=complete_node,
    help="Candidate node (repeatable).",
)
@click.option("--pool", default=None, help="Prefill pool (default: the context's).")
@click.option("--dry-run", is_flag=True, help="Decide and explain, debit nothing.")
@click.option("--explain", is_flag=True, help="Show each condition with its numbers.")
@output_option()
@click.pass_context
def admit(
    ctx: click.Context,
    uncached: int,
    cached: int,
    output_tokens: int,
    prefix_node: str | None,
    held_ahead: int,
    prefill_node: str | None,
    nodes: tuple[str, ...],
    pool: str | None,
    dry_run: bool,
    explain: bool,
    output: str | None,
) -> None:
    """Ask the broker whether a request would borrow, and why.

    Without --dry-run a BORROW holds a real reservation until it expires (the hold TTL)."""
    st = state(ctx)
    fmt = st.output(output)
    try:
        request = validated(
            AdmissionRequest,
            request_id="crossflowctl",
            uncached_prompt_tokens=uncached,
            cached_prefix_tokens=cached,
            cached_prefix_node_id=prefix_node,
            expected_output_tokens=output_tokens,
            held_ahead_tokens=held_ahead,
            prefill_node_id=prefill_node,
            candidate_node_ids=nodes,
            dry_run=dry_run,
            pool=st.pool(pool),
            explain=True,  # the conditions (--explain, and -o json/yaml's "conditions")
        )
    except InvalidArgument as exc:
        raise CliError(f"{_flag_of(exc.field)}: {exc.message}", ExitCode.USAGE) from None

    async def go() -> Admission:
        async with st.session() as session:
            return await session.admit(request)

    result = run(go())
    click.echo(
        render_object(admission_data(result, nodes), fmt, admission_text(result, explain, nodes))
    )


@click.group()
def policy() -> None:
    """Show or change the admission policy shared by every broker replica."""


def _policy_data(p: VersionedPolicy) -> dict[str, Any]:
    return {"version": p.version, **p.policy.model_dump(mode="json")}


def _policy_text(p: VersionedPolicy) -> str:
    return key_values([(k, json.dumps(v)) for k, v in _policy_data(p).items()])


@policy.command("get")
@output_option()
@click.pass_context
def policy_get(ctx: click.Context, output: str | None) -> None:
    """Print the current policy."""
    st = state(ctx)

    async def go() -> VersionedPolicy:
        async with st.session() as session:
            return await session.get_policy()

    p = run(go())
    click.echo(render_object(_policy_data(p), st.output(output), _policy_text(p)))


def parse_updates(pairs: tuple[str, ...]) -> dict[str, str]:
    updates: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise CliError(f"expected key=value, got {pair!r}", ExitCode.USAGE)
        updates[key.strip()] = value.strip()
    return updates


@policy.command("set")
@click.argument("pairs", nargs=-1, required=True, metavar="KEY=VALUE...")
@click.option(
    "--expected-version",
    type=click.IntRange(min=0),
    default=None,
    help="Apply only if the policy is still at this version (default: the version just read).",
)
@output_option()
@click.pass_context
def policy_set(
    ctx: click.Context, pairs: tuple[str, ...], expected_version: int | None, output: str | None
) -> None:
    """Change policy settings (validated here and by the broker), e.g. borrow_share=0.3.

    The write names the version it was based on, so a concurrent change is never overwritten
    unseen: it fails with exit code 1 and the policy stays as the other writer left it."""
    st = state(ctx)
    updates = parse_updates(pairs)

    async def go() -> tuple[VersionedPolicy, VersionedPolicy]:
        async with st.session() as session:
            current = await session.get_policy()
            _check_updates(current.policy, updates)  # fail early
            base = current.version if expected_version is None else expected_version
            return current, await session.set_policy(updates, base)

    current, p = run(go())
    if p.version == current.version:
        click.echo(f"policy unchanged (version {p.version}): it already had these values", err=True)
    click.echo(render_object(_policy_data(p), st.output(output), _policy_text(p)))


def _check_updates(policy: PolicySettings, updates: dict[str, str]) -> None:
    """Refuse what the broker would refuse, before writing; an unknown key lists the known."""
    try:
        policy.updated({k: _loose(v) for k, v in updates.items()})
    except InvalidArgument as exc:
        if exc.field in type(policy).model_fields or exc.field not in updates:
            raise
        known = ", ".join(type(policy).model_fields)
        raise CliError(f"{exc} (settings: {known})", ExitCode.USAGE) from None


def _loose(text: str) -> Any:
    """A value as typed: JSON when it parses (numbers, true/false), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text
