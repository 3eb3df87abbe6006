"""Demand counts the prompts this replica sent to the prefill pool since the pool's reports
(:mod:`crossflow_ctl.service.pending`), on the service over each store: a prompt answered
NO_DEMAND goes to the pool now and counts; a new report resets the count; each pool has its
own; a prompt that may be held (any other NORMAL), a dry run or a retry does not count."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossflow_ctl.client.holding import QueueConfig
from crossflow_ctl.domain.admission import (
    Admission,
    AdmissionRequest,
    Decision,
    DemandCheck,
    Plan,
    Reason,
)
from crossflow_ctl.domain.clock import ManualClock
from crossflow_ctl.domain.models import NodeRole, PoolLoad, PoolSnapshot
from crossflow_ctl.domain.pending import Unreported, sent_to_servers, unreported_tokens
from crossflow_ctl.domain.room import RoomWatchRequest
from crossflow_ctl.service.broker import Broker
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.service.pending import MAX_SENT, SentToPools, sent_to_pool
from crossflow_ctl.store.base import Store
from crossflow_ctl.store.redis_store import DEFAULT_CACHE_MAX_AGE_MS
from tests.broker.conftest import TEST_POLICY

# 100 ms threshold for every prompt; the pool reports 500 tokens at 10,000 tokens/s (50 ms) and
# each prompt is 300 uncached tokens (30 ms): two prompts sent make the wait 110 ms.
POLICY = TEST_POLICY.model_copy(update={"demand_threshold_ms": 100.0, "demand_prefill_ratio": None})
PROMPT = 300
VIEW_CACHE_S = 2 * DEFAULT_CACHE_MAX_AGE_MS / 1000
"""Past the Redis store's view cache age bound (judged on the monotonic clock)."""


@pytest.fixture
async def store(store_factory: Callable[[], Store]) -> AsyncIterator[Store]:
    handle = store_factory()
    try:
        yield handle
    finally:
        await handle.close()


async def report(broker: Broker, node_id: str = "p1", pool: str = "default") -> None:
    load = PoolLoad(
        pool=pool,
        node_id=node_id,
        outstanding_uncached_tokens=500,
        processing_rate_tps=10_000.0,
        ttl_ms=60_000,
    )
    await broker.ingest_pool_load(load)


async def pool_broker(store: Store) -> tuple[Broker, ManualClock]:
    """A broker with a prefill pool per name ("default", "b") and no decode node: once Demand
    holds, the answer is NO_LEASES (a prompt a router may hold)."""
    clock = ManualClock(1_700_000_000_000)
    broker = Broker(store, clock, BrokerSettings(policy=POLICY))
    for node_id, pool in (("p1", "default"), ("pb", "b")):
        await broker.register(node_id, NodeRole.PREFILL, pool, {})
        await report(broker, node_id, pool)
    clock.advance(1)
    return broker, clock


def ask(pool: str = "default", **kw: object) -> AdmissionRequest:
    return AdmissionRequest(uncached_prompt_tokens=PROMPT, pool=pool, **kw)  # type: ignore[arg-type]


def wait_ms(answer: Admission) -> float | None:
    assert answer.plan is not None
    return answer.plan.demand.pool_wait_ms


async def test_prompts_sent_since_the_report_count_into_demand(store: Store) -> None:
    broker, _ = await pool_broker(store)
    answers = [await broker.admit(ask()) for _ in range(4)]
    assert [a.reason for a in answers] == [
        Reason.NO_DEMAND,
        Reason.NO_DEMAND,
        Reason.NO_LEASES,  # 500 + 2 x 300 tokens at 10,000 tokens/s: 110 ms > 100 ms
        Reason.NO_LEASES,  # a prompt that may be held is not counted
    ]
    assert [wait_ms(a) for a in answers] == pytest.approx([50.0, 80.0, 110.0, 110.0])
    assert answers[2].plan is not None
    assert answers[2].plan.demand.pending_uncached_tokens == 2 * PROMPT
    assert answers[1].message == (
        "demand fails: prefill wait 80.0 ms (with 300 tokens sent since its reports) "
        "<= threshold 100.0 ms"
    )
    # The room watches see the same Demand, so they do not send held prompts to prefill.
    view = await broker.room_view(RoomWatchRequest())
    assert view.demand_holds and view.pool_wait_ms == pytest.approx(110.0)


