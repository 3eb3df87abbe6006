"""A re-offer pass does not offer what its own grants took (``PassRoom``): on a room update,
each prompt borrowed takes its debit off its node, and a later prompt no node's room left can
take is skipped instead of being refused NO_ROOM. Only sure refusals are skipped: the compute
is priced as Admit prices it (the view carries each lease's pricing), and not judged where the
view does not say it."""

from __future__ import annotations

import pytest

from crossflow_ctl.client.holding import Held, PassRoom, QueueConfig, granted_debit
from crossflow_ctl.client.queue import AdmissionQueue
from crossflow_ctl.domain.admission import (
    Admission,
    AdmissionRequest,
    Decision,
    DemandCheck,
    NodeCheck,
    Plan,
    Reason,
    plan_admission,
)
from crossflow_ctl.domain.clock import ManualClock
from crossflow_ctl.domain.lending import compute_debit
from crossflow_ctl.domain.models import (
    ComputeTime,
    Credits,
    Lease,
    NodeInfo,
    NodeState,
    PoolLoad,
    PoolSnapshot,
    StoredLease,
)
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.domain.room import NodeRoom, RoomUpdate, RoomView, summarize_room

RATE = 1_000.0
FULL = 1.0 / RATE
"""A token's time per uncached token: a prompt's compute debit is its uncached tokens."""
NOW = 1_700_000_000_000
HALF = 0.5 / RATE
"""Half that: a prompt's compute debit is half its uncached tokens."""


def priced(tokens: int, a_s: float = FULL) -> int:
    return compute_debit(tokens, 0, a_s, 0.0, RATE).tokens


class PricingBroker:
    """Answers as the broker does for one node: BORROW while the prompt's priced compute fits
    the node's room and it has a slot, with the debit in the answer's explanation (as a unary
    Admit's is); NO_ROOM otherwise."""

    def __init__(
        self,
        compute: int,
        slots: int = 16,
        explain: bool = True,
        a_s: float = FULL,
        say_debit: bool = False,
    ) -> None:
        self.compute, self.slots, self.explain, self.a_s = compute, slots, explain, a_s
        self.say_debit = say_debit
        """Whether the answer carries ``debit`` (brokers since that field do)."""
        self.calls: list[str] = []

    async def admit(self, request: AdmissionRequest) -> Admission:
        self.calls.append(request.request_id)
        need = priced(request.uncached_prompt_tokens, self.a_s)
        if need > self.compute or self.slots < 1:
            return Admission.normal(Reason.NO_ROOM, "no room")
        self.compute -= need
        self.slots -= 1
        debit = Credits(compute_tokens=need, kv_tokens=request.uncached_prompt_tokens, slots=1)
        check = NodeCheck(node_id="d1", verdict=Reason.BORROWED, debit=debit)
        demand = DemandCheck(holds=True, pool_wait_ms=500.0, threshold_ms=100.0)
        plan = Plan(reason=Reason.BORROWED, demand=demand, nodes=(check,), ranked=(check,))
        return Admission(
            decision=Decision.BORROW,
            reason=Reason.BORROWED,
            node_id="d1",
            reservation_id=f"r{len(self.calls)}@d1",
            plan=plan if self.explain else None,
            debit=debit if self.say_debit else None,
        )


def update(compute: int, slots: int = 16, rate: float = RATE, a_s: float = FULL) -> RoomUpdate:
    node = NodeRoom(
        node_id="d1",
        compute_tokens=compute,
        kv_tokens=10**6,
        slots=slots,
        borrowed_prefill_rate_tps=rate,
        prefill_s_per_token=a_s if rate else 0.0,
    )
    view = RoomView(nodes=(node,), demand_holds=True, pool_wait_ms=500.0)
    return RoomUpdate(seq=1, at_ms=0, view=view)


async def held_queue(
    broker: PricingBroker, sizes: list[int], behind: bool
) -> tuple[AdmissionQueue, list[str]]:
    """A queue holding one prompt per size (refused NO_ROOM on their first offer)."""
    compute, slots = broker.compute, broker.slots
    broker.compute = 0
    clock = ManualClock(0)
    config = QueueConfig(fresh_first_ms=1 if behind else None, max_hold_ms=60_000)
    queue = AdmissionQueue(broker, config, clock=clock)
    ids = [f"p{i}" for i in range(len(sizes))]
    for rid, tokens in zip(ids, sizes, strict=True):
        await queue.submit(AdmissionRequest(request_id=rid, uncached_prompt_tokens=tokens))
    clock.advance(10)
    broker.compute, broker.slots = compute, slots
    broker.calls.clear()
    return queue, ids


