"""AdmissionQueue (late binding) on a fake admitter and a manual clock: no sleeps, no network.

The fake admitter answers like the broker would: NO_DEMAND while the pool is not behind, BORROW
while it has room for the prompt's uncached tokens (debiting it), NO_ROOM otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossflow_ctl.client.holding import Dispatch, HoldBook, QueueConfig, _MinBag, _Room
from crossflow_ctl.client.queue import AdmissionQueue, Outcome, Ticket
from crossflow_ctl.domain.admission import Admission, AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.clock import ManualClock
from crossflow_ctl.domain.errors import StoreUnavailable
from crossflow_ctl.domain.room import NodeRoom, RoomStatus, RoomUpdate, RoomView


class FakeBroker:
    def __init__(self, room: int = 0, demand: bool = True) -> None:
        self.room = room
        self.demand = demand
        self.down = False
        self.down_reason = Reason.STORE_UNAVAILABLE
        self.broken = False
        self.records: dict[str, Admission] | None = None
        """When set, answers are replayed by request_id (a broker keeping request records)."""
        self.calls: list[str] = []
        self.ahead: dict[str, int] = {}
        """held_ahead_tokens of each call, by request_id."""
        self.on_call: Callable[[AdmissionRequest], None] | None = None
        self.fits: Callable[[AdmissionRequest], bool] = lambda request: True
        """Whether the prompt fits the room's other credits (KV), besides compute."""
        self._rid = 0

    async def admit(self, request: AdmissionRequest) -> Admission:
        self.calls.append(request.request_id)
        self.ahead[request.request_id] = request.held_ahead_tokens
        if self.on_call is not None:
            self.on_call(request)
        if self.records is not None and request.request_id in self.records:
            return self.records[request.request_id]
        answer = await self._answer(request)
        if self.records is not None:
            self.records[request.request_id] = answer
        return answer

    async def _answer(self, request: AdmissionRequest) -> Admission:
        if self.broken:
            raise StoreUnavailable("transport error")
        if self.down:
            return Admission.normal(self.down_reason, "down")
        if not self.demand:
            return Admission.normal(Reason.NO_DEMAND, "prefill keeps up")
        if request.uncached_prompt_tokens > self.room or not self.fits(request):
            return Admission.normal(Reason.NO_ROOM, "no room")
        self.room -= request.uncached_prompt_tokens
        self._rid += 1
        return Admission(
            decision=Decision.BORROW,
            reason=Reason.BORROWED,
            node_id="d1",
            reservation_id=f"r{self._rid}@d1",
        )


def req(rid: str, tokens: int = 1_000, cached: int = 0) -> AdmissionRequest:
    return AdmissionRequest(
        request_id=rid, uncached_prompt_tokens=tokens, cached_prefix_tokens=cached
    )


def room(compute: int, *, demand: bool = True, seq: int = 1) -> RoomUpdate:
    nodes = (NodeRoom(node_id="d1", compute_tokens=compute, kv_tokens=10**6, slots=4),)
    view = RoomView(nodes=nodes if compute else (), demand_holds=demand, pool_wait_ms=500.0)
    return RoomUpdate(seq=seq, at_ms=0, view=view)


def make(
    broker: FakeBroker, clock: ManualClock, **config: object
) -> tuple[AdmissionQueue, list[Outcome]]:
    seen: list[Outcome] = []
    queue = AdmissionQueue(
        broker, QueueConfig.model_validate(config), clock=clock, on_outcome=seen.append
    )
    return queue, seen


def dispatches(tickets: Iterable[Ticket]) -> list[Dispatch | None]:
    return [t.outcome.dispatch if t.outcome else None for t in tickets]


async def test_held_then_borrowed_when_room_appears() -> None:
    broker, clock = FakeBroker(room=0), ManualClock(0)
    queue, seen = make(broker, clock, max_hold_ms=1_000)
    a = await queue.submit(req("a"))
    assert not a.done() and queue.held == 1 and queue.stats.held == 1
    clock.advance(120)
    broker.room = 5_000
    await queue.on_room(room(5_000))
    out = await a
    assert out.dispatch is Dispatch.BORROWED_LATE and out.borrowed
    assert out.admission.reservation_id == "r1@d1"
    assert out.held_ms == 120 and out.offers == 2 and out.held
    assert queue.held == 0 and seen == [out]
    assert queue.stats.reoffers == 1 and queue.stats.hold_ms_total == 120


