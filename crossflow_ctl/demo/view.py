"""The demo's live view and final summary, as plain text (redrawn in place on a terminal)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from crossflow_ctl.client import NodeView, reporting_nodes
from crossflow_ctl.demo.observe import Observations
from crossflow_ctl.demo.router import Key, RunStats
from crossflow_ctl.demo.scrape import EngineTotals, GatewayFigures
from crossflow_ctl.domain.models import PoolSnapshot

CLEAR = "\x1b[H\x1b[2J"
GATEWAY_PATHS = ("borrowed", "normal", "fallback", "error")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[k]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


@dataclass
class RunResult:
    """One replay of the trace through a gateway, as measured."""

    label: str
    """``leases`` (the gateway asks the broker) or ``static`` (``--no-broker``)."""
    elapsed_s: float = 0.0
    stats: RunStats = field(default_factory=RunStats)
    gateway: GatewayFigures = field(default_factory=GatewayFigures)
    engines: EngineTotals = field(default_factory=EngineTotals)
    obs: Observations = field(default_factory=Observations)
    reservations_left: int | None = None
    """Reservations open at the broker once the run drained (None: not asked)."""


def gateway_line(url: str, g: GatewayFigures | None) -> str:
    """The gateway's requests by path, and where to curl it."""
    line = f"gateway {url} (curl {url}/metrics)"
    if g is None:
        return line
    paths = ", ".join(f"{p} {g.requests.get(p, 0):.0f}" for p in GATEWAY_PATHS)
    held = f"; held {g.held_count:.0f} (mean {g.held_mean_ms:.0f} ms)" if g.held_count else ""
    return f"{line}: {paths}{held}; reservations open {g.reservations_open:.0f}"


def frame(
    title: str,
    elapsed_s: float,
    stats: RunStats,
    nodes: list[NodeView],
    pools: list[PoolSnapshot],
    obs: Observations,
    total_requests: int,
    at_ms: int,
    hint: str = "",
    gateway: str = "",
    figures: GatewayFigures | None = None,
) -> str:
    """One refresh of the live view; ``hint``: how to point crossflowctl at the cluster (said
    in every frame: the line printed at start scrolls away under the view)."""
    reporting = reporting_nodes(pools)
    lost = f", {stats.lost} lost" if stats.lost else ""
    lines = [
        f"{title}   t={elapsed_s:5.1f}s   requests {stats.released}/{total_requests} released, "
        f"{stats.finished} done{lost}" + (f"   try: {hint}" if hint else ""),
        f"borrowed {stats.borrowed} ({_pct(stats.borrowed_share)} of prompts, "
        f"{_pct(stats.borrowed_uncached_tokens / max(1, stats.uncached_tokens))} of uncached "
        f"tokens)   TTFT mean {mean(stats.ttft_ms):.0f} ms p99 {percentile(stats.ttft_ms, 99):.0f} "
        f"ms (measured)   ITL mean {mean(obs.itl_ms):.1f} ms (leases)",
    ]
    if gateway:
        lines.append(gateway_line(gateway, figures))
    for pool in pools:
        wait = pool.estimated_wait_ms()
        lines.append(
            f"prefill pool {pool.pool}: {len(pool.reports)} servers, "
            f"{pool.outstanding_uncached_tokens} tokens outstanding, "
            f"{pool.processing_rate_tps:.0f} tokens/s, wait "
            + ("no rate" if pool.no_rate else f"{wait:.0f} ms" if wait is not None else "?")
        )
    lines.append("")
    # AVAIL-*: left to lend (lease x share - open debits), as in `crossflowctl get nodes`
    header = f"{'NODE':<10} {'ROLE':<8} {'STATUS':<22} {'LEASE':>8} {'AVAIL-COMPUTE':>13} "
    header += f"{'AVAIL-KV':>9} {'AVAIL-SLOTS':>11} {'OPEN':>4} {'BORROWED':>8} {'ITL-MS':>7}"
    lines.append(header)
    borrowed = stats.borrowed_by_node()
    for view in nodes:
        node = view.state
        stored = node.lease
        status = view.status(at_ms, reporting)
        lease = f"v{stored.lease.version}" if stored else "-"
        a = view.available
        # an ITL of 0 is the agent's "no decode step measured" (idle), not 0 ms
        itl = f"{stored.lease.itl_ms:.1f}" if stored and stored.lease.itl_ms > 0 else "-"
        lines.append(
            f"{node.info.node_id:<10} {node.info.role.value:<8} {status:<22} {lease:>8} "
            f"{a.compute_tokens:>13} {a.kv_tokens:>9} {a.slots:>11} {node.open_reservations:>4} "
            f"{borrowed.get(node.info.node_id, 0):>8} {itl:>7}"
        )
    return "\n".join(lines)