async def test_each_room_view_sees_the_prompts_sent_and_reports_stored_before_it(
    store: Store,
) -> None:
    """Room views keep the pool's Demand while its snapshot, the policy and the count stay the
    same: each send, each new report and a new policy still show in the next view."""
    broker, clock = await pool_broker(store)
    waits = []
    for _ in range(3):
        waits.append((await broker.room_view(RoomWatchRequest())).pool_wait_ms)
        await broker.admit(ask())
    waits.append((await broker.room_view(RoomWatchRequest())).pool_wait_ms)
    assert waits == pytest.approx([50.0, 80.0, 110.0, 110.0])  # the third prompt may be held
    assert (await broker.room_view(RoomWatchRequest())).demand_holds
    await broker.set_policy({"demand_threshold_ms": 200.0})
    assert not (await broker.room_view(RoomWatchRequest())).demand_holds
    clock.advance(1)
    await report(broker)  # received after both prompts: it shows them
    await asyncio.sleep(VIEW_CACHE_S)  # past the Redis store's view cache
    assert (await broker.room_view(RoomWatchRequest())).pool_wait_ms == pytest.approx(50.0)


async def test_a_new_report_alone_shows_in_the_next_room_view(store: Store) -> None:
    """Room views keep the pool's Demand per pool snapshot too: a new report with nothing sent
    meanwhile (the same unreported count and policy) shows in the next view (review rM)."""
    broker, clock = await pool_broker(store)
    before = (await broker.room_view(RoomWatchRequest())).pool_wait_ms
    clock.advance(1)
    await broker.ingest_pool_load(
        PoolLoad(
            node_id="p1",
            outstanding_uncached_tokens=2_000,
            processing_rate_tps=10_000.0,
            ttl_ms=60_000,
        )
    )
    await asyncio.sleep(VIEW_CACHE_S)  # past the Redis store's view cache
    after = (await broker.room_view(RoomWatchRequest())).pool_wait_ms
    assert before == pytest.approx(50.0) and after == pytest.approx(200.0)


async def test_a_new_report_resets_the_count(store: Store) -> None:
    broker, clock = await pool_broker(store)
    for _ in range(2):
        await broker.admit(ask())
    assert (await broker.admit(ask())).reason is Reason.NO_LEASES
    clock.advance(1)
    await report(broker)  # received after both prompts: it shows them
    answer = await broker.admit(ask())
    assert answer.reason is Reason.NO_DEMAND and wait_ms(answer) == pytest.approx(50.0)


async def test_each_pool_has_its_own_count(store: Store) -> None:
    broker, _ = await pool_broker(store)
    for _ in range(2):
        await broker.admit(ask())
    other = await broker.admit(ask("b"))
    assert other.reason is Reason.NO_DEMAND and wait_ms(other) == pytest.approx(50.0)
    assert (await broker.admit(ask())).reason is Reason.NO_LEASES


async def test_dry_runs_and_retries_are_not_sent(store: Store) -> None:
    broker, _ = await pool_broker(store)
    for _ in range(3):
        assert (await broker.admit(ask(dry_run=True))).reason is Reason.NO_DEMAND
        retry = await broker.admit(ask(request_id="r-1", attempt=1))
        assert retry.reason is Reason.NO_DEMAND
    assert wait_ms(await broker.admit(ask())) == pytest.approx(50.0)


