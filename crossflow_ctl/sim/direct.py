"""The simulator's direct control plane: the broker's decisions without its service plumbing.

A simulation has one router, one broker replica and an in-process :class:`MemoryStore`, on a
virtual clock, one call at a time. :class:`DirectBroker` is the real
:class:`~crossflow_ctl.service.broker.Broker` (its policy, settings, Admitter memos and prefill
counts, room summaries), with the calls the simulator makes per prompt or lease taken on a
shorter path to the same rules:

* Admit: the store's view read at once (:meth:`MemoryStore.view_now`), the very planning step
  of every Admit (:meth:`Admitter.plan`: Demand, Benefit, Safety through ``plan_admission``),
  then the ranked nodes debited in turn (:meth:`MemoryStore.debit_now`: the store's own
  Safety re-check) as the service's debit rounds do for a lone request. Left out: the request
  record (written for a retry, which the simulator never makes), the group commit's queue, the
  deadline (``within``: simulated time does not pass during a call), the store breaker (the
  in-process store never fails), the debit argument checks (the broker's own policy) and the
  metrics, logs and trace annotations.
* room reads, commits, releases and leases: the same store calls and checks, without the
  admin deadline, the exactly-once wrapper (no request id here) and the timing.

What it decides is the service's decision, request by request: ``tests/sim/test_direct.py``
runs short traces both ways (``SimConfig.direct_control``) and requires identical decision
digests.
"""

from __future__ import annotations

from crossflow_ctl.domain.admission import Admission, AdmissionRequest, Reason
from crossflow_ctl.domain.clock import Clock
from crossflow_ctl.domain.models import Lease, NodeRole, Reservation
from crossflow_ctl.domain.room import RoomView, RoomWatchRequest
from crossflow_ctl.service import Broker, BrokerSettings
from crossflow_ctl.service.admission import (
    MAX_DEBIT_TRIES,
    borrowed_answer,
    debit_request,
    no_room,
)
from crossflow_ctl.store.base import LeaseOutcome
from crossflow_ctl.store.memory import MemoryStore


class DirectBroker(Broker):
    """A :class:`Broker` over a :class:`MemoryStore` whose per-prompt calls skip the service
    plumbing (module doc). Everything else is the Broker's own."""

    def __init__(self, store: MemoryStore, clock: Clock, settings: BrokerSettings) -> None:
        super().__init__(store, clock, settings, "sim", sequential=True)
        self.memory = store

    async def admit(
        self, request: AdmissionRequest, owner: str = "", join: bool = True
    ) -> Admission:
        policy = self.policy
        if not policy.enabled:
            return Admission.normal(Reason.BORROWING_DISABLED, "borrowing is disabled")
        admitter, store = self._admitter, self.memory
        now = self.clock.now_ms()
        pool, nodes = store.view_now(
            request.pool, request.candidate_node_ids, policy.candidate_sample, now
        )
        plan, answer = admitter.plan(request, policy, now, admitter.view_of(pool, nodes, policy))
        if answer is not None:
            return answer
        refusals: list[str] = []
        for check in plan.ranked[:MAX_DEBIT_TRIES]:
            outcome = store.debit_now(
                debit_request(request, owner, check), policy.shares, now, policy.hold_ttl_ms
            )
            if outcome.granted:
                return borrowed_answer(plan, check, outcome)
            refusals.append(f"{check.node_id}: {outcome.refusal}")
        return no_room(plan, refusals)

    async def room_view(self, request: RoomWatchRequest) -> RoomView:
        policy, now = self.policy, self.clock.now_ms()
        pool, nodes = self.memory.view_now(
            request.pool, request.candidate_node_ids, self.settings.room.max_nodes, now
        )
        return self.room_of(request, pool, nodes, policy, now)

    async def commit(
        self,
        reservation_id: str,
        owner: str | None = None,
        request_id: str = "",
        attempt: int = 0,
    ) -> Reservation:
        if request_id:  # exactly once under retries: the service's path
            return await super().commit(reservation_id, owner, request_id, attempt)
        return await self.memory.commit(
            reservation_id, self.clock.now_ms(), self.policy.commit_ttl_ms, owner
        )

    async def release(
        self,
        reservation_id: str,
        outcome: str = "",
        owner: str | None = None,
        request_id: str = "",
        attempt: int = 0,
    ) -> Reservation:
        if request_id:  # exactly once under retries: the service's path
            return await super().release(reservation_id, outcome, owner, request_id, attempt)
        res = await self.memory.release(reservation_id, self.clock.now_ms(), owner)
        self.rooms.poke()
        return res

    async def ingest_lease(self, lease: Lease, role: NodeRole = NodeRole.DECODE) -> LeaseOutcome:
        lease, now_ms = self._lease_to_store(lease, role)
        outcome = await self.memory.upsert_lease(lease, now_ms, self.policy.max_lease_ttl_ms)
        return self._lease_stored(lease, outcome)