PATHS = ("borrowed", "normal", "fallback")
PATH_NAMES = {"borrowed": "borrowed", "normal": "normal path", "fallback": "fallback"}


def _common(leases: RunStats, static: RunStats | None) -> list[Key]:
    """The requests both runs finished (all of them when both ran to their end)."""
    keys = list(leases.ttft_by_request)
    if static is None:
        return keys
    return [k for k in keys if k in static.ttft_by_request]


def _figures(values: list[float]) -> dict[str, float]:
    return {"mean": mean(values), "p50": percentile(values, 50), "p99": percentile(values, 99)}


def ttft_by_path(leases: RunStats, static: RunStats | None) -> dict[str, dict[str, float]]:
    """TTFT of the requests each path took in the leases run (the gateway's word), and the
    same requests' TTFT in the static run: where the change in the totals comes from."""
    out: dict[str, dict[str, float]] = {}
    common = set(_common(leases, static))
    for path in PATHS:
        keys = [k for k, p in leases.path_by_request.items() if p == path and k in common]
        run = [leases.ttft_by_request[k] for k in keys]
        base = [static.ttft_by_request[k] for k in keys] if static is not None else []
        out[path] = {
            "requests": len(keys),
            "mean": mean(run),
            "p50": percentile(run, 50),
            "static_mean": mean(base),
            "static_p50": percentile(base, 50),
        }
    return out


def _run_data(run: RunResult, keys: list[Key]) -> dict[str, Any]:
    s, g, d, obs = run.stats, run.gateway, run.engines, run.obs
    by_node = obs.itl_over_slo()
    return {
        "elapsed_s": run.elapsed_s,
        "requests": s.released,
        "finished": s.finished,
        "lost": s.lost,
        "lost_reasons": s.errors,
        "borrowed": s.borrowed,
        "borrowed_share": s.borrowed_share,
        "borrowed_by_node": s.borrowed_by_node(),
        "ttft_ms": _figures([s.ttft_by_request[k] for k in keys]),
        "request_ms": _figures([s.total_by_request[k] for k in keys]),
        "gateway": {
            "requests": g.requests,
            "ttft_mean_ms": {p: g.ttft_mean_ms(p) for p in g.ttft_count},
            "broker_unavailable": g.broker_unavailable,
            "failovers": g.failovers,
        },
        "reasons": g.reasons,
        "late_binding": {
            "dispatch": g.dispatch,
            "held": g.held_count,
            "held_ms_mean": g.held_mean_ms,
        },
        "reservations_left_open": run.reservations_left,
        "decode_prompt_tokens": {
            "borrowed": d.borrowed_prompt_tokens,
            "own_cache": d.decode_cached_prompt_tokens,
            "transferred": d.transferred_prompt_tokens,
        },
        "engine_prompt_tokens": {
            "computed": d.computed_prompt_tokens,
            "cached": d.cached_prompt_tokens,
        },
        "itl_tokens": {"over_slo": d.itl_over_slo, "observed": d.itl_observations},
        "lease_versions_seen": obs.lease_updates,
        "lease_versions_published": obs.leases_published,
        "decode_nodes_leasing": len(obs.leases_seen),
        "polls": obs.polls,
        "zero_lease_observations": obs.zero_leases,
        "over_commits": obs.over_commits,
        "over_commit_checks": obs.checked,
        "itl_ms_from_leases": {
            "mean": mean(obs.itl_values()),
            "max": max(obs.itl_values(), default=0.0),
        },
        "itl_slo_ms": obs.itl_slo_ms(),
        "itl_over_slo": {node: {"over": o, "samples": n} for node, (o, n) in by_node.items()},
    }


