"""Agents that defer storing their lease or load report until something reads it change no
result.

Each tick's lease is computed and counted as before, but reaches the in-process store only
before a read or change of its node there (an Admit, a room view, a commit or release), or at
the next tick when storing it then would expire a reservation; otherwise the next tick's lease
supersedes it unstored (sim/agents.py)."""

from __future__ import annotations

import dataclasses

from crossflow_ctl.domain.lease_credits import LeaseSettings
from crossflow_ctl.domain.models import NodeRole, NoticeKind
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.sim.agents import STORED_LEASE_FIGURES
from crossflow_ctl.sim.cluster import Simulation
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.control import CLOCK_BASE_MS
from crossflow_ctl.sim.metrics import RunRecord
from crossflow_ctl.sim.traces import Trace, TraceRequest
from crossflow_ctl.store.memory import MemoryStore
from tests.store.helpers import MAX_TTL, NOW, credits, lease

LEASES = SimConfig(prefill_nodes=1, decode_nodes=2, policy=PolicyKind.LEASES)

SHORT_HOLDS = LEASES.model_copy(
    update={
        "lease": LeaseSettings(horizon_ms=200),
        "broker_policy": PolicySettings(borrow_horizon_ms=200, commit_ttl_ms=200),
    }
)
"""Committed reservations expire 200 ms after their grant: some before their prompt is prefilled,
some after their release but before a lease that saw the release purged them."""


def _bursts(bursts: int, per_burst: int, gap_s: float, tokens: int = 12_000) -> Trace:
    reqs = tuple(
        TraceRequest(tokens, 200, arrival_s=b * gap_s + i * 0.02, cached_tokens=0)
        for b in range(bursts)
        for i in range(per_burst)
    )
    return Trace(name="bursts", requests=reqs)


def _fields(rec: RunRecord) -> dict[str, object]:
    skip = ("wall_s", *STORED_LEASE_FIGURES)  # lease figures count the leases stored
    return {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec) if f.name not in skip}


async def _run(trace: Trace, cfg: SimConfig, deferred: bool) -> tuple[RunRecord, MemoryStore]:
    store = MemoryStore(seed=cfg.seed)
    sim = Simulation(trace, cfg, store)
    assert sim.control is not None
    if not deferred:
        for agent in sim.control.decode_agents:
            agent.defer(None, sim.control.sync)
        for pool_agent in sim.control.prefill_agents:
            pool_agent.defer(None)
    return await sim.run(), store


async def test_deferred_leases_change_no_result() -> None:
    trace = _bursts(3, 40, 5.0)
    for cfg in (LEASES, LEASES.model_copy(update={"late_binding": False})):
        eager, _ = await _run(trace, cfg, deferred=False)
        deferred, _ = await _run(trace, cfg, deferred=True)
        assert eager.borrowed > 0
        assert _fields(deferred) == _fields(eager)


async def test_short_holds_change_no_result() -> None:
    """Reservations expire on the nodes 200 ms after their grant (EXPIRE notices)."""
    trace = _bursts(3, 40, 3.0, tokens=1_000)
    eager, eager_store = await _run(trace, SHORT_HOLDS, deferred=False)
    deferred, store = await _run(trace, SHORT_HOLDS, deferred=True)
    assert _expired(eager_store) and _expired(store)
    assert deferred.borrowed > 0
    assert _fields(deferred) == _fields(eager)


def _expired(store: MemoryStore) -> int:
    kinds = [n.kind for node in store._nodes.values() for n in node.notices]
    return kinds.count(NoticeKind.EXPIRE)


async def _unclaimed_hold(deferred: bool) -> tuple[int, int]:
    """A reservation granted on an idle node and never committed: it expires 300 ms later, and
    the agent sees it go only through the EXPIRE notice the next stored lease's purge sends.
    Nothing else reads the node, so a deferred lease is stored only because the hold is due."""
    sim = Simulation(_bursts(1, 1, 100.0), LEASES)
    control = sim.control
    assert control is not None
    if not deferred:
        for a in control.decode_agents:
            a.defer(None, control.sync)
        for p in control.prefill_agents:
            p.defer(None)
    await control.start()
    agent, store = control.decode_agents[0], control.store
    await agent.tick(control.broker, 0.0, control.sync(0.0))
    await control._catch_up(0.0)
    hold = await store.try_debit(agent.node_id, credits(1, kv_tokens=50_000), 1.0, 1, 300)
    assert hold.granted
    t = 0.0
    for _ in range(12):
        t += agent.period_s
        await agent.tick(control.broker, t, control.sync(t))
    return agent.last_notice_seq, agent.open_debits.kv