async def test_reoffers_use_their_own_request_ids_so_recorded_answers_do_not_replay() -> None:
    broker, clock = FakeBroker(room=0), ManualClock(0)
    broker.records = {}
    queue, _ = make(broker, clock)
    ticket = await queue.submit(req("a"))
    await queue.on_room(room(1_000))  # the broker has none left: refused as "a#2"
    broker.room = 5_000
    await queue.on_room(room(5_000))
    assert broker.calls == ["a", "a#2", "a#3"]
    assert ticket.outcome is not None and ticket.outcome.dispatch is Dispatch.BORROWED_LATE
    assert ticket.outcome.request.request_id == "a" and ticket.outcome.offers == 3
    long_id = "x" * 256
    book: HoldBook[str] = HoldBook(QueueConfig())
    book.hold("k", req(long_id), Admission.normal(Reason.NO_ROOM, ""), 0)
    again = book.reoffer_request(next(iter(book)))
    assert again.request_id.endswith("#2") and len(again.request_id) == 256
    assert AdmissionRequest.model_validate(again.model_dump()) == again
    anonymous: HoldBook[str] = HoldBook(QueueConfig())
    anonymous.hold("k", req(""), Admission.normal(Reason.NO_ROOM, ""), 0)
    assert anonymous.reoffer_request(next(iter(anonymous))).request_id == ""


async def test_first_offer_borrow_and_no_demand_are_not_held() -> None:
    broker, clock = FakeBroker(room=1_000), ManualClock(0)
    queue, _ = make(broker, clock)
    borrowed = await queue.submit(req("a"))
    broker.demand = False
    normal = await queue.submit(req("b"))
    assert dispatches([borrowed, normal]) == [Dispatch.BORROWED, Dispatch.NOT_HELD]
    assert not any(t.outcome is not None and t.outcome.held for t in (borrowed, normal))
    assert normal.outcome is not None and normal.outcome.admission.reason is Reason.NO_DEMAND
    assert queue.held == 0


async def test_reoffers_in_fifo_order_until_one_is_refused() -> None:
    broker, clock = FakeBroker(room=0), ManualClock(0)
    queue, _ = make(broker, clock)
    tickets = [await queue.submit(req(r, t)) for r, t in (("a", 2_000), ("b", 3_000), ("c", 500))]
    broker.calls.clear()
    broker.room = 4_000
    await queue.on_room(room(4_000))
    # a borrows (2,000 left), b is refused: the pass stops, c is not offered though it would fit.
    assert broker.calls == ["a#2", "b#2"]
    assert dispatches(tickets) == [Dispatch.BORROWED_LATE, None, None]
    assert [r.request_id for r in queue.held_requests()] == ["b", "c"]


async def test_shortest_first_order_and_prompts_too_big_for_any_node_are_skipped() -> None:
    broker, clock = FakeBroker(room=0), ManualClock(0)
    queue, _ = make(broker, clock, order="shortest")
    tickets = [await queue.submit(req(r, t)) for r, t in (("a", 9_000), ("b", 3_000), ("c", 500))]
    broker.calls.clear()
    broker.room = 4_000
    await queue.on_room(room(4_000))
    # c then b fit (3,500 of 4,000); a needs more than any node has and is never offered.
    assert broker.calls == ["c#2", "b#2"]
    assert dispatches(tickets) == [None, Dispatch.BORROWED_LATE, Dispatch.BORROWED_LATE]


async def test_each_offer_carries_the_tokens_held_ahead_of_the_prompt() -> None:
    broker, clock = FakeBroker(room=0), ManualClock(0)
    queue, _ = make(broker, clock)
    tickets = [await queue.submit(req(r, t)) for r, t in (("a", 2_000), ("b", 3_000), ("c", 500))]
    assert broker.ahead == {"a": 0, "b": 2_000, "c": 5_000}
    broker.room = 4_000
    await queue.on_room(room(4_000))
    # a borrows, so nothing is held ahead of b any more when b is offered.
    assert (broker.ahead["a#2"], broker.ahead["b#2"]) == (0, 0)
    await queue.on_room(room(1_000))  # b is too big for it and stays ahead of c
    assert broker.ahead["c#2"] == 3_000 and dispatches(tickets)[2] is Dispatch.BORROWED_LATE
    # What the router holds is its own: the ticket keeps the request as submitted.
    assert tickets[1].request.held_ahead_tokens == 0


async def test_each_reoffer_names_the_prefill_server_of_now_not_of_the_first_offer() -> None:
    """A held prompt's first offer named the server a NORMAL answer would have sent it to
    then; by a re-offer that server may be jammed or gone. The router's hook names the one of
    now; without a hook a re-offer names none (the broker reads the least-loaded server)."""
    for hook, want in ((lambda request: "prefill-2", "prefill-2"), (None, None)):
        broker, clock = FakeBroker(room=0), ManualClock(0)
        named: dict[str, str | None] = {}

        def note(request: AdmissionRequest, named: dict[str, str | None] = named) -> None:
            named[request.request_id] = request.prefill_node_id

        broker.on_call = note
        queue = AdmissionQueue(broker, QueueConfig(), clock=clock, prefill_target=hook)
        first = req("a").model_copy(update={"prefill_node_id": "prefill-1"})
        ticket = await queue.submit(first)
        broker.room = 5_000
        await queue.on_room(room(5_000))
        assert (await ticket).dispatch is Dispatch.BORROWED_LATE
        assert named == {"a": "prefill-1", "a#2": want}


