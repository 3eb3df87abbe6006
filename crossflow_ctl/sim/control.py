"""The leases policy's side of a simulation: broker, store, agents and the router's queue.

The broker is the real service class (:class:`crossflow_ctl.service.broker.Broker`) over the
in-process :class:`MemoryStore` (or a given store), on a :class:`ManualClock` the simulator
moves; on the in-process store, by default, its per-prompt calls take the direct path of
:class:`~crossflow_ctl.sim.direct.DirectBroker` to the same rules
(``SimConfig.direct_control``). The router is the client library's :class:`AdmissionQueue`
(late binding), exactly as a live router uses it, with the broker in-process as its
:class:`Admitter`:

* a released prompt is submitted once; BORROW goes to its decode node, NORMAL to prefill, and a
  NORMAL for want of room while the prefill pool is behind is *held*;
* held prompts are re-offered on a room update. The room is read from the store
  (``Broker.room_view``, the read a broker's ``WatchRoom`` feed makes) when a non-zero decode
  lease arrives while anything is held (a release frees room only once a later lease of its
  node arrives, DESIGN.md §5.4, so the lease is the signal), and it reaches the queue through
  the watch's own filter and rate (:func:`~crossflow_ctl.domain.room.update_due` with the
  broker's ``room`` settings): a material change at most once per gap (one over the rate; a
  lease inside the gap has the view read again when it ends), anything once a heartbeat is due;
* a held prompt goes to prefill when the prefill pool has room (its estimated wait is at or
  below the policy's demand threshold: asked on every room update and prefill completion), when
  its hold deadline passes, or when Demand stops holding.

Agents tick every period, or sleep over a fixed point (see :mod:`crossflow_ctl.sim.agents`):
every read of the store (an Admit, a room view) first brings sleeping agents up to date. On the
in-process store an awake agent's lease or load report is stored only before something reads or
changes its node or pool (deferred: a lease nobody read is replaced by the next one), so any new
call into the store or the broker here must first ``flush`` the agents it touches (or
``_catch_up`` all of them), and a policy change mid-run would have to ``_catch_up`` before it: a
deferred lease is capped by the policy in force when it is stored. ``tests/sim/
test_deferred_leases.py`` holds whole runs to storing every tick.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

from crossflow_ctl.client.queue import AdmissionQueue, Outcome
from crossflow_ctl.domain.admission import Admission, AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.clock import ManualClock
from crossflow_ctl.domain.errors import CrossflowError
from crossflow_ctl.domain.models import NodeRole
from crossflow_ctl.domain.room import (
    RoomUpdate,
    RoomView,
    RoomWatchRequest,
    material_change,
    update_due,
)
from crossflow_ctl.domain.safety import over_committed
from crossflow_ctl.service import Broker, BrokerSettings
from crossflow_ctl.service.room import watch_gaps
from crossflow_ctl.sim.agents import DecodeAgent, PrefillAgent
from crossflow_ctl.sim.config import SimConfig
from crossflow_ctl.sim.direct import DirectBroker
from crossflow_ctl.sim.metrics import RunRecord
from crossflow_ctl.sim.servers import DecodeServer, EventQueue, PrefillServer, Req
from crossflow_ctl.store.base import Store
from crossflow_ctl.store.memory import MemoryStore

EV_AGENT = 6
EV_POOL = 7
EV_QUEUE = 8
EV_ROOM = 9
GAP_ROUNDING_S = 1e-9
"""A read queued for the end of a watch's gap (last update + gap) may find ``t - last`` a
rounding below the gap: that much short still counts as the gap over."""

CLOCK_BASE_MS = 1_700_000_000_000
ADMIT_TIMEOUT_MAX_MS = 10_000
ADMIN_TIMEOUT_MAX_MS = 60_000

Handoff = Callable[[Req, int | None, float], Awaitable[None]]
"""The cluster's hand-off: ``(request, decode node index or None for prefill, time)``."""


def _sim_settings(config: SimConfig) -> BrokerSettings:
    """The broker's settings in a simulation: the configured policy, with the wall-clock store
    deadlines at their longest. Simulated time does not pass during a store call, so a deadline
    on the host's clock can only fire when the host is slow (another process had the CPU), and
    a TIMEOUT makes the router's queue send everything it holds to prefill: noise that changes
    the results from one run to the next.

    The KV size of a token and the network bandwidth are the simulated cluster's (the model and
    node presets the servers and agents use), not the policy's defaults: the broker prices
    transfers (Benefit's transfer times, the kv_transfer debit) with the same figures the
    simulated network moves KV at and the agents size their kv_transfer credit with."""
    policy = config.broker_policy.updated(  # validated: a preset out of bounds says so
        {
            "admit_timeout_ms": ADMIT_TIMEOUT_MAX_MS,
            "kv_bytes_per_token": config.model_spec.kv_bytes_per_token,
            "kv_transfer_bytes_per_s": config.node_profile.network_bytes_per_s,
        }
    )
    return BrokerSettings(policy=policy, admin_timeout_ms=ADMIN_TIMEOUT_MAX_MS)


