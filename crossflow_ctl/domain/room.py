"""Room to borrow, as a router doing late binding watches it (issue #10, DESIGN.md §4).

Pure: :func:`summarize_room` turns the admission view (the prefill pool's live load and the
candidate nodes' states) into a :class:`RoomView`: the nodes whose lease has room now (spare
compute in the lease's compute unit, KV and slots, after the policy's borrow share and open
debits) and whether Demand holds. :func:`material_change` says whether a new view differs enough
from the last one sent to be worth an update. The broker streams these as :class:`RoomUpdate`;
the client's ``AdmissionQueue`` re-offers held prompts when one shows room.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Annotated

from pydantic import Field, field_validator

from crossflow_ctl.domain.admission import DemandCheck, check_demand
from crossflow_ctl.domain.lending import compute_debit, queue_wait_ms
from crossflow_ctl.domain.models import (
    MAX_SLOTS,
    Frozen,
    Ms,
    NodeId,
    NodeState,
    PoolName,
    PoolSnapshot,
    Share,
    SPerToken,
    SPerTokenContext,
    Tokens,
    Tps,
)
from crossflow_ctl.domain.pending import NONE_UNREPORTED, Unreported
from crossflow_ctl.domain.policy import PolicySettings

MAX_UPDATES_PER_S = 1_000.0
MAX_HEARTBEAT_MS = 60_000
MIN_HEARTBEAT_MS = 100


class RoomStatus(StrEnum):
    OK = "ok"
    UNKNOWN = "unknown"
    """The store did not answer: no room may be assumed (fail closed, §5.6)."""


class NodeRoom(Frozen):
    """One decode node's spare room now: lease x borrow share - open debits."""

    node_id: NodeId
    compute_tokens: Tokens
    """Spare compute credit, in the lease's compute unit (uncached prompt tokens)."""
    kv_tokens: Tokens = 0
    slots: Annotated[int, Field(ge=0, le=MAX_SLOTS)] = 0
    queue_wait_ms: Ms = 0.0
    lease_epoch: int = 0
    lease_version: int = 0
    borrowed_prefill_rate_tps: Tps = 0.0
    """The lease's prefill pricing (:class:`~crossflow_ctl.domain.models.Lease`), so a watcher
    prices a prompt's compute as Admit's debit does (:meth:`compute_need`); 0: not said."""
    prefill_s_per_token: SPerToken = 0.0
    prefill_s_per_token_context: SPerTokenContext = 0.0

    def compute_need(self, uncached: int, cached: int) -> int | None:
        """The compute credit a prompt of ``uncached`` tokens over a ``cached`` prefix would
        take here (:func:`~crossflow_ctl.domain.lending.compute_debit`, Admit's own pricing),
        or None when the view does not say the lease's rate."""
        rate = self.borrowed_prefill_rate_tps
        if rate <= 0.0:
            return None
        a, b = self.prefill_s_per_token, self.prefill_s_per_token_context
        return compute_debit(uncached, cached, a, b, rate).tokens


class RoomView(Frozen):
    """What a watcher of ``pool`` may borrow now, and whether the pool is behind (Demand)."""

    pool: PoolName = "default"
    status: RoomStatus = RoomStatus.OK
    detail: str = ""
    nodes: tuple[NodeRoom, ...] = ()
    """Nodes with room on compute, KV and slots, by node id; empty when none (or unknown)."""
    pool_wait_ms: Ms | None = None
    """The prefill pool's estimated wait; None when no live load report."""
    demand_threshold_ms: Ms = 0.0
    demand_holds: bool = False

    @property
    def has_room(self) -> bool:
        return self.status is RoomStatus.OK and bool(self.nodes)

    @property
    def total_compute_tokens(self) -> int:
        return sum(n.compute_tokens for n in self.nodes)

    @property
    def total_slots(self) -> int:
        return sum(n.slots for n in self.nodes)

    @property
    def max_compute_tokens(self) -> int:
        return max((n.compute_tokens for n in self.nodes), default=0)


class RoomUpdate(Frozen):
    """One message of a room watch: ``seq`` increases by one per update within a stream."""

    seq: Annotated[int, Field(ge=0)]
    at_ms: int
    """Broker clock (Unix ms) when the view was read."""
    heartbeat: bool = False
    """Sent because the heartbeat interval passed, not because the room changed."""
    view: RoomView