async def test_a_prefill_target_hook_that_raises_names_no_server_and_the_queue_goes_on() -> None:
    def broken(request: AdmissionRequest) -> str | None:
        raise LookupError("the router's server table is empty")

    broker, clock = FakeBroker(room=0), ManualClock(0)
    queue = AdmissionQueue(broker, QueueConfig(), clock=clock, prefill_target=broken)
    ticket = await queue.submit(req("a"))
    broker.room = 5_000
    await queue.on_room(room(5_000))
    assert (await ticket).dispatch is Dispatch.BORROWED_LATE and not queue.closed


async def test_shortest_order_counts_only_shorter_prompts_ahead() -> None:
    broker, clock = FakeBroker(room=0), ManualClock(0)
    queue, _ = make(broker, clock, order="shortest")
    for r, t in (("a", 9_000), ("b", 3_000), ("c", 500), ("d", 3_000)):
        await queue.submit(req(r, t))
    assert broker.ahead == {"a": 0, "b": 0, "c": 0, "d": 3_500}
    broker.room = 500
    await queue.on_room(room(3_000))  # a is too big to offer; its tokens are behind d's anyway
    assert [(r, broker.ahead[r]) for r in broker.calls[4:]] == [("c#2", 0), ("b#2", 0)]


async def test_a_queue_behind_offers_room_to_fresh_prompts_smallest_first() -> None:
    """Once the oldest prompt is held fresh_first_ms, room goes to the prompts held less than
    that, fewest KV tokens (prompt, cached prefix included, and output) first; a refusal
    skips; prefill still takes the oldest."""
    broker, clock = FakeBroker(room=0), ManualClock(0)
    queue, _ = make(broker, clock, max_hold_ms=60_000, fresh_first_ms=1_000)
    old = await queue.submit(req("old", 500))
    clock.advance(600)
    fresh = [
        await queue.submit(req(r, t, cached))
        for r, t, cached in (("big", 3_000, 0), ("cached", 500, 9_000), ("small", 1_000, 0))
    ]
    broker.calls.clear()
    clock.advance(400)  # old has been held 1,000 ms: the queue is behind
    broker.room = 1_000
    await queue.on_room(room(3_000))
    # small (1,000 KV) borrows; big (3,000) is refused and skipped; cached (9,500 KV) is
    # refused; old, no longer fresh, comes last and is refused too.
    assert broker.calls == ["small#2", "big#2", "cached#2", "old#2"]
    assert dispatches([old, *fresh]) == [None, None, None, Dispatch.BORROWED_LATE]
    # Each offer carries what prefill takes before it (arrival order), less what borrowed.
    assert [broker.ahead[c] for c in broker.calls] == [4_000, 500, 3_500, 0]
    assert [r.request_id for r in queue.held_requests()] == ["old", "big", "cached"]


async def test_a_queue_behind_with_nothing_fresh_offers_room_oldest_first() -> None:
    """When arrivals stop nothing is fresh: room takes the oldest, as prefill does, so the
    tail is no longer than in arrival order. Newest order puts the fresh ones newest first."""
    broker, clock = FakeBroker(room=0), ManualClock(0)
    queue, _ = make(broker, clock, max_hold_ms=60_000, fresh_first_ms=1_000)
    for r in ("a", "b", "c"):
        await queue.submit(req(r, 1_000))
        clock.advance(10)
    clock.advance(2_000)
    broker.calls.clear()
    broker.room = 2_000
    await queue.on_room(room(2_000))
    assert broker.calls == ["a#2", "b#2", "c#2"]
    assert [r.request_id for r in queue.held_requests()] == ["c"]
    newest, _ = make(broker, clock, max_hold_ms=60_000, fresh_first_ms=1_000, fresh_order="newest")
    broker.room = 0
    for r in ("x", "y", "z"):
        await newest.submit(req(r, 1_000))
        clock.advance(400)
    broker.calls.clear()
    broker.room = 1_000
    await newest.on_room(room(1_000))  # x held 1,200 ms: behind; y and z are fresh
    assert broker.calls == ["z#2", "y#2", "x#2"]