async def test_replicas_with_skewed_clocks_order_reports_alike(
    store_factory: Callable[[], Store],
) -> None:
    """The report is ingested by a replica whose clock is SKEW behind the sending one's: the
    prompts were sent before it was stored, so it shows them and the count starts over. Ordered
    by receipt time (the ingesting replica's clock, SKEW behind) they would still count, and
    the third prompt below would read 110 ms and fail Demand's NO_DEMAND."""
    skew = 500
    sender_clock = ManualClock(1_700_000_000_000)
    sender = Broker(store_factory(), sender_clock, BrokerSettings(policy=POLICY))
    ingester = Broker(
        store_factory(), ManualClock(sender_clock.now_ms() - skew), BrokerSettings(policy=POLICY)
    )
    try:
        await sender.register("p1", NodeRole.PREFILL, "default", {})
        await report(ingester)
        sender_clock.advance(1)
        for _ in range(2):
            assert (await sender.admit(ask())).reason is Reason.NO_DEMAND
        sender_clock.advance(1)
        await report(ingester)  # stored after both prompts (its receipt time: SKEW - 2 before)
        sender_clock.advance(1)
        await asyncio.sleep(VIEW_CACHE_S)  # the sender's cached view is read again
        answer = await sender.admit(ask())
        assert answer.reason is Reason.NO_DEMAND and wait_ms(answer) == pytest.approx(50.0)
    finally:
        await asyncio.gather(sender.store.close(), ingester.store.close())


def snapshot(*report_seqs: int) -> PoolSnapshot:
    load = PoolLoad(node_id="p1", outstanding_uncached_tokens=0, processing_rate_tps=1.0, ttl_ms=1)
    return PoolSnapshot(pool="default", reports=(load,) * len(report_seqs), report_seqs=report_seqs)


def test_the_count_follows_the_reports_it_is_read_against() -> None:
    sent = SentToPools()
    sent.record("default", 999)  # before any report was seen: in every report, never counted
    assert sent.tokens(snapshot(5, 20)) == 0
    sent.record("default", 100)  # after seeing 5 and 20: in neither
    assert sent.tokens(snapshot(5, 20)) == 100
    assert sent.tokens(snapshot(5, 25)) == 50  # the second server reported again
    sent.record("default", 200)  # after seeing 25
    assert sent.tokens(snapshot(30, 25)) == 100  # the first server reported again
    # Reports all older than those before can only mean the store's sequence restarted (or a
    # stale view): everything is forgotten, the under-counting side.
    assert sent.tokens(snapshot(5)) == 0
    assert sent.tokens(snapshot()) == 0  # sequences unknown
    assert sent.tokens(PoolSnapshot(pool="other", reports=snapshot(1).reports)) == 0


def timed(p1_seq: int, p2_seq: int) -> PoolSnapshot:
    loads = tuple(
        PoolLoad(
            node_id=name,
            outstanding_uncached_tokens=0,
            processing_rate_tps=1.0,
            ttl_ms=1,
            queue_wait_ms=0.0,
        )
        for name in ("p1", "p2")
    )
    return PoolSnapshot(pool="default", reports=loads, report_seqs=(p1_seq, p2_seq))


def test_tokens_sent_to_a_named_server_count_on_it_until_its_own_next_report() -> None:
    sent = SentToPools()
    assert sent.unreported(timed(5, 20)) == Unreported(0, {})
    sent.record("default", 100, "p1")  # after seeing 5 and 20
    sent.record("default", 40)  # no server named: spread over the pool
    assert sent.unreported(timed(5, 20)) == Unreported(40, {"p1": 100})
    # p2 reporting again shows nothing of p1's; half of the unnamed prompt's reports are newer
    assert sent.unreported(timed(5, 25)) == Unreported(20, {"p1": 100})
    assert sent.unreported(timed(30, 25)) == Unreported(0, {})  # p1's own report shows it
    # a pool not all in time spreads every prompt, named or not, as before
    sent.record("default", 60, "p2")  # after seeing 30
    assert sent.unreported(snapshot(30, 25)) == Unreported(60, {})  # no report shows it