async def test_a_deferred_lease_is_stored_when_a_reservation_is_due() -> None:
    eager = await _unclaimed_hold(deferred=False)
    deferred = await _unclaimed_hold(deferred=True)
    assert eager[0] == 2 and eager[1] == 0  # GRANT then EXPIRE read: nothing left open
    assert deferred == eager


async def test_a_deferred_lease_is_stored_as_received_at_its_tick() -> None:
    """Nothing read the node since its agent's ticks: the store has no lease yet; the first read
    finds the latest, stamped with its tick's time."""
    sim = Simulation(_bursts(1, 1, 1.0), LEASES.model_copy(update={"fast_forward_agents": True}))
    control = sim.control
    assert control is not None
    await control.start()
    agent, store = control.decode_agents[0], control.store
    for t in (0.0, 0.2):
        await agent.tick(control.broker, t, control.sync(t))
    assert (await store.get_node(agent.node_id, control.sync(0.3))).lease is None
    await control._catch_up(0.3)  # what every read of the store does first
    assert control.clock.now_ms() == CLOCK_BASE_MS + 300  # the clock is back at the read
    state = await store.get_node(agent.node_id, control.sync(0.3))
    assert state.lease is not None and state.lease.lease.version == agent.version == 2
    assert state.lease.received_at_ms == control.sync(0.2)


async def test_reservation_due_says_whether_a_reservation_expires_by_then() -> None:
    store = MemoryStore(seed=1)
    assert not store.reservation_due("d1", NOW)
    await store.register_node("d1", NodeRole.DECODE, "default", {}, NOW)
    await store.upsert_lease(lease(), NOW, MAX_TTL)
    assert not store.reservation_due("d1", NOW + 10_000)  # no reservation
    granted = await store.try_debit("d1", credits(10), 1.0, NOW, 1_000)
    assert granted.reservation is not None
    assert not store.reservation_due("d1", NOW + 999)
    assert store.reservation_due("d1", NOW + 1_000)
    await store.release(granted.reservation.reservation_id, NOW + 1)
    assert store.reservation_due("d1", NOW + 1_000)  # released, not purged: it still expires
    await store.upsert_lease(lease(version=2, last_notice_seq=99), NOW + 2, MAX_TTL)
    assert not store.reservation_due("d1", NOW + 1_000)  # purged by a lease that saw it


async def test_notice_seq_is_the_latest_notice_a_reader_would_get() -> None:
    store = MemoryStore(seed=1)
    assert store.notice_seq("d1") == 0
    await store.register_node("d1", NodeRole.DECODE, "default", {}, NOW)
    await store.upsert_lease(lease(), NOW, MAX_TTL)
    assert store.notice_seq("d1") == 0 and await store.read_notices("d1", 0, 10) == []
    granted = await store.try_debit("d1", credits(10), 1.0, NOW, 1_000)
    assert granted.reservation is not None
    await store.release(granted.reservation.reservation_id, NOW + 1)
    notices = await store.read_notices("d1", 0, 10)
    assert store.notice_seq("d1") == notices[-1].seq == 2
    assert await store.read_notices("d1", store.notice_seq("d1"), 10) == []


async def test_deferred_load_reports_are_stored_in_the_order_they_were_taken() -> None:
    """Two prefill servers report; nothing reads the pool until a later read, which finds each
    server's latest report, received at its tick, numbered in the order they were taken."""
    cfg = SimConfig(prefill_nodes=2, decode_nodes=1, policy=PolicyKind.LEASES)
    sim = Simulation(_bursts(1, 1, 1.0), cfg)
    control = sim.control
    assert control is not None
    await control.start()
    first, second = control.prefill_agents
    for t, agent in ((0.10, first), (0.15, second), (0.30, first)):
        await agent.tick(control.broker, t, control.sync(t))
    pools = await control.store.list_pools(control.sync(0.35))
    assert pools == [] or not pools[0].reports  # nothing stored yet
    await control._catch_up(0.35)
    [pool] = await control.store.list_pools(control.sync(0.35))
    by_node = dict(zip((r.node_id for r in pool.reports), pool.report_seqs, strict=True))
    assert by_node[second.node_id] < by_node[first.node_id]  # taken at 0.15, then 0.30
    stored = control.store._pools["default"]
    assert stored[first.node_id].received_at_ms == control.sync(0.30)
    assert stored[second.node_id].received_at_ms == control.sync(0.15)