@pytest.mark.parametrize("behind", [False, True])
async def test_a_queue_behind_does_not_offer_prompts_needing_more_kv_than_any_node_has(
    behind: bool,
) -> None:
    """Behind, a prompt whose least KV (uncached, plus a cached prefix no decode node holds)
    is above every node's KV room is skipped like one too big for the compute room. In queue
    order it is offered: its refusal ends the pass, so no later prompt overtakes it."""
    broker, clock = FakeBroker(room=0), ManualClock(0)
    queue, _ = make(broker, clock, max_hold_ms=60_000, fresh_first_ms=1_000)
    remote = await queue.submit(req("remote", 500, cached=2_000))
    local = await queue.submit(
        AdmissionRequest(
            request_id="local",
            uncached_prompt_tokens=500,
            cached_prefix_tokens=2_000,
            cached_prefix_node_id="d1",
        )
    )
    clock.advance(2_000 if behind else 500)
    broker.calls.clear()
    broker.fits = lambda r: r.request_id != "remote#2"  # the node's KV room, as Admit sees it
    broker.room = 5_000
    view = room(5_000).view
    small_kv = view.model_copy(
        update={"nodes": (view.nodes[0].model_copy(update={"kv_tokens": 1_000}),)}
    )
    await queue.on_room(RoomUpdate(seq=2, at_ms=0, view=small_kv))
    if behind:
        assert broker.calls == ["local#2"]
        assert dispatches([remote, local]) == [None, Dispatch.BORROWED_LATE]
    else:
        assert broker.calls == ["remote#2"]
        assert dispatches([remote, local]) == [None, None]


def test_fresh_first_ms_is_validated() -> None:
    with pytest.raises(ValueError, match="fresh_first_ms"):
        QueueConfig(fresh_first_ms=0)
    with pytest.raises(ValueError, match="fresh_order"):
        QueueConfig.model_validate({"fresh_order": "oldest"})
    assert not HoldBook(QueueConfig(fresh_first_ms=None)).behind(10**9)


async def test_a_prompt_that_would_not_be_held_has_nothing_ahead() -> None:
    broker, clock = FakeBroker(room=0), ManualClock(0)
    queue, _ = make(broker, clock, max_held=1)
    await queue.submit(req("a"))
    overflow = await queue.submit(req("b"))  # the book is full: b goes to prefill before a
    assert overflow.outcome is not None and overflow.outcome.dispatch is Dispatch.OVERFLOW
    queue2, _ = make(broker, clock)
    await queue2.submit(req("c"))
    await queue2.close()
    await queue2.submit(req("d"))
    assert broker.ahead == {"a": 0, "b": 0, "c": 0, "d": 0}


async def test_deadline_dispatches_to_normal_with_the_last_reason() -> None:
    broker, clock = FakeBroker(room=0), ManualClock(0)
    queue, seen = make(broker, clock, max_hold_ms=300)
    a = await queue.submit(req("a"))
    clock.advance(100)
    b = await queue.submit(req("b"))
    assert queue.next_deadline_ms() == 300
    clock.advance(200)
    await queue.tick()
    assert dispatches([a, b]) == [Dispatch.DEADLINE, None]
    assert a.outcome is not None and a.outcome.admission.reason is Reason.NO_ROOM
    assert a.outcome.held_ms == 300 and not a.outcome.borrowed
    assert queue.next_deadline_ms() == 400
    clock.advance(100)
    await queue.on_room(room(0))  # a heartbeat without room still fires deadlines
    assert dispatches([a, b]) == [Dispatch.DEADLINE, Dispatch.DEADLINE]
    assert len(seen) == 2


async def test_prefill_room_dispatches_in_order_while_the_router_says_so() -> None:
    broker, clock = FakeBroker(room=0), ManualClock(0)
    free = {"slots": 0}

    def prefill_room(request: AdmissionRequest) -> bool:
        if free["slots"] <= 0:
            return False
        free["slots"] -= 1
        return True

    queue = AdmissionQueue(broker, QueueConfig(), clock=clock, prefill_room=prefill_room)
    tickets = [await queue.submit(req(r)) for r in "abc"]
    assert queue.held == 3
    free["slots"] = 2
    await queue.tick()
    assert dispatches(tickets) == [Dispatch.PREFILL_ROOM, Dispatch.PREFILL_ROOM, None]
    free["slots"] = 1
    d = await queue.submit(req("d"))  # prefill has room at the first refusal: never held
    assert dispatches([d]) == [Dispatch.PREFILL_ROOM] and queue.held == 1
    assert d.outcome is not None and not d.outcome.held
    assert all(t.outcome is not None and t.outcome.held for t in tickets[:2])


async def test_demand_gone_or_room_unknown_dispatches_everything() -> None:
    broker, clock = FakeBroker(room=0), ManualClock(0)
    queue, _ = make(broker, clock)
    first = [await queue.submit(req(r)) for r in "ab"]
    await queue.on_room(room(5_000, demand=False))
    assert dispatches(first) == [Dispatch.NO_DEMAND] * 2
    second = [await queue.submit(req(r)) for r in "cd"]
    unknown = RoomUpdate(seq=2, at_ms=0, view=RoomView(status=RoomStatus.UNKNOWN))
    await queue.on_room(unknown)
    assert dispatches(second) == [Dispatch.ROOM_UNKNOWN] * 2
    assert queue.held == 0 and not broker.calls[4:]  # no re-offer on either update