class RoomWatchRequest(Frozen):
    """A subscription: the pool, optional candidate nodes, and its own rate limits."""

    pool: PoolName = "default"
    candidate_node_ids: Annotated[tuple[NodeId, ...], Field(max_length=1024)] = ()
    max_updates_per_s: Annotated[
        float, Field(ge=0.0, le=MAX_UPDATES_PER_S, allow_inf_nan=False)
    ] = 0.0
    """At most this many updates a second (0: the broker's default; capped by its setting)."""
    heartbeat_ms: Annotated[int, Field(ge=0, le=MAX_HEARTBEAT_MS)] = 0
    """An update at least this often even when nothing changed (0: the broker's default)."""

    @field_validator("heartbeat_ms")
    @classmethod
    def _heartbeat_not_too_short(cls, value: int) -> int:
        if 0 < value < MIN_HEARTBEAT_MS:
            raise ValueError(f"must be 0 (the broker's default) or at least {MIN_HEARTBEAT_MS}")
        return value


def node_room(node: NodeState, share: Share, now_ms: int) -> NodeRoom | None:
    """The node's room, or None when it has none (no, expired or zero lease, cordoned, or
    short on compute, KV, output or slots: what Admit's Safety check would refuse a prompt
    for, so a watcher is not told of room every re-offer would find gone)."""
    stored = node.lease
    if stored is None:
        return None
    available = node.available(now_ms, share)
    if (
        min(available.compute_tokens, available.kv_tokens, available.output_tokens, available.slots)
        <= 0
    ):
        return None
    lease = stored.lease
    return NodeRoom(
        node_id=node.info.node_id,
        compute_tokens=available.compute_tokens,
        kv_tokens=available.kv_tokens,
        slots=available.slots,
        queue_wait_ms=queue_wait_ms(lease, node.open_debits.compute_tokens, node.open_compute),
        lease_epoch=lease.epoch,
        lease_version=lease.version,
        borrowed_prefill_rate_tps=lease.borrowed_prefill_rate_tps,
        prefill_s_per_token=lease.prefill_s_per_token,
        prefill_s_per_token_context=lease.prefill_s_per_token_context,
    )


NodeRoomOf = Callable[[NodeState, Share, int], NodeRoom | None]
""":func:`node_room`'s signature."""


def summarize_room(
    pool_name: str,
    pool: PoolSnapshot | None,
    nodes: Sequence[NodeState],
    settings: PolicySettings,
    now_ms: int,
    pending: Unreported = NONE_UNREPORTED,
    room_of: NodeRoomOf = node_room,
    demand: DemandCheck | None = None,
) -> RoomView:
    """The room of ``nodes`` and the pool's Demand, under ``settings``, at ``now_ms``, with
    the tokens sent to the pool since its reports (``pending``, as Admit counts them).
    ``room_of``: :func:`node_room`, or a memo of it that gives the same answers; ``demand``:
    the pool's Demand for these (``check_demand``) when the caller kept it, else computed."""
    if demand is None:
        demand = check_demand(pool, settings, pending.shared, None, pending.by_server)
    share = settings.shares
    rooms = (room_of(n, share, now_ms) for n in nodes)
    found = sorted((r for r in rooms if r is not None), key=lambda r: r.node_id)
    return RoomView(
        pool=pool_name,
        detail="" if settings.enabled else "borrowing is disabled",
        nodes=tuple(found) if settings.enabled else (),
        pool_wait_ms=demand.pool_wait_ms,
        demand_threshold_ms=demand.threshold_ms,
        demand_holds=demand.holds and settings.enabled,
    )


def unknown_room(pool_name: str, detail: str) -> RoomView:
    """What a watcher is told when the store cannot be read: no room, Demand unknown."""
    return RoomView(pool=pool_name, status=RoomStatus.UNKNOWN, detail=detail)


def material_change(prev: RoomView | None, cur: RoomView, min_change: float) -> bool:
    """True when ``cur`` is worth an update after ``prev`` (the last view sent).

    Material: the first view; status or Demand flipped; the set of nodes with room changed; a
    node's slots changed, or its spare compute or KV moved by more than ``min_change`` (a
    fraction) of what was sent. Pool-wait drift alone is not (heartbeats carry it)."""
    if prev is None:
        return True
    if prev.status is not cur.status or prev.demand_holds != cur.demand_holds:
        return True
    before = {n.node_id: n for n in prev.nodes}
    if set(before) != {n.node_id for n in cur.nodes}:
        return True
    for node in cur.nodes:
        old = before[node.node_id]
        if node.slots != old.slots:
            return True
        for was, now in (
            (old.compute_tokens, node.compute_tokens),
            (old.kv_tokens, node.kv_tokens),
        ):
            if abs(now - was) > min_change * max(was, 1):
                return True
    return False


def update_due(material: bool, since_sent_s: float, min_gap_s: float, heartbeat_s: float) -> bool:
    """Whether a room watch sends the newest view now: a material change (:func:`material_change`)
    once ``min_gap_s`` (one over the watch's rate) has passed since the last update it sent, or
    anything once ``heartbeat_s`` has. The broker's watches and the simulator's router use this
    one rule."""
    return (material and since_sent_s >= min_gap_s) or since_sent_s >= heartbeat_s
