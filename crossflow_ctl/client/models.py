"""What the admin client returns: domain models, plus what the broker computed for display."""

from __future__ import annotations

from crossflow_ctl.domain.models import Credits, Frozen, Lease, NodeState, Reservation


class NodeView(Frozen):
    """A node as the broker sees it now."""

    state: NodeState
    available: Credits = Credits()
    """Lease x the policy's borrow shares - open debits; zero when expired, zero or cordoned."""
    lease_expired: bool = False


class NodeEventView(Frozen):
    at_ms: int
    kind: str
    message: str


class NodeDetailView(Frozen):
    node: NodeView
    reservations: tuple[Reservation, ...] = ()
    recent_leases: tuple[Lease, ...] = ()
    events: tuple[NodeEventView, ...] = ()


class CommitResult(Frozen):
    reservation_id: str
    expires_at_ms: int