@pytest.mark.parametrize(
    "doubt", [Reason.STORE_UNAVAILABLE, Reason.TIMEOUT, Reason.BROKER_UNAVAILABLE]
)
async def test_a_reoffer_that_finds_no_demand_or_a_broker_in_doubt_dispatches_all(
    doubt: Reason,
) -> None:
    broker, clock = FakeBroker(room=0), ManualClock(0)
    broker.down_reason = doubt
    queue, _ = make(broker, clock)
    first = [await queue.submit(req(r)) for r in "ab"]
    broker.demand = False
    await queue.on_room(room(5_000))
    assert dispatches(first) == [Dispatch.NO_DEMAND] * 2
    broker.demand = True
    second = [await queue.submit(req(r)) for r in "cd"]
    broker.down = True
    await queue.on_room(room(5_000))
    assert dispatches(second) == [Dispatch.ROOM_UNKNOWN] * 2
    assert second[0].outcome is not None
    assert second[0].outcome.admission.reason is doubt


async def test_an_admitter_error_on_submit_propagates_but_on_a_reoffer_fails_closed() -> None:
    broker, clock = FakeBroker(room=0), ManualClock(0)
    queue, _ = make(broker, clock)
    held = await queue.submit(req("a"))
    broker.broken = True
    with pytest.raises(StoreUnavailable):
        await queue.submit(req("b"))
    assert queue.held == 1
    step = await queue.on_room(room(5_000))
    assert [o.dispatch for o in step] == [Dispatch.ROOM_UNKNOWN] and held.outcome == step[0]
    assert step[0].admission.reason is Reason.BROKER_UNAVAILABLE and not queue.closed


async def test_overflow_and_zero_hold_dispatch_at_once() -> None:
    broker, clock = FakeBroker(room=0), ManualClock(0)
    queue, _ = make(broker, clock, max_held=2)
    tickets = [await queue.submit(req(r)) for r in "abc"]
    assert dispatches(tickets) == [None, None, Dispatch.OVERFLOW]
    off, _ = make(broker, clock, max_hold_ms=0)
    assert dispatches([await off.submit(req("z"))]) == [Dispatch.OVERFLOW]


async def test_withdraw_and_close_give_every_prompt_exactly_one_outcome() -> None:
    broker, clock = FakeBroker(room=0), ManualClock(0)
    queue, seen = make(broker, clock)
    tickets = [await queue.submit(req(r)) for r in "abc"]
    out = await queue.withdraw(tickets[1])
    assert out is not None and out.dispatch is Dispatch.WITHDRAWN
    assert await queue.withdraw(tickets[1]) is None
    await queue.close()
    assert dispatches(tickets) == [Dispatch.CLOSED, Dispatch.WITHDRAWN, Dispatch.CLOSED]
    late = await queue.submit(req("d"))  # closed: answered, never held
    assert dispatches([late]) == [Dispatch.CLOSED] and queue.held == 0
    assert sorted(o.request.request_id for o in seen) == ["a", "b", "c", "d"]
    with pytest.raises(RuntimeError):
        tickets[0]._resolve(seen[0])


async def test_run_feeds_updates_fires_deadlines_and_closes_when_the_stream_ends() -> None:
    """The live driver on the real clock: a deadline fires with no update, then the stream
    ends and what is still held is dispatched (no timing asserted)."""
    broker = FakeBroker(room=0)
    queue = AdmissionQueue(broker, QueueConfig(max_hold_ms=30_000, recheck_ms=5))
    gate = asyncio.Event()
    fast = AdmissionQueue(broker, QueueConfig(max_hold_ms=20))

    async def updates() -> object:
        yield room(0)
        await gate.wait()
        broker.room = 1_000
        yield room(1_000, seq=2)
        yield room(0, seq=3)

    runner = asyncio.create_task(queue.run(updates()))  # type: ignore[arg-type]
    fast_runner = asyncio.create_task(fast.run(updates()))  # type: ignore[arg-type]
    held = await queue.submit(req("a"))
    expiring = await fast.submit(req("x", 5_000))
    assert (await asyncio.wait_for(expiring.wait(), 10)).dispatch is Dispatch.DEADLINE
    assert not held.done()
    gate.set()
    assert (await asyncio.wait_for(held.wait(), 10)).dispatch is Dispatch.BORROWED_LATE
    stuck = await queue.submit(req("b", 5_000))
    await asyncio.wait_for(asyncio.gather(runner, fast_runner), 10)
    assert stuck.outcome is not None and stuck.outcome.dispatch is Dispatch.CLOSED
    assert queue.closed and queue.held == 0