@pytest.mark.parametrize("behind", [False, True])
async def test_a_pass_does_not_offer_what_its_grants_took(behind: bool) -> None:
    """Room for one prompt: the first borrows, the two after it are not offered at all (they
    were refused NO_ROOM, an Admit each, in queue order until the first refusal, behind all)."""
    broker = PricingBroker(compute=priced(1_000) + 100)
    queue, _ = await held_queue(broker, [1_000, 1_000, 1_000], behind)
    await queue.on_room(update(broker.compute + 0))
    assert len(broker.calls) == 1
    assert queue.held == 2 and queue.stats.reoffers == 1


async def test_the_room_left_is_priced_as_admit_prices_it() -> None:
    """A prompt's compute debit is half its uncached tokens here: after one grant the room left
    (700) still takes a 1,000-token prompt (debit 500), which a test on its uncached tokens
    would have skipped; the two after it, with 200 left, are not offered."""
    broker = PricingBroker(compute=1_200, a_s=HALF)
    queue, _ = await held_queue(broker, [1_000, 1_000, 1_000, 1_000], behind=True)
    await queue.on_room(update(1_200, a_s=HALF))
    assert len(broker.calls) == 2 and broker.compute == 200
    assert queue.held == 2


@pytest.mark.parametrize("behind", [False, True])
async def test_a_prompt_left_without_room_counts_as_refused(behind: bool) -> None:
    """After the first grant, the second prompt (1,000) no longer fits, the third (100) does:
    behind, the pass skips the second and offers the third; in queue order it ends at the
    second, as a refusal would end it (no prompt overtakes an older one that found no room)."""
    broker = PricingBroker(compute=1_500)
    queue, _ = await held_queue(broker, [1_000, 1_000, 100], behind)
    await queue.on_room(update(1_500))
    assert broker.calls == (["p0#2", "p2#2"] if behind else ["p0#2"])
    assert queue.held == (1 if behind else 2)


async def test_a_node_out_of_slots_takes_no_more() -> None:
    broker = PricingBroker(compute=100_000, slots=2)
    queue, _ = await held_queue(broker, [100, 100, 100, 100], behind=False)
    await queue.on_room(update(100_000, slots=2))
    assert len(broker.calls) == 2 and queue.held == 2


async def test_compute_is_not_judged_where_the_view_does_not_price_it() -> None:
    """A view without the lease's rate (a broker before the pricing fields): the pass cannot
    tell what a prompt would debit, so it offers as before (the refusal ends a pass in queue
    order)."""
    broker = PricingBroker(compute=priced(1_000) + 100)
    queue, _ = await held_queue(broker, [1_000, 1_000, 1_000], behind=True)
    await queue.on_room(update(broker.compute, rate=0.0))
    assert len(broker.calls) == 3 and queue.held == 2


async def test_a_grant_without_explanation_takes_its_debit_off() -> None:
    """An AdmitStream decision carries no explanation but says its debit: the pass takes it
    off as from a unary answer (one Admit, not three)."""
    broker = PricingBroker(compute=priced(1_000) + 100, explain=False, say_debit=True)
    queue, _ = await held_queue(broker, [1_000, 1_000, 1_000], behind=True)
    await queue.on_room(update(broker.compute))
    assert len(broker.calls) == 1 and queue.held == 2


async def test_a_grant_that_does_not_say_its_debit_takes_nothing_off() -> None:
    """A broker before ``Admission.debit``, on AdmitStream (no explanation): the pass goes on
    as if it had not borrowed, and the broker refuses what does not fit."""
    broker = PricingBroker(compute=priced(1_000) + 100, explain=False)
    queue, _ = await held_queue(broker, [1_000, 1_000, 1_000], behind=True)
    await queue.on_room(update(broker.compute))
    assert len(broker.calls) == 3 and queue.held == 2