class ControlPlane:
    """Broker + agents + queue for one run (see the module doc)."""

    def __init__(
        self,
        config: SimConfig,
        decode: list[DecodeServer],
        prefill: list[PrefillServer],
        events: EventQueue,
        record: RunRecord,
        dispatch: Handoff,
        pool_wait_s: Callable[[float, int], float],
        prefill_for: Callable[[int, float], int],
        store: Store | None = None,
    ) -> None:
        self.cfg = config
        self.events = events
        self.record = record
        self.dispatch = dispatch
        self.pool_wait_s = pool_wait_s
        self.prefill_for = prefill_for
        self.clock = ManualClock(CLOCK_BASE_MS)
        self.store: Store = store if store is not None else MemoryStore(seed=config.seed)
        # The queue's Admits, one at a time (nothing else calls the broker here).
        settings = _sim_settings(config)
        self.broker = (
            DirectBroker(self.store, self.clock, settings)
            if config.direct_control and isinstance(self.store, MemoryStore)
            else Broker(self.store, self.clock, settings, "sim", sequential=True)
        )
        self.decode_ids = tuple(f"decode-{s.idx}" for s in decode)
        self._index = {node_id: i for i, node_id in enumerate(self.decode_ids)}
        period = config.agent_period_ms / 1000.0
        ff = config.fast_forward_agents
        self.decode_agents = [
            DecodeAgent(
                s,
                self.decode_ids[s.idx],
                config.model_spec,
                config.agent_profile,
                config.lease,
                period,
                config.lease_ttl_ms,
                follow_chunk=config.lease_sized_chunks,
                fast_forward=ff,
                calibration=config.agent_calibration,
            )
            for s in decode
        ]
        self.prefill_agents = [
            PrefillAgent(
                s,
                f"prefill-{s.idx}",
                config.lease,
                period,
                config.lease_ttl_ms,
                config.kv_capacity_tokens,
                fast_forward=ff,
            )
            for s in prefill
        ]
        if ff and isinstance(self.store, MemoryStore):
            for agent in self.decode_agents:
                agent.defer(self.store.reservation_due, self.sync, self.store.notice_seq)
            for pool_agent in self.prefill_agents:
                pool_agent.defer(self.sync)
        self._sleeping: dict[DecodeAgent | PrefillAgent, None] = {}
        self.reqs: dict[int, Req] = {}
        self.now = 0.0
        self.queue = AdmissionQueue(
            self,
            config.queue
            if config.late_binding
            else config.queue.model_copy(update={"max_held": 0}),
            clock=self.clock,
            prefill_room=self._prefill_room,
            on_outcome=self._decided,
            prefill_target=self._prefill_target,
        )
        self._bound_tokens = 0
        """Uncached tokens of prompts the queue sent to prefill that are not dispatched yet: a
        pass that sends several held prompts to prefill sees each one it already sent."""
        self._watch = RoomWatchRequest(candidate_node_ids=self.decode_ids)
        self._room_seq = 0
        self._min_change = settings.room.min_change
        self._min_gap_s, self._heartbeat_s = watch_gaps(self._watch, settings.room)
        self._sent: RoomView | None = None
        """The last view the watch sent (what the next one is judged against)."""
        self._sent_s = -math.inf
        self._room_later = False
        """A read is due when the gap after the last update ends (an EV_ROOM is queued)."""

    # -- clock and agents ----------------------------------------------------------------------
    def sync(self, t: float) -> int:
        now_ms = CLOCK_BASE_MS + int(t * 1000.0)
        self.clock.set(now_ms)
        return now_ms

    async def start(self) -> None:
        self.sync(0.0)
        for node_id in self.decode_ids:
            await self.broker.register(node_id, NodeRole.DECODE, "default", {})
        for agent in self.prefill_agents:
            await self.broker.register(agent.node_id, NodeRole.PREFILL, "default", {})
        period = self.cfg.agent_period_ms / 1000.0
        n = len(self.decode_agents) + len(self.prefill_agents)
        for i, decode_agent in enumerate(self.decode_agents):
            decode_agent.schedule.phase_s = period * i / n
            self.events.push(decode_agent.schedule.next_s, EV_AGENT, i)
        for i, pool_agent in enumerate(self.prefill_agents):
            pool_agent.schedule.phase_s = period * (len(self.decode_agents) + i) / n
            self.events.push(pool_agent.schedule.next_s, EV_POOL, i)

    async def on_event(self, kind: int, target: int, t: float) -> None:
        """An agent period or a hold deadline."""
        self.now = t
        if kind == EV_QUEUE:
            self.sync(t)
            await self._handle(await self.queue.tick(), t)
            return
        if kind == EV_ROOM:
            self._room_later = False
            if self.queue.held:
                await self._room(t)
            return
        agent: DecodeAgent | PrefillAgent
        agent = self.decode_agents[target] if kind == EV_AGENT else self.prefill_agents[target]
        now_ms = self.sync(t)
        held = bool(self.queue.held)
        ticked = (
            await agent.tick(self.broker, t, now_ms, eager=held)
            if isinstance(agent, DecodeAgent)
            else await agent.tick(self.broker, t, now_ms)
        )
        if ticked:
            self.events.push(agent.schedule.next_s, kind, target)
        else:
            self._sleeping[agent] = None
        if kind == EV_AGENT and held and not self.decode_agents[target].zero:
            await self._room(t)

    async def stir(self, agent: DecodeAgent | PrefillAgent, t: float) -> None:
        """Something happened on ``agent``'s server or node: a sleeping agent wakes."""
        if not agent.dormant:
            agent.stirred = True
            return
        await agent.flush(self.broker, t)
        del self._sleeping[agent]
        kind = EV_AGENT if isinstance(agent, DecodeAgent) else EV_POOL
        self.events.push(await agent.wake(self.broker, t, self.sync), kind, agent.server.idx)

    async def _catch_up(self, t: float) -> None:
        """Bring the store up to date for a read at ``t``: deferred leases and load reports
        (these in the order they were taken), then sleepers'. (:meth:`stir` stores one woken
        agent's report on its own, so the store may number reports out of the order they were
        taken; nothing compares them but to a prompt's stamp, taken after a full catch-up.)"""
        for decode_agent in self.decode_agents:
            if decode_agent.pending:  # no coroutine per agent with nothing to store (most)
                await decode_agent.flush(self.broker, t)
        waiting = [a for a in self.prefill_agents if a.pending_s is not None]
        if len(waiting) > 1:
            waiting.sort(key=lambda a: a.pending_s or 0.0)
        for pool_agent in waiting:
            await pool_agent.flush(self.broker, t)
        for agent in self._sleeping:
            if agent.schedule.next_s <= t:  # else no period passed: nothing to publish again
                await agent.catch_up(self.broker, t, self.sync)

    async def finish(self, t: float) -> None:
        """Count the periods sleeping agents slept through, up to the end of the run."""
        await self._catch_up(t)
        rec = self.record
        for agent in self.decode_agents:
            rec.leases += agent.leases
            rec.lease_chunk_sum += agent.chunk_sum
            for why, n in agent.zero_reasons.items():
                rec.zero_reasons[why] = rec.zero_reasons.get(why, 0) + n
            for name, v in agent.credit_sums.items():
                rec.lease_credit_sums[name] = rec.lease_credit_sums.get(name, 0.0) + v
        stats = self.queue.stats
        rec.held = stats.held_outcomes
        rec.outcomes = {cause.value: n for cause, n in sorted(stats.by_dispatch.items())}
        rec.reoffers = stats.reoffers

    # -- the router ------------------------------------------------------------------------------
    async def admit(self, request: AdmissionRequest) -> Admission:
        """The queue's :class:`Admitter`: the broker in-process, on an up-to-date store. Each
        offer names the prefill server the prompt would go to now: a re-offer as the queue
        made it (:meth:`_prefill_target`, asked just before), a first offer named here."""
        t = self.now
        if request.prefill_node_id is None:  # a validated node id: no validation, per offer
            request = request.replaced(prefill_node_id=self._prefill_target(request))
        await self._catch_up(t)
        self.sync(t)
        answer = await self.broker.admit(request)
        reasons = self.record.admit_reasons
        reasons[answer.reason.value] = reasons.get(answer.reason.value, 0) + 1
        if answer.plan is not None and answer.reason is Reason.NO_ROOM:
            short = self.record.short_credits
            for check in answer.plan.nodes:
                for name in check.short_credits:
                    short[name] = short.get(name, 0) + 1
        return answer

    async def offer(self, req: Req, t: float) -> None:
        """Submit a released prompt; its outcome reaches ``dispatch`` now or once decided."""
        self.now = t
        self.reqs[req.rid] = req
        # Every field, in order, in bounds (the trace's token counts, validated node ids):
        # built without validation, once per released prompt.
        request = AdmissionRequest.trusted(
            request_id=str(req.rid),
            uncached_prompt_tokens=req.uncached_tokens,
            cached_prefix_tokens=req.cached_tokens,
            cached_prefix_node_id=None,
            expected_output_tokens=req.output_tokens,
            candidate_node_ids=self.decode_ids,
            dry_run=False,
            pool="default",
            attempt=0,
            held_ahead_tokens=0,
            prefill_node_id=None,
            explain=False,
        )
        ticket = await self.queue.submit(request)
        if ticket.outcome is not None:
            await self._handle([ticket.outcome], t)
        else:
            deadline = self.queue.next_deadline_ms()
            if deadline is not None:
                self.events.push((deadline - CLOCK_BASE_MS + 0.5) / 1000.0, EV_QUEUE, 0)

    async def released(self, req: Req, t: float) -> None:
        """``req``'s borrowed prefill finished on its node: release the reservation."""
        self.now = t
        node = self._index.get(req.node_id, -1)
        if node >= 0:
            agent = self.decode_agents[node]
            agent.open_borrows -= 1
            await agent.flush(self.broker, t)
        try:
            self.sync(t)
            await self.broker.release(req.reservation_id, "prefilled")
        except CrossflowError:
            self.record.release_failures += 1

    async def prefill_freed(self, t: float) -> None:
        if self.queue.held:
            self.now = t
            self.sync(t)
            await self._handle(await self.queue.tick(), t)

    def _prefill_target(self, request: AdmissionRequest) -> str:
        """The prefill server ``request``'s prompt would go to now (the queue names it on each
        re-offer)."""
        rid = int(request.request_id.partition("#")[0])  # a re-offer's id: ``<id>#<offer>``
        return self.prefill_agents[self.prefill_for(rid, self.now)].node_id

    def _prefill_room(self, request: AdmissionRequest) -> bool:
        wait_s = self.pool_wait_s(self.now, self._bound_tokens)
        return wait_s * 1000.0 <= self.cfg.prefill_room_ms

    def _decided(self, outcome: Outcome) -> None:
        if not outcome.borrowed:
            self._bound_tokens += outcome.request.uncached_prompt_tokens

    async def _room(self, t: float) -> None:
        """The room may have changed: the watch reads it and sends it on if its filter and rate
        let it (see the module doc)."""
        since_s = t - self._sent_s
        if since_s < self._min_gap_s - GAP_ROUNDING_S:
            if not self._room_later:  # read again when the gap ends (the newest view then)
                self._room_later = True
                self.events.push(self._sent_s + self._min_gap_s, EV_ROOM, 0)
            return
        await self._catch_up(t)
        self.sync(t)
        view = await self.broker.room_view(self._watch)
        material = material_change(self._sent, view, self._min_change)
        since_s = max(since_s, self._min_gap_s)  # the gap is over (``t`` may round below it)
        if not update_due(material, since_s, self._min_gap_s, self._heartbeat_s):
            return
        self._sent, self._sent_s = view, t
        self._room_seq += 1
        update = RoomUpdate(
            seq=self._room_seq, at_ms=self.clock.now_ms(), heartbeat=not material, view=view
        )
        await self._handle(await self.queue.on_room(update), t)

    async def _handle(self, outcomes: list[Outcome], t: float) -> None:
        for outcome in outcomes:
            req = self.reqs.pop(int(outcome.request.request_id))
            answer = outcome.admission
            node: int | None = None
            if answer.decision is Decision.BORROW:
                node = await self._commit(req, answer, t)
            else:
                self._bound_tokens -= outcome.request.uncached_prompt_tokens
            await self.dispatch(req, node, t)

    async def _commit(self, req: Req, answer: Admission, t: float) -> int | None:
        await self._check_overcommit(answer.node_id, t)
        try:
            await self.broker.commit(answer.reservation_id)
        except CrossflowError:
            self.record.release_failures += 1
            return None
        node = self._index[answer.node_id]
        req.reservation_id = answer.reservation_id
        req.node_id = answer.node_id
        agent = self.decode_agents[node]
        agent.open_borrows += 1
        await self.stir(agent, t)
        return node

    async def _check_overcommit(self, node_id: str, t: float) -> None:
        await self.decode_agents[self._index[node_id]].flush(self.broker, t)
        state = await self.store.get_node(node_id, self.sync(t))
        if state.lease is None:
            self.record.overcommits += 1
            return
        share = self.cfg.broker_policy.shares
        lease = state.lease.lease
        rate = lease.borrowed_prefill_rate_tps
        if over_committed(lease.credits, state.open_debits, share, rate, state.open_compute):
            self.record.overcommits += 1