async def test_cancelling_run_dispatches_everything_held() -> None:
    broker = FakeBroker(room=0)
    queue = AdmissionQueue(broker)
    forever = asyncio.Event()

    async def updates() -> object:
        yield room(0)
        await forever.wait()

    runner = asyncio.create_task(queue.run(updates()))  # type: ignore[arg-type]
    ticket = await queue.submit(req("a"))
    await asyncio.sleep(0)
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert ticket.outcome is not None and ticket.outcome.dispatch is Dispatch.CLOSED


def test_a_queue_behind_offers_every_prompt_held_out_of_stamp_order() -> None:
    """A prompt's stamp is its submit time, but it is held when its Admit comes back, so
    concurrent submits are held out of stamp order (and a wall clock can step back): every
    fitting prompt is still offered; one held behind an older stamp counts as not fresh."""
    book: HoldBook[str] = HoldBook(QueueConfig(max_hold_ms=60_000, fresh_first_ms=1_000))
    no_room = Admission.normal(Reason.NO_ROOM, "")
    for key, since in (("c", 0), ("b", 120), ("a", 100)):  # b's Admit came back before a's
        assert book.hold(key, req(key, 100), no_room, since) is None
    # at 1,110 the cutoff is 110: the newest held, a, is not fresh, so nothing is; b was
    # left out of both parts before
    assert [h.key for h, _ in book.to_reoffer(room(1_000).view, 1_110)] == ["c", "b", "a"]


def test_hold_book_is_deterministic_and_pure() -> None:
    book: HoldBook[str] = HoldBook(QueueConfig(max_hold_ms=100, order="shortest"))
    no_room = Admission.normal(Reason.NO_ROOM, "")
    assert book.hold("k1", req("a", 300), no_room, 0) is None
    assert book.hold("k2", req("b", 200), no_room, 50) is None
    assert book.hold("k3", req("c"), Admission.normal(Reason.NO_DEMAND, ""), 50) is (
        Dispatch.NOT_HELD
    )
    with pytest.raises(ValueError):
        book.hold("k1", req("a"), no_room, 0)
    assert [h.key for h in book.ordered()] == ["k2", "k1"]
    assert [(h.key, ahead) for h, ahead in book.to_reoffer(room(250).view, 0)] == [("k2", 0)]
    assert book.to_reoffer(room(0).view, 0) == []
    assert [h.key for h in book.due(100)] == ["k1"] and len(book) == 1
    assert book.next_deadline_ms() == 150
    # k1 held again after its hold ended: its old deadline no longer counts
    assert book.hold("k1", req("a", 300), no_room, 120) is None
    assert book.take("k2") is not None
    assert book.hold("k4", req("d", 100), no_room, 130) is None
    assert book.hold("k2", req("b", 200), no_room, 140) is None
    assert book.next_deadline_ms() == 220
    assert [h.key for h in book.due(235)] == ["k4", "k1"]
    assert book.next_deadline_ms() == 240


@pytest.mark.parametrize("order", ["fifo", "shortest"])
def test_heads_yield_the_book_in_order_while_each_is_taken_and_stop_when_one_is_not(
    order: str,
) -> None:
    book: HoldBook[str] = HoldBook(QueueConfig.model_validate({"max_hold_ms": 100, "order": order}))
    no_room = Admission.normal(Reason.NO_ROOM, "")
    for key, size in (("a", 300), ("b", 100), ("c", 200)):
        assert book.hold(key, req(key, size), no_room, 0) is None
    expected = [h.key for h in book.ordered()]
    assert expected == (["a", "b", "c"] if order == "fifo" else ["b", "c", "a"])
    taken = []
    for held in book.heads():
        taken.append(held.key)
        book.take(held.key)
        if len(taken) == 2:
            break
    assert taken == expected[:2] and [h.key for h in book] == expected[2:]
    # a reader that does not take what it is given sees it once, not for ever
    assert [h.key for h in book.heads()] == expected[2:]
    assert len(book) == 1


def test_a_hold_is_due_at_its_deadline_not_before_even_behind_ended_holds() -> None:
    book: HoldBook[str] = HoldBook(QueueConfig(max_hold_ms=100))
    no_room = Admission.normal(Reason.NO_ROOM, "")
    book.hold("gone", req("gone"), no_room, 0)
    book.hold("k", req("k"), no_room, 10)
    book.take("gone")  # its deadline (100) stays on the heap's top until popped
    assert book.due(109) == []
    assert [h.key for h in book.due(110)] == ["k"]
    assert book.due(10**6) == []


