"""What the admin client returns: domain models, plus what the broker computed for display."""

from __future__ import annotations

from crossflow_ctl.domain.models import (
    Credits,
    Frozen,
    Lease,
    NodeRole,
    NodeState,
    PoolSnapshot,
    Reservation,
)
from crossflow_ctl.domain.online_calibration import StepModelReport


class NodeView(Frozen):
    """A node as the broker sees it now."""

    state: NodeState
    available: Credits = Credits()
    """Lease x the policy's borrow shares - open debits; zero when expired, zero or cordoned."""
    lease_expired: bool = False

    def status(self, at_ms: int, reporting: frozenset[tuple[str, str]] = frozenset()) -> str:
        """Decode nodes: Ready, Cordoned, NoLease, Expired or Zero(<reason>). Prefill nodes
        send load reports, not leases: Reporting when ``reporting`` ((pool, node id) of each
        live report, :func:`reporting_nodes`) holds the node in its pool, else NoReport (its
        pool's wait no longer counts it)."""
        node = self.state
        stored = node.lease
        if node.info.cordoned:
            return "Cordoned"
        if node.info.role is NodeRole.PREFILL:
            reports = (node.info.pool, node.info.node_id) in reporting
            return "Reporting" if reports else "NoReport"
        if stored is None:
            return "NoLease"
        if self.lease_expired or stored.expired(at_ms):
            return "Expired"
        if stored.lease.zero_reason is not None:
            return f"Zero({stored.lease.zero_reason.value})"
        return "Ready"


def reporting_nodes(pools: list[PoolSnapshot]) -> frozenset[tuple[str, str]]:
    """(pool, node id) of each live load report in ``pools`` (for :meth:`NodeView.status`): a
    node moved to another pool is not Reporting on its old pool's report."""
    return frozenset((pool.pool, r.node_id) for pool in pools for r in pool.reports)


class NodeEventView(Frozen):
    at_ms: int
    kind: str
    message: str


class NodeDetailView(Frozen):
    node: NodeView
    reservations: tuple[Reservation, ...] = ()
    recent_leases: tuple[Lease, ...] = ()
    events: tuple[NodeEventView, ...] = ()
    step_model: StepModelReport | None = None
    """The node agent's online calibration (None: it sent none, or an older broker)."""


class CommitResult(Frozen):
    reservation_id: str
    expires_at_ms: int
