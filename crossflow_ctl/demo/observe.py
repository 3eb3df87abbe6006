"""What the demo's live view saw of the cluster over a run, from the Admin API: leases, their
ITL, and an outside check that open debits never exceed the lease they were granted on."""

from __future__ import annotations

from dataclasses import dataclass, field

from crossflow_ctl.client import NodeView
from crossflow_ctl.domain.models import (
    ComputeTime,
    Credits,
    Lease,
    NodeRole,
    Reservation,
    Share,
    ZeroReason,
)
from crossflow_ctl.domain.safety import over_committed

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