book_ops = st.lists(
    st.tuples(
        st.sampled_from(["hold", "take", "borrow", "due", "drain"]),
        st.integers(0, 5),  # key
        st.integers(0, 200),  # clock step
        st.integers(1, 3),  # prompt size (shortest order)
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(steps=book_ops, shortest=st.booleans())
def test_hold_book_deadlines_match_a_scan_of_everything_held(
    steps: list[tuple[str, int, int, int]], shortest: bool
) -> None:
    """The deadline heap answers what a scan of every held prompt answers: the earliest
    deadline, and the prompts due (in re-offer order), under holds, takes, borrows, drains and
    keys held again after their hold ended."""
    book: HoldBook[str] = HoldBook(
        QueueConfig(max_hold_ms=300, order="shortest" if shortest else "fifo")
    )
    no_room = Admission.normal(Reason.NO_ROOM, "")
    borrowed = Admission(decision=Decision.BORROW, reason=Reason.BORROWED, node_id="d1")
    now = 0
    for op, key_n, step, size in steps:
        now += step
        key = f"k{key_n}"
        if op == "hold" and key not in book:
            book.hold(key, req(key, size), no_room, now)
        elif op == "take":
            book.take(key)
        elif op == "borrow":
            held = next((h for h in book if h.key == key), None)
            if held is not None:
                book.answered(held, borrowed)
        elif op == "due":
            expected = [h.key for h in book.ordered() if h.deadline_ms <= now]
            assert [h.key for h in book.due(now)] == expected
        elif op == "drain":
            book.drain()
        earliest = min((h.deadline_ms for h in book), default=None)
        assert book.next_deadline_ms() == earliest


@settings(max_examples=150, deadline=None)
@given(
    steps=book_ops,
    shortest=st.booleans(),
    rooms=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 9)), min_size=1, max_size=4),
)
def test_room_scans_match_a_scan_of_everything_held(
    steps: list[tuple[str, int, int, int]], shortest: bool, rooms: list[tuple[int, int]]
) -> None:
    """A room update's scan of the book (which skips it when the room is short of every held
    prompt's compute or KV need) finds, with the tokens ahead of each, what a scan of every
    held prompt finds, under holds, takes, borrows, deadlines and drains."""
    book: HoldBook[str] = HoldBook(
        QueueConfig(max_hold_ms=300, order="shortest" if shortest else "fifo")
    )
    no_room = Admission.normal(Reason.NO_ROOM, "")
    borrowed = Admission(decision=Decision.BORROW, reason=Reason.BORROWED, node_id="d1")
    now = 0
    for op, key_n, step, size in steps:
        now += step
        key = f"k{key_n}"
        if op == "hold" and key not in book:
            book.hold(key, req(key, size, cached=2 * (key_n % 3)), no_room, now)
        elif op in ("take", "borrow"):
            held = next((h for h in book if h.key == key), None)
            if held is not None:
                book.answered(held, borrowed) if op == "borrow" else book.take(key)
        elif op == "due":
            book.due(now)
        elif op == "drain":
            book.drain()
        needs = sorted(h.compute_need for h in book)  # the bags hold these, nothing left over
        kv_needs = sorted(h.kv_need for h in book)
        assert sorted(book._compute_needs.values()) == needs
        assert sorted(book._kv_needs.values()) == kv_needs
        assert book._compute_needs.least() == min(needs, default=None)
        assert book._kv_needs.least() == min(kv_needs, default=None)
        for compute, kv in rooms:
            expected, ahead = [], 0
            for h in book.ordered():
                if h.compute_need <= compute and h.kv_need <= kv:
                    expected.append((h.key, ahead))
                ahead += h.compute_need
            found = [(h.key, a) for h, a in book._fits(_Room(compute, kv))]
            assert found == expected


ops = st.one_of(
    st.tuples(st.just("submit"), st.integers(100, 6_000)),
    st.tuples(st.just("room"), st.integers(0, 8_000), st.booleans(), st.booleans()),
    st.tuples(st.just("advance"), st.integers(0, 400)),
    st.tuples(st.just("withdraw"), st.integers(0, 50)),
    st.tuples(st.just("broker"), st.booleans(), st.booleans()),
)


