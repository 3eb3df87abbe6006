"""The demo's live view and final summary, as plain text (redrawn in place on a terminal)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from crossflow_ctl.client import NodeView, reporting_nodes
from crossflow_ctl.demo.model import StaticResult, mean, percentile
from crossflow_ctl.demo.router import RouterStats
from crossflow_ctl.domain.models import (
    ComputeTime,
    Credits,
    Lease,
    NodeRole,
    PoolSnapshot,
    Reservation,
    Share,
    ZeroReason,
)
from crossflow_ctl.domain.safety import over_committed

CLEAR = "\x1b[H\x1b[2J"


_NO_TELEMETRY = frozenset(
    {
        ZeroReason.STARTING,
        ZeroReason.TELEMETRY_MISSING,
        ZeroReason.TELEMETRY_STALE,
        ZeroReason.TELEMETRY_IMPLAUSIBLE,
    }
)
"""Zero reasons whose lease carries no ITL worth averaging."""


@dataclass
class Observations:
    """What the view saw over the run, from the Admin API."""

    polls: int = 0
    leases_seen: dict[str, set[tuple[int, int]]] = field(default_factory=dict)
    """(epoch, version) of each distinct lease the view saw, by node (from each node's recent
    history, so every lease while the view keeps up, not one a poll)."""
    versions: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    """(lowest, highest) version seen of each (node, epoch): an agent numbers its leases one by
    one, so the range says how many it published, seen or not."""
    itl_ms: list[float] = field(default_factory=list)
    itl_samples: dict[str, dict[tuple[int, int], tuple[float, float]]] = field(default_factory=dict)
    """(ITL, SLO) of each distinct lease seen that measured one, by node and (epoch, version)."""

    over_commits: list[str] = field(default_factory=list)
    max_open_reservations: int = 0
    zero_leases: int = 0
    checked: int = 0
    """Node observations where the over-commit check applied (open grants, lease in history)."""

    def check_grants(
        self, reservations: list[Reservation], history: dict[str, list[Lease]], share: Share
    ) -> None:
        """No over-commit (DESIGN.md §5.3), checked from the outside.

        Every reservation open now was open when the newest of them was granted, and that grant
        checked (atomically, in the store) that all of them fit in ``share`` (per credit) x the
        lease it was granted against. So their sum must fit in that lease, credit by credit;
        anything else is an over-commit. (A later, smaller lease may legitimately sit below older
        debits, so the node's latest lease is not the yardstick.) ``history`` holds each node's
        recent leases, read after ``reservations``."""
        by_node: dict[str, list[Reservation]] = {}
        for r in reservations:
            by_node.setdefault(r.node_id, []).append(r)
        for node_id, held in by_node.items():
            newest = max((r.lease_epoch, r.lease_version) for r in held)
            lease = next(
                (x for x in history.get(node_id, []) if (x.epoch, x.version) == newest), None
            )
            if lease is None:
                continue  # aged out of the broker's history: nothing to compare with
            debits, time = Credits(), ComputeTime()
            for r in held:
                debits = debits.plus(r.debit)
                time = time.plus(r.compute_time)
            over = over_committed(
                lease.credits, debits, share, lease.borrowed_prefill_rate_tps, time
            )
            if over:
                self.over_commits.append(f"{node_id}: {', '.join(over)}")
            self.checked += 1

    def observe(self, nodes: list[NodeView], now_ms: int) -> None:
        """Record leases seen and the ITL they report."""
        self.polls += 1
        open_total = 0
        for view in nodes:
            node = view.state
            stored = node.lease
            if node.info.role is not NodeRole.DECODE or stored is None:
                continue
            lease = stored.lease
            self.record(node.info.node_id, [lease])
            open_total += node.open_reservations
            if stored.expired(now_ms):
                self.zero_leases += 1
                continue
            if lease.zero_reason is not None:
                self.zero_leases += 1
            # a zero lease still reports the node's ITL (ITL over the SLO is why most are zero):
            # leaving those out would report the ITL of the healthy nodes only
            if lease.itl_ms > 0 and lease.zero_reason not in _NO_TELEMETRY:
                self.itl_ms.append(lease.itl_ms)
        self.max_open_reservations = max(self.max_open_reservations, open_total)

    def record(self, node_id: str, leases: list[Lease]) -> None:
        """Leases of a decode node: its latest, or its recent history (``describe node``'s),
        each counted once by (epoch, version), with the ITL it measured against its SLO."""
        seen = self.leases_seen.setdefault(node_id, set())
        samples = self.itl_samples.setdefault(node_id, {})
        for lease in leases:
            key = (lease.epoch, lease.version)
            seen.add(key)
            low, high = self.versions.get((node_id, lease.epoch), (lease.version, lease.version))
            self.versions[(node_id, lease.epoch)] = (
                min(low, lease.version),
                max(high, lease.version),
            )
            if lease.itl_ms > 0 and lease.zero_reason not in _NO_TELEMETRY:
                samples[key] = (lease.itl_ms, lease.itl_slo_ms)

    @property
    def lease_updates(self) -> int:
        """Distinct (node, epoch, version) the view saw."""
        return sum(len(v) for v in self.leases_seen.values())

    @property
    def leases_published(self) -> int:
        """Leases the decode agents published while the view watched, by their version numbers
        (each (node, epoch) from the lowest version seen to the highest)."""
        return sum(high - low + 1 for low, high in self.versions.values())

    def itl_over_slo(self) -> dict[str, tuple[int, int]]:
        """(leases over their SLO, leases that measured an ITL) by node, over the distinct
        leases seen: each reports its agent's ITL p99 over one period."""
        return {
            node: (sum(1 for itl, slo in seen.values() if itl >= slo), len(seen))
            for node, seen in sorted(self.itl_samples.items())
        }

    def itl_values(self) -> list[float]:
        """The ITL of every distinct lease seen that measured one."""
        return [itl for s in self.itl_samples.values() for itl, _ in s.values()]

    def itl_slo_ms(self) -> float | None:
        """The agents' ITL SLO (the highest, should they differ), None before any sample."""
        return max((slo for s in self.itl_samples.values() for _, slo in s.values()), default=None)


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def frame(
    title: str,
    elapsed_s: float,
    stats: RouterStats,
    nodes: list[NodeView],
    pools: list[PoolSnapshot],
    obs: Observations,
    total_requests: int,
    at_ms: int,
    hint: str = "",
) -> str:
    """One refresh of the live view; ``hint``: how to point crossflowctl at the cluster (said
    in every frame: the line printed at start scrolls away under the view)."""
    reporting = reporting_nodes(pools)
    lines = [
        f"{title}   t={elapsed_s:5.1f}s   requests {stats.released}/{total_requests} released, "
        f"{stats.finished} done" + (f"   try: {hint}" if hint else ""),
        f"borrowed {stats.borrowed} ({_pct(stats.borrowed_share)} of prompts, "
        f"{_pct(stats.borrowed_uncached_tokens / max(1, stats.uncached_tokens))} of uncached "
        f"tokens)   TTFT mean {mean(stats.ttft_ms):.0f} ms p99 {percentile(stats.ttft_ms, 99):.0f} "
        f"ms   ITL mean {mean(obs.itl_ms):.1f} ms (leases)",
    ]
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
            f"{stats.borrowed_by_node.get(node.info.node_id, 0):>8} {itl:>7}"
        )
    return "\n".join(lines)


PATHS = ("borrowed", "normal", "held")
PATH_NAMES = {"borrowed": "borrowed", "normal": "normal path", "held": "held, then prefill"}


def ttft_by_path(stats: RouterStats, static: StaticResult) -> dict[str, dict[str, float]]:
    """TTFT of the requests each path took (``RouterStats.path_by_request``), this run's and
    the static replay's for the same requests: where the change in the totals comes from."""
    out: dict[str, dict[str, float]] = {}
    for path in PATHS:
        keys = [
            k
            for k, p in stats.path_by_request.items()
            if p == path and k in stats.ttft_by_request and k in static.ttft_by_request
        ]
        run = [stats.ttft_by_request[k] for k in keys]
        base = [static.ttft_by_request[k] for k in keys]
        out[path] = {
            "requests": len(keys),
            "mean": mean(run),
            "p50": percentile(run, 50),
            "static_mean": mean(base),
            "static_p50": percentile(base, 50),
        }
    return out


def summary_data(stats: RouterStats, static: StaticResult, obs: Observations) -> dict[str, Any]:
    """The summary's figures, for ``--summary-json`` (tests and scripts)."""
    common = [key for key in stats.ttft_by_request if key in static.ttft_by_request]
    ttft = [stats.ttft_by_request[key] for key in common]
    base = [static.ttft_by_request[key] for key in common]
    return {
        "requests": stats.released,
        "finished": stats.finished,
        "borrowed": stats.borrowed,
        "borrowed_share": stats.borrowed_share,
        "borrowed_by_node": stats.borrowed_by_node,
        "reasons": stats.reasons,
        "late_binding": {
            "dispatch": stats.dispatch,
            "held": len(stats.held_ms),
            "held_ms": {"mean": mean(stats.held_ms), "max": max(stats.held_ms, default=0.0)},
        },
        "admit_errors": stats.admit_errors,
        "engine_errors": stats.engine_errors,
        "lease_versions_seen": obs.lease_updates,
        "lease_versions_published": obs.leases_published,
        "decode_nodes_leasing": len(obs.leases_seen),
        "polls": obs.polls,
        "over_commits": obs.over_commits,
        "over_commit_checks": obs.checked,
        "compared_requests": len(common),
        "ttft_ms": {"mean": mean(ttft), "p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "static_ttft_ms": {
            "mean": mean(base),
            "p50": percentile(base, 50),
            "p99": percentile(base, 99),
        },
        "itl_ms_from_leases": {
            "mean": mean(obs.itl_values()),
            "max": max(obs.itl_values(), default=0.0),
        },
        "itl_slo_ms": obs.itl_slo_ms(),
        "itl_over_slo": {
            node: {"over": over, "samples": n} for node, (over, n) in obs.itl_over_slo().items()
        },
        "ttft_by_path": ttft_by_path(stats, static),
    }


def summary(
    trace_name: str,
    split: str,
    elapsed_s: float,
    stats: RouterStats,
    static: StaticResult,
    obs: Observations,
) -> str:
    # Compare the same requests: those the run finished admitting (all of them when the trace
    # ran to its end), looked up by session and turn in the static replay.
    common = [key for key in stats.ttft_by_request if key in static.ttft_by_request]
    ttft = [stats.ttft_by_request[key] for key in common]
    base = [static.ttft_by_request[key] for key in common]
    m, bm = mean(ttft), mean(base)
    p50, bp50 = percentile(ttft, 50), percentile(base, 50)
    p99, bp99 = percentile(ttft, 99), percentile(base, 99)

    def change(new: float, old: float) -> str:
        return f"{100.0 * (new - old) / old:+.1f}%" if old > 0 else "n/a"

    rows = [
        ("", "leases (this run)", f"static {split} (same requests)", "change"),
        ("requests", str(len(ttft)), str(len(base)), ""),
        ("borrowed prompts", f"{stats.borrowed} ({_pct(stats.borrowed_share)})", "0", ""),
        ("TTFT mean (ms)", f"{m:.0f}", f"{bm:.0f}", change(m, bm)),
        ("TTFT p50 (ms)", f"{p50:.0f}", f"{bp50:.0f}", change(p50, bp50)),
        ("TTFT p99 (ms)", f"{p99:.0f}", f"{bp99:.0f}", change(p99, bp99)),
    ]
    for path, figures in ttft_by_path(stats, static).items():
        if figures["requests"]:
            rows.append(
                (
                    f"  p50, {PATH_NAMES[path]} ({figures['requests']:.0f})",
                    f"{figures['p50']:.0f}",
                    f"{figures['static_p50']:.0f}",
                    change(figures["p50"], figures["static_p50"]),
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    table = "\n".join(
        "  " + "   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
    verdict = (
        "none"
        if not obs.over_commits
        else f"{len(obs.over_commits)} (" + "; ".join(obs.over_commits[:3]) + ")"
    )
    unseen = obs.leases_published - obs.lease_updates
    missed = f" ({unseen} more published, not seen)" if unseen > 0 else ""
    by_node = obs.itl_over_slo()
    over, samples = sum(o for o, _ in by_node.values()), sum(n for _, n in by_node.values())
    slo = obs.itl_slo_ms()
    itl_line = "  decode ITL (each lease's p99 over its agent's period): "
    if slo is None or not samples:
        itl_line += "none measured"
    else:
        itl_line += (
            f"SLO {slo:g} ms, over it in {over} of {samples} leases seen ({_pct(over / samples)}; "
            + ", ".join(f"{node} {o}/{n}" for node, (o, n) in by_node.items())
            + f"); {mean(obs.itl_values()):.1f} ms mean, {max(obs.itl_values()):.1f} ms max"
        )
    return "\n".join(
        [
            f"Summary: {trace_name} on {split}, {elapsed_s:.1f} s",
            table,
            f"  leases: {obs.lease_updates} distinct lease versions seen from "
            f"{len(obs.leases_seen)} decode nodes{missed}; over-commits seen: {verdict} "
            f"(in {obs.checked} checks of open debits against the lease they were granted on)",
            itl_line,
            "  admission reasons: "
            + ", ".join(f"{k} {v}" for k, v in sorted(stats.reasons.items())),
            f"  late binding: {len(stats.held_ms)} prompts held (mean "
            f"{mean(stats.held_ms):.0f} ms); outcomes: "
            + ", ".join(f"{k} {v}" for k, v in sorted(stats.dispatch.items())),
            "  (TTFT on both sides comes from the demo router's queueing model of this cluster,"
            " priced on the fake engines' roofline as the agents report them to the broker;"
            " the static column replays the same requests with nothing borrowed. The p50 rows"
            " split the requests by the path they took here; a held prompt's TTFT counts its"
            " hold.)",
        ]
    )