def test_a_restarted_report_sequence_does_not_pin_every_prompt() -> None:
    """Redis restarted without persistence: the pool's sequence starts again at 1, below every
    prompt's stamp. The count must follow the new reports (here both servers report after every
    100 prompts, so at most those 100 count), not grow with every prompt since the restart."""
    sent = SentToPools()
    assert sent.tokens(snapshot(1000, 1001)) == 0
    for period in range(50):
        seq = 1 + 2 * period
        assert sent.tokens(snapshot(seq, seq + 1)) == 0  # every earlier prompt reported
        for _ in range(100):
            sent.record("default", 1000)
        assert sent.tokens(snapshot(seq, seq + 1)) == 100 * 1000


def test_reports_without_a_sequence_show_every_prompt() -> None:
    """Reports an older broker stored carry no sequence (0): kept, they would hold every prompt
    as unreported for as long as they kept coming."""
    sent = SentToPools()
    sent.tokens(snapshot(0, 7))
    sent.record("default", 1000)
    assert sent.tokens(snapshot(0, 7)) == 1000  # not in the sequenced report
    assert sent.tokens(snapshot(0, 8)) == 0  # the sequenced server reported: shown
    assert sent.tokens(snapshot(0, 0)) == 0


def test_the_oldest_prompts_are_forgotten_past_the_bound() -> None:
    sent, reports = SentToPools(), snapshot(1)
    assert sent.tokens(reports) == 0
    for i in range(MAX_SENT + 10):
        sent.record("default", 1 if i < 10 else 2)
        if i == 0:
            assert sent.tokens(reports) == 1
    assert sent.tokens(reports) == 2 * MAX_SENT


def test_only_a_no_demand_answer_sends_a_prompt() -> None:
    def normal(reason: Reason) -> Admission:
        plan = Plan(reason=reason, demand=DemandCheck(holds=False, pool_wait_ms=0, threshold_ms=1))
        return Admission.normal(reason, "", plan)

    assert sent_to_pool(ask(), normal(Reason.NO_DEMAND))
    for reason in (Reason.NO_ROOM, Reason.NO_BENEFIT, Reason.NO_LEASES, Reason.POOL_LOAD_MISSING):
        assert not sent_to_pool(ask(), normal(reason))
    shadow = normal(Reason.NO_DEMAND).model_copy(update={"reason": Reason.SHADOW_MODE})
    assert sent_to_pool(ask(), shadow)  # shadow mode sends everything to prefill
    borrowed = normal(Reason.NO_DEMAND).model_copy(update={"decision": Decision.BORROW})
    assert not sent_to_pool(ask(), borrowed)


def test_a_router_queue_never_holds_a_no_demand_answer() -> None:
    with pytest.raises(ValueError, match="no_demand"):
        QueueConfig(hold_reasons=frozenset({Reason.NO_ROOM, Reason.NO_DEMAND}))


@given(
    st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=50),  # sequences taken before the event
            st.one_of(
                st.integers(min_value=1, max_value=5_000),  # a prompt's uncached tokens sent
                st.sets(st.integers(min_value=0, max_value=3), min_size=1),  # servers reporting
            ),
        ),
        max_size=60,
    )
)
def test_the_book_counts_what_the_domain_rule_counts(events: list[tuple[int, Any]]) -> None:
    """The replica's book (incremental: it forgets what every report shows) gives, after every
    send and every new report, what :func:`~crossflow_ctl.domain.pending.unreported_tokens`
    gives over everything sent, each prompt stamped with the newest report sequence seen: the
    book is that rule, not a second one."""
    book = SentToPools()
    sent: list[tuple[int, int]] = []
    reported = {0: 1}  # server -> its last report's ingest sequence; each report is newer
    seq = 1
    book.tokens(pool_snapshot(reported))
    for skip, event in events:
        seq += skip  # reports of other pools take sequences too (one MemoryStore counter)
        if isinstance(event, int):
            book.record("default", event)
            sent.append((max(reported.values()), event))
        else:
            for server in sorted(event):
                seq += 1
                reported[server] = seq
        snapshot = pool_snapshot(reported)
        assert book.tokens(snapshot) == unreported_tokens(sent, snapshot.report_seqs)


