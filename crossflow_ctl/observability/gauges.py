"""The broker's state gauges, refreshed from the store on a period.

Open reservations, borrowed tokens, decode nodes by lease state and per-node available credit,
ITL, ITL SLO and open reservations are shared state (every replica sees the same store), so each
replica polls the store rather than counting its own grants:
:func:`refresh_node_gauges` once, :func:`poll_node_gauges` until a stop event. The caller passes
a function listing the nodes (``Broker.list_nodes``), so this module needs no broker import.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

import structlog

from crossflow_ctl.domain.errors import CrossflowError
from crossflow_ctl.domain.models import NodeRole, NodeState, Share, ZeroReason
from crossflow_ctl.observability.instruments import LENDING, BrokerMetrics

log = structlog.get_logger(__name__)

ListNodes = Callable[[], Awaitable[Sequence[NodeState]]]


class NodeGauges:
    """Pushes a node listing into the gauges and forgets nodes that disappeared."""

    def __init__(
        self,
        metrics: BrokerMetrics,
        now_ms: Callable[[], int],
        share: Callable[[], Share] = lambda: 1.0,
    ) -> None:
        self.metrics = metrics
        self.now_ms = now_ms
        self.share = share
        """The live borrowing shares (``lambda: broker.policy.shares``)."""
        self._known: set[str] = set()

    def update(self, nodes: Sequence[NodeState]) -> None:
        now = self.now_ms()
        share = self.share()
        open_reservations = 0
        borrowed_tokens = 0
        seen: set[str] = set()
        states: dict[str, int] = {}
        for node in nodes:
            open_reservations += node.open_reservations
            borrowed_tokens += node.open_debits.compute_tokens
            if node.info.role is not NodeRole.DECODE:
                continue
            node_id = node.info.node_id
            seen.add(node_id)
            state = lease_state(node, now)
            states[state] = states.get(state, 0) + 1
            self.metrics.set_node_credits(node_id, node.available(now, share))
            live = node.lease is not None and not node.lease.expired(now)
            lease = node.lease.lease if node.lease is not None and live else None
            self.metrics.set_node_load(
                node_id,
                itl_ms=lease.itl_ms if lease is not None else 0.0,
                itl_slo_ms=lease.itl_slo_ms if lease is not None else 0.0,
                open_reservations=node.open_reservations,
            )
        for gone in self._known - seen:
            self.metrics.forget_node(gone)
        self._known = seen
        self.metrics.set_open_reservations(open_reservations)
        self.metrics.set_borrowed_tokens(borrowed_tokens)
        self.metrics.set_decode_nodes(states)


def lease_state(node: NodeState, now_ms: int) -> str:
    """What a decode node lends now: ``lending``, ``no_lease``, ``expired``, ``cordoned`` or its
    zero lease's reason (``no_capacity`` for a lease with no reason and no credit)."""
    if node.info.cordoned:
        return ZeroReason.CORDONED.value
    if node.lease is None:
        return "no_lease"
    if node.lease.expired(now_ms):
        return "expired"
    lease = node.lease.lease
    if lease.zero_reason is not None:
        return lease.zero_reason.value
    return ZeroReason.NO_CAPACITY.value if lease.credits.is_zero() else LENDING


async def refresh_node_gauges(gauges: NodeGauges, list_nodes: ListNodes) -> bool:
    """One refresh; False (and a store error counted) when the listing failed."""
    started = time.perf_counter()
    try:
        nodes = await list_nodes()
    except CrossflowError as exc:
        gauges.metrics.record_store_operation("list_nodes", time.perf_counter() - started, ok=False)
        log.warning("metrics.node_refresh_failed", error=str(exc))
        return False
    gauges.metrics.record_store_operation("list_nodes", time.perf_counter() - started)
    gauges.update(nodes)
    return True


async def poll_node_gauges(
    gauges: NodeGauges, list_nodes: ListNodes, interval_s: float, stop: asyncio.Event
) -> None:
    """Refresh every ``interval_s`` until ``stop`` is set (run it under the supervisor)."""
    while not stop.is_set():
        await refresh_node_gauges(gauges, list_nodes)
        try:
            async with asyncio.timeout(interval_s):
                await stop.wait()
        except TimeoutError:
            pass