def summary_data(leases: RunResult, static: RunResult | None) -> dict[str, Any]:
    """The summary's figures, for ``--summary-json`` (tests and scripts): the leases run's at
    the top level (as before the static run was measured), the static run's under
    ``static``, both over the requests both finished."""
    keys = _common(leases.stats, static.stats if static else None)
    data = _run_data(leases, keys)
    data["compared_requests"] = len(keys)
    data["ttft_by_path"] = ttft_by_path(leases.stats, static.stats if static else None)
    data["static"] = _run_data(static, keys) if static is not None else None
    return data


def _change(new: float, old: float) -> str:
    return f"{100.0 * (new - old) / old:+.1f}%" if old > 0 else "n/a"


def _table(rows: list[tuple[str, str, str, str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  " + "   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _itl_leases(obs: Observations) -> str:
    by_node = obs.itl_over_slo()
    over, samples = sum(o for o, _ in by_node.values()), sum(n for _, n in by_node.values())
    slo = obs.itl_slo_ms()
    if slo is None or not samples:
        return "none measured"
    return (
        f"SLO {slo:g} ms, over it in {over} of {samples} leases seen ({_pct(over / samples)}; "
        + ", ".join(f"{node} {o}/{n}" for node, (o, n) in by_node.items())
        + f"); {mean(obs.itl_values()):.1f} ms mean, {max(obs.itl_values()):.1f} ms max"
    )


def _itl_tokens(d: EngineTotals) -> str:
    if not d.itl_observations:
        return "none"
    return (
        f"{d.itl_over_slo:.0f} of {d.itl_observations:.0f} "
        f"({_pct(d.itl_over_slo / d.itl_observations)})"
    )


def _prompt_sources(d: EngineTotals) -> str:
    whole = d.borrowed_prompt_tokens + d.decode_cached_prompt_tokens + d.transferred_prompt_tokens
    if not whole:
        return "none"
    cached = d.decode_cached_prompt_tokens
    return (
        f"{_pct(d.borrowed_prompt_tokens / whole)} computed there (borrowed), "
        + (f"{_pct(cached / whole)} from their own prefix cache, " if cached else "")
        + f"{_pct(d.transferred_prompt_tokens / whole)} by KV transfer from prefill"
    )


def _m(tokens: float) -> str:
    return f"{tokens / 1e6:.2f}M"


def _computed(run: RunResult) -> str:
    e = run.engines
    return (
        f"computed {_m(e.computed_prompt_tokens)}, from prefix caches {_m(e.cached_prompt_tokens)}"
    )


def _paths(g: GatewayFigures) -> str:
    parts = []
    for path in GATEWAY_PATHS:
        count = g.requests.get(path, 0.0)
        if not count:
            continue
        ttft = g.ttft_mean_ms(path)
        parts.append(f"{path} {count:.0f}" + (f" (TTFT {ttft:.0f} ms)" if ttft else ""))
    return ", ".join(parts) or "none"


def summary(
    trace_name: str, split: str, leases: RunResult, static: RunResult | None, engines: str
) -> str:
    """The comparison of the two runs (``static`` None: not run, or interrupted before)."""
    ls, ss = leases.stats, static.stats if static is not None else None
    keys = _common(ls, ss)

    def col(values: dict[Key, float], q: float | None) -> float:
        pick = [values[k] for k in keys]
        return mean(pick) if q is None else percentile(pick, q)

    rows: list[tuple[str, str, str, str]] = [
        ("", "leases (gateway + broker)", f"static {split} (gateway --no-broker)", "change"),
        (
            "run time (s)",
            f"{leases.elapsed_s:.1f}",
            f"{static.elapsed_s:.1f}" if static else "not run",
            "",
        ),
        (
            "requests finished / lost",
            f"{ls.finished} / {ls.lost}",
            f"{ss.finished} / {ss.lost}" if ss else "",
            "",
        ),
        ("borrowed prompts", f"{ls.borrowed} ({_pct(ls.borrowed_share)})", "0" if ss else "", ""),
    ]
    for name, q in (("mean", None), ("p50", 50.0), ("p99", 99.0)):
        new = col(ls.ttft_by_request, q)
        old = col(ss.ttft_by_request, q) if ss else 0.0
        rows.append(
            (f"TTFT {name} (ms)", f"{new:.0f}", f"{old:.0f}" if ss else "", _change(new, old))
        )
    if ss is not None:
        for path, f in ttft_by_path(ls, ss).items():
            if f["requests"]:
                rows.append(
                    (
                        f"  p50, {PATH_NAMES[path]} ({f['requests']:.0f})",
                        f"{f['p50']:.0f}",
                        f"{f['static_p50']:.0f}",
                        _change(f["p50"], f["static_p50"]),
                    )
                )
    new = col(ls.total_by_request, None)
    old = col(ss.total_by_request, None) if ss else 0.0
    rows.append(
        ("request time mean (ms)", f"{new:.0f}", f"{old:.0f}" if ss else "", _change(new, old))
    )
    obs = leases.obs
    verdict = (
        "none"
        if not obs.over_commits
        else f"{len(obs.over_commits)} (" + "; ".join(obs.over_commits[:3]) + ")"
    )
    unseen = obs.leases_published - obs.lease_updates
    missed = f" ({unseen} more published, not seen)" if unseen > 0 else ""
    left = leases.reservations_left
    errors = ls.errors + (ss.errors if ss else [])
    lines = [
        f"Summary: {trace_name} on {split}, {len(keys)} requests compared, each a streamed "
        "completion through crossflow-gateway",
        _table(rows),
        f"  gateway paths: {_paths(leases.gateway)}"
        + (f"; static: {_paths(static.gateway)}" if static else "")
        + f"; broker unreachable {leases.gateway.broker_unavailable:.0f}, failovers "
        f"{leases.gateway.failovers:.0f}",
        f"  decode engines' prompt tokens: {_prompt_sources(leases.engines)}"
        + (f" (static: {_prompt_sources(static.engines)})" if static else ""),
        f"  engines' prompt tokens: {_computed(leases)}"
        + (f" (static: {_computed(static)})" if static else "")
        + f"; the trace calls {_m(ls.uncached_tokens)} uncached, {_m(ls.cached_tokens)} cached "
        "(what the engines' LRU prefix caches no longer hold, or never held on that engine, is "
        "computed again)",
        f"  requests lost: {ls.lost}"
        + (f" (static run {ss.lost})" if ss else "")
        + (f" [{'; '.join(errors)}]" if errors else "")
        + "; reservations left open after the leases run: "
        + ("not checked" if left is None else str(left)),
        f"  leases: {obs.lease_updates} distinct lease versions seen from "
        f"{len(obs.leases_seen)} decode nodes{missed}; over-commits seen: {verdict} "
        f"(in {obs.checked} checks of open debits against the lease they were granted on)",
        f"  decode ITL (each lease's p99 over its agent's period): {_itl_leases(obs)}"
        + (f"; static run: {_itl_leases(static.obs)}" if static else ""),
        f"  decode tokens over the ITL SLO (engines' histograms): {_itl_tokens(leases.engines)}"
        + (f"; static run: {_itl_tokens(static.engines)}" if static else ""),
        "  admission reasons: "
        + (", ".join(f"{k} {v:.0f}" for k, v in sorted(leases.gateway.reasons.items())) or "none"),
        f"  late binding: {leases.gateway.held_count:.0f} prompts held (mean "
        f"{leases.gateway.held_mean_ms:.0f} ms); outcomes: "
        + (", ".join(f"{k} {v:.0f}" for k, v in sorted(leases.gateway.dispatch.items())) or "none"),
        f"  (Measured, not modelled: the demo's client sent every turn as a streamed "
        f"/v1/completions to crossflow-gateway and timed it, TTFT to the first streamed token; "
        f"{engines} Both columns are the same requests (session, turn) with prompts of the same "
        "length, each run on cold prefix caches; the p50 rows split them by the path the "
        "gateway said they took with leases.)",
    ]
    return "\n".join(lines)