def pool_snapshot(reported: dict[int, int]) -> PoolSnapshot:
    """The pool's snapshot of ``reported`` (server -> its last report's sequence)."""
    return PoolSnapshot(
        pool="default",
        reports=tuple(
            PoolLoad(
                node_id=f"p{s}", outstanding_uncached_tokens=0, processing_rate_tps=1.0, ttl_ms=1
            )
            for s in sorted(reported)
        ),
        report_seqs=tuple(reported[s] for s in sorted(reported)),
    )


@given(
    st.lists(
        st.one_of(
            st.tuples(st.integers(1, 5_000), st.sampled_from(["", "p0", "p1", "p2", "gone"])),
            st.sets(st.integers(min_value=0, max_value=2), min_size=1),  # servers reporting
        ),
        max_size=60,
    )
)
def test_the_split_by_server_is_the_domain_rule_kept_up_to_date(events: list[Any]) -> None:
    """In a pool reporting waits in time, the book's split (kept up to date per prompt, not
    recounted per Admit) is, after every send and every new report, and read twice on one
    snapshot, what the domain rules give over everything sent."""
    book = SentToPools()
    sent: list[tuple[int, int, str]] = []
    reported = {0: 1, 1: 1, 2: 1}
    seq = 1
    snap = timed_pool(reported)
    book.unreported(snap)
    for event in events:
        if isinstance(event, tuple):
            tokens, server = event
            book.record("default", tokens, server or None)
            sent.append((max(reported.values()), tokens, server))
        else:
            for server in sorted(event):
                seq += 1
                reported[server] = seq
            snap = timed_pool(reported)
        seqs = dict(zip((r.node_id for r in snap.reports), snap.report_seqs, strict=True))
        untargeted = [(s, n) for s, n, server in sent if not server]
        want = Unreported(
            unreported_tokens(untargeted, snap.report_seqs),
            sent_to_servers([e for e in sent if e[2]], seqs),
        )
        assert book.unreported(snap) == want
        assert book.unreported(snap) == want  # the kept split, read again


def timed_pool(reported: dict[int, int]) -> PoolSnapshot:
    return PoolSnapshot(
        pool="default",
        reports=tuple(
            PoolLoad(
                node_id=f"p{s}",
                outstanding_uncached_tokens=0,
                processing_rate_tps=1.0,
                ttl_ms=1,
                queue_wait_ms=0.0,
            )
            for s in sorted(reported)
        ),
        report_seqs=tuple(reported[s] for s in sorted(reported)),
    )


def test_an_unchanged_book_answers_once_per_snapshot() -> None:
    """Admit and every room view read the count: on the same snapshot with nothing sent since,
    the answer is the one already given (read-only, as callers keep it), until a prompt is
    sent or a new snapshot comes."""
    book, snap = SentToPools(), timed(5, 20)
    assert book.unreported(snap) == Unreported(0, {})
    book.record("default", 100, "p1")  # after seeing 5 and 20
    first = book.unreported(snap)
    assert first == Unreported(0, {"p1": 100})
    assert book.unreported(snap) is first
    with pytest.raises(TypeError):
        first.by_server["p1"] = 0  # type: ignore[index]
    book.record("default", 40)
    assert book.unreported(snap) == Unreported(40, {"p1": 100}) != first
    again = timed(5, 20)  # another snapshot object with the same reports: read afresh
    assert book.unreported(again) == Unreported(40, {"p1": 100})
    assert book.unreported(again) is book.unreported(again)