def test_granted_debit_reads_the_granting_nodes_check() -> None:
    demand = DemandCheck(holds=True, pool_wait_ms=1.0, threshold_ms=0.0)
    mine = NodeCheck(node_id="d2", verdict=Reason.BORROWED, debit=Credits(compute_tokens=7))
    other = NodeCheck(node_id="d1", verdict=Reason.BORROWED, debit=Credits(compute_tokens=3))
    plan = Plan(reason=Reason.BORROWED, demand=demand, nodes=(other, mine), ranked=(other, mine))
    borrow = Admission(decision=Decision.BORROW, reason=Reason.BORROWED, node_id="d2", plan=plan)
    assert granted_debit(borrow) == Credits(compute_tokens=7)
    assert granted_debit(borrow.model_copy(update={"plan": None})) is None
    said = Credits(compute_tokens=9)  # the answer's own debit wins over its explanation
    assert granted_debit(borrow.model_copy(update={"debit": said})) == said
    assert granted_debit(borrow.model_copy(update={"debit": said, "plan": None})) == said
    assert granted_debit(Admission.normal(Reason.NO_ROOM, "", plan)) is None


def test_node_room_prices_as_compute_debit() -> None:
    node = update(1_000, a_s=HALF).view.nodes[0]
    assert node.compute_need(3_000, 0) == compute_debit(3_000, 0, HALF, 0.0, RATE).tokens == 1_500
    assert node.compute_need(3_000, 10_000) == 1_500  # no context cost (b = 0) in this view
    assert update(1_000, rate=0.0).view.nodes[0].compute_need(3_000, 0) is None
    room = PassRoom(update(1_000).view, with_kv=False)
    assert room._nodes["d1"].compute_tokens == 1_000


def test_a_prompt_at_the_rounding_edge_is_offered() -> None:
    """Safety counts a timed debit on the node's open node time, which can need one token less
    than the debit's own rounding: a view showing 1 token of compute left, for a prompt priced
    at 2, is a grant, so the pass must not skip it (review of this change)."""
    lease = Lease(
        node_id="d1",
        epoch=1,
        version=1,
        ttl_ms=10_000,
        credits=Credits(compute_tokens=2, kv_tokens=10**6, output_tokens=10**6, slots=8),
        borrowed_prefill_rate_tps=1_000.0,
        prefill_s_per_token=1.5e-3,  # a token: 1.5 ms, 1.5 compute tokens at 1,000/s
    )
    node = NodeState(
        info=NodeInfo(node_id="d1"),
        lease=StoredLease(lease=lease, received_at_ms=NOW, expires_at_ms=NOW + 10_000),
        open_debits=Credits(compute_tokens=1, slots=1),
        open_compute=ComputeTime(500, 1),  # half a millisecond open: 1 token, rounded up
    )
    policy = PolicySettings(borrow_share=1.0)
    load = PoolLoad(
        node_id="p1", outstanding_uncached_tokens=10**6, processing_rate_tps=1_000, ttl_ms=10**6
    )
    pool = PoolSnapshot(pool="default", reports=(load,))
    request = AdmissionRequest(request_id="x", uncached_prompt_tokens=1)
    plan = plan_admission(request, pool, [node], policy, NOW)
    assert plan.reason is Reason.BORROWED  # the broker grants it
    view = summarize_room("default", pool, [node], policy, NOW)
    assert view.nodes[0].compute_tokens == 1 and view.nodes[0].compute_need(1, 0) == 2
    held = Held(
        key="x",
        request=request,
        seq=0,
        since_ms=0,
        deadline_ms=1,
        last=Admission.normal(Reason.NO_ROOM, ""),
    )
    assert PassRoom(view, with_kv=False).fits(held)


async def test_kv_is_judged_only_when_the_queue_is_behind() -> None:
    """Behind, a prompt needing more KV than any node has left is refused without its Admit;
    in queue order KV is not judged (its refusal ends the pass, so later prompts do not
    overtake it for ever)."""
    for behind, calls in ((True, 1), (False, 2)):
        broker = PricingBroker(compute=100_000)
        queue, _ = await held_queue(broker, [1_000, 1_000], behind)
        kv_for_one = update(100_000).view.nodes[0].model_copy(update={"kv_tokens": 1_500})
        view = RoomView(nodes=(kv_for_one,), demand_holds=True, pool_wait_ms=500.0)
        await queue.on_room(RoomUpdate(seq=1, at_ms=0, view=view))
        assert len(broker.calls) == calls, behind