HELD_ONLY = {
    Dispatch.BORROWED_LATE,
    Dispatch.DEADLINE,
    Dispatch.NO_DEMAND,
    Dispatch.ROOM_UNKNOWN,
    Dispatch.WITHDRAWN,
    Dispatch.CLOSED,
}
FIRST_ONLY = {Dispatch.BORROWED, Dispatch.NOT_HELD, Dispatch.OVERFLOW}


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(ops, min_size=1, max_size=60), shortest=st.booleans(), fresh=st.booleans())
async def test_any_interleaving_gives_every_prompt_exactly_one_outcome(
    steps: list[tuple[Any, ...]], shortest: bool, fresh: bool
) -> None:
    """Random submits, room updates, clock moves, withdrawals and broker moods: no prompt is
    answered twice (Ticket raises), none stays held past its deadline once time is looked at,
    the held gauge and the tokens sent as held ahead agree with what is held (every re-offer
    too, in whatever order a queue behind re-offers), and after close() every prompt has
    exactly one outcome."""
    broker, clock = FakeBroker(room=0), ManualClock(0)
    order = "shortest" if shortest else "fifo"
    queue, seen = make(
        broker,
        clock,
        max_held=5,
        max_hold_ms=300,
        order=order,
        fresh_first_ms=100 if fresh else None,
    )

    def reoffer_ahead_is_what_prefill_takes_first(request: AdmissionRequest) -> None:
        if "#" not in request.request_id:
            return
        held = queue.held_requests()
        ids = [r.request_id for r in held]
        at = ids.index(request.request_id.split("#")[0])
        assert request.held_ahead_tokens == sum(r.uncached_prompt_tokens for r in held[:at])

    broker.on_call = reoffer_ahead_is_what_prefill_takes_first
    tickets: list[Ticket] = []
    for kind, *args in steps:
        ahead = expected_ahead(queue, args[0], shortest) if kind == "submit" else None
        await apply(queue, broker, clock, tickets, kind, args)
        if ahead is not None:  # the book's running total agrees with what it holds
            assert broker.ahead[tickets[-1].request.request_id] == ahead
        assert queue.held <= 5 and queue.stats.held == queue.held
        if kind in ("room", "advance"):
            deadline = queue.next_deadline_ms()
            assert deadline is None or deadline > clock.now_ms()
    await queue.close()
    assert all(t.done() for t in tickets) and queue.held == 0
    assert sorted(o.request.request_id for o in seen) == sorted(
        t.request.request_id for t in tickets
    )
    for t in tickets:
        assert t.outcome is not None
        check_outcome(t.outcome)


def expected_ahead(queue: AdmissionQueue, tokens: int, shortest: bool) -> int:
    held = queue.held_requests()
    if len(held) >= 5:
        return 0
    sizes = [r.uncached_prompt_tokens for r in held]
    return sum(t for t in sizes if t <= tokens) if shortest else sum(sizes)


async def apply(
    queue: AdmissionQueue,
    broker: FakeBroker,
    clock: ManualClock,
    tickets: list[Ticket],
    kind: str,
    args: list[Any],
) -> None:
    if kind == "submit":
        tickets.append(await queue.submit(req(f"r{len(tickets)}", args[0])))
    elif kind == "room":
        broker.room = args[0]
        update = room(args[0], demand=args[1])
        if not args[2]:
            update = RoomUpdate(seq=1, at_ms=0, view=RoomView(status=RoomStatus.UNKNOWN))
        await queue.on_room(update)
    elif kind == "advance":
        clock.advance(args[0])
        await queue.tick()
    elif kind == "withdraw" and tickets:
        await queue.withdraw(tickets[args[0] % len(tickets)])
    elif kind == "broker":
        broker.demand, broker.down = args


def check_outcome(out: Outcome) -> None:
    assert out.borrowed == (out.dispatch in (Dispatch.BORROWED, Dispatch.BORROWED_LATE))
    if out.dispatch in HELD_ONLY:
        assert out.held and out.offers >= 1
    if out.dispatch in FIRST_ONLY:
        assert not out.held and out.offers == 1 and out.held_ms == 0
    if out.dispatch is Dispatch.DEADLINE:
        assert out.held_ms >= 300


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "add", "remove", "least", "clear"]), st.integers(0, 7)),
        max_size=400,
    )
)
def test_min_bag_is_the_multiset_of_what_was_added_and_not_removed(
    ops: list[tuple[str, int]],
) -> None:
    """HoldBook's need bags (a heap with lazy removals, compacted past 32 stale entries) hold
    exactly a plain list's multiset, its least at hand, and stay within about twice it."""
    bag, plain = _MinBag(), []
    for op, value in ops:
        if op == "add":
            bag.add(value)
            plain.append(value)
        elif op == "remove" and plain:
            gone = plain[value % len(plain)]
            bag.remove(gone)
            plain.remove(gone)
        elif op == "least":
            assert bag.least() == min(plain, default=None)
        elif op == "clear" and value == 0:
            bag.clear()
            plain.clear()
        assert len(bag) == len(plain)
        assert sorted(bag.values()) == sorted(plain)
        assert len(bag._heap) <= 2 * len(plain) + 33


def test_min_bag_compacts_removals_that_never_reach_the_top() -> None:
    """Removals of values above a least that stays are not left in the heap for ever."""
    bag = _MinBag()
    bag.add(0)
    for v in range(1, 10_001):
        bag.add(v)
        bag.remove(v)
    assert bag.least() == 0 and len(bag) == 1
    assert len(bag._heap) <= 2 + 33
