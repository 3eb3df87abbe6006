"""The store contract (store/base.py, DESIGN.md §5), run on MemoryStore and RedisStore alike."""

from __future__ import annotations

import asyncio

import pytest

from crossflow_ctl.api.v1 import lease_pb2
from crossflow_ctl.domain.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from crossflow_ctl.domain.models import (
    CREDIT_NAMES,
    ComputeTime,
    Credits,
    Lease,
    NodeRole,
    NoticeKind,
    NoticeRow,
    PoolLoad,
    ReservationState,
    Shares,
    ZeroReason,
)
from crossflow_ctl.domain.policy import PolicySettings, VersionedPolicy
from crossflow_ctl.domain.safety import over_committed
from crossflow_ctl.store.base import DebitRequest, RequestRecord, Store
from crossflow_ctl.wire.convert import notice_rows_to_proto, notice_to_proto
from tests.store.helpers import MAX_TTL, NOW, credits, lease, register


async def snapshot(store: Store, node_id: str = "d1") -> tuple[object, ...]:
    """Everything observable about one node, to show that a refused call changed nothing."""
    return (
        await store.get_node(node_id, NOW),
        await store.list_reservations(node_id, NOW),
        await store.read_notices(node_id, 0, 1000),
        await store.lease_history(node_id, 100),
        await store.node_events(node_id, 100),
    )


# -- §5.1 monotonic leases ---------------------------------------------------------------------
async def test_stale_lease_is_refused_and_changes_nothing(store: Store) -> None:
    await register(store, "d1")
    assert (await store.upsert_lease(lease(version=5, value=80), NOW, MAX_TTL)).accepted
    granted = await store.try_debit("d1", credits(10), 1.0, NOW, 1_000)
    assert granted.granted
    before = await snapshot(store)
    for stale in (lease(version=5, value=500), lease(version=4, value=500, last_notice_seq=99)):
        outcome = await store.upsert_lease(stale, NOW + 1, MAX_TTL)
        assert not outcome.accepted
        assert (outcome.stored_epoch, outcome.stored_version) == (1, 5)
    assert await snapshot(store) == before


async def test_new_epoch_is_newer_whatever_its_version(store: Store) -> None:
    await register(store, "d1")
    await store.upsert_lease(lease(epoch=1, version=9), NOW, MAX_TTL)
    outcome = await store.upsert_lease(lease(epoch=2, version=1, value=7), NOW, MAX_TTL)
    assert outcome.accepted and (outcome.stored_epoch, outcome.stored_version) == (2, 1)
    assert not (await store.upsert_lease(lease(epoch=1, version=99), NOW, MAX_TTL)).accepted
    node = await store.get_node("d1", NOW)
    assert node.lease is not None and node.lease.lease.credits == credits(7)


async def test_large_epochs_compare_exactly(store: Store) -> None:
    """63-bit epochs (e.g. random) must not lose precision anywhere (Lua numbers are doubles)."""
    await register(store, "d1")
    big = 2**62 + 1
    await store.upsert_lease(lease(epoch=big, version=2), NOW, MAX_TTL)
    assert not (await store.upsert_lease(lease(epoch=big - 1, version=3), NOW, MAX_TTL)).accepted
    assert not (await store.upsert_lease(lease(epoch=big, version=2), NOW, MAX_TTL)).accepted
    outcome = await store.upsert_lease(lease(epoch=big, version=3), NOW, MAX_TTL)
    assert outcome.accepted and outcome.stored_epoch == big
    debit = await store.try_debit("d1", credits(1), 1.0, NOW, 1_000)
    assert debit.reservation is not None and debit.reservation.lease_epoch == big


# -- §5.2 replace, never add -------------------------------------------------------------------
async def test_new_lease_replaces_credit_never_adds(store: Store) -> None:
    await register(store, "d1")
    await store.upsert_lease(lease(version=1, value=100), NOW, MAX_TTL)
    assert (await store.try_debit("d1", credits(60), 1.0, NOW, 5_000)).granted
    await store.upsert_lease(lease(version=2, value=100), NOW + 10, MAX_TTL)
    node = await store.get_node("d1", NOW + 10)
    assert node.available(NOW + 10) == credits(40)
    refused = await store.try_debit("d1", credits(41), 1.0, NOW + 10, 5_000)
    assert refused.refusal == "short" and set(refused.short_credits) == set(CREDIT_NAMES)
    assert (await store.try_debit("d1", credits(40), 1.0, NOW + 10, 5_000)).granted
    # A smaller lease leaves no room at all while the old debits are open.
    await store.upsert_lease(lease(version=3, value=50), NOW + 20, MAX_TTL)
    assert not (await store.try_debit("d1", credits(1), 1.0, NOW + 20, 5_000)).granted
    # Open debits above the new lease leave less than no room: even an empty debit is refused.
    assert (await store.try_debit("d1", Credits(), 1.0, NOW + 20, 5_000)).refusal == "short"


async def test_open_compute_debits_count_in_the_latest_leases_unit(store: Store) -> None:
    """The compute credit counts tokens at the lease's borrowed-prefill rate, which changes
    lease by lease: open debits keep their node time and count at the NEWEST lease's rate.
    (The old rule summed their tokens, each priced at its own grant's rate: it let the refused
    debit below through, and refused the granted one.)"""
    await register(store, "d1")
    room = credits(10_000, compute_tokens=1_000)

    def at(version: int, rate: float) -> Lease:
        return lease(version=version, credits=room, borrowed_prefill_rate_tps=rate)

    await store.upsert_lease(at(1, 1_000.0), NOW, MAX_TTL)
    for _ in range(2):  # 0.3 s of borrowed prefill each: 300 tokens at 1,000 tokens/s
        out = await store.try_debit(
            "d1", credits(1, compute_tokens=300), 1.0, NOW, 5_000, "", "", 300_000
        )
        assert out.granted and out.reservation is not None
        assert out.reservation.compute_us == 300_000
    assert [r.compute_us for r in await store.list_reservations("d1", NOW)] == [300_000] * 2
    # The rate doubles: the open 0.6 s are 1,200 tokens of the new lease's 1,000. No room.
    await store.upsert_lease(at(2, 2_000.0), NOW, MAX_TTL)
    node = await store.get_node("d1", NOW)
    assert node.open_debits.compute_tokens == 600
    assert node.open_compute == ComputeTime(us=600_000, tokens=600)
    assert node.available(NOW).compute_tokens == 0
    refused = await store.try_debit(
        "d1", credits(1, compute_tokens=300), 1.0, NOW, 5_000, "", "", 150_000
    )
    assert (refused.refusal, refused.short_credits) == ("short", ("compute_tokens",))
    # The rate falls to 500 tokens/s: the open 0.6 s are 300 tokens; 1.2 s (600) still fit.
    await store.upsert_lease(at(3, 500.0), NOW, MAX_TTL)
    assert (await store.get_node("d1", NOW)).available(NOW).compute_tokens == 700
    granted = await store.try_debit(
        "d1", credits(1, compute_tokens=600), 1.0, NOW, 5_000, "", "", 1_200_000
    )
    assert granted.granted
    # 1.8 s open: 900 tokens at 500/s. An untimed debit (no node time) counts its own tokens.
    assert (await store.get_node("d1", NOW)).available(NOW).compute_tokens == 100
    assert (await store.try_debit("d1", credits(1, compute_tokens=100), 1.0, NOW, 5_000)).granted
    short = await store.try_debit("d1", credits(1, compute_tokens=1), 1.0, NOW, 5_000, "", "", 1)
    assert short.short_credits == ("compute_tokens",)
    # A lease without a rate counts the tokens as granted, as before debits had node time.
    await store.upsert_lease(at(4, 0.0), NOW, MAX_TTL)
    node = await store.get_node("d1", NOW)
    assert node.open_debits.compute_tokens == 1_300
    assert node.open_compute == ComputeTime(us=1_800_000, tokens=1_200)
    assert node.available(NOW).compute_tokens == 0
    # Back to 1,000 tokens/s: 1,800 timed + 100 untimed; a release changes nothing until a
    # lease that has seen it (§5.4), which then counts the rest at its own rate.
    await store.upsert_lease(at(5, 1_000.0), NOW, MAX_TTL)
    released = await store.release(granted.reservation.reservation_id, NOW)  # type: ignore[union-attr]
    assert (await store.get_node("d1", NOW)).available(NOW).compute_tokens == 0
    seen = lease(version=6, credits=room, borrowed_prefill_rate_tps=1_000.0,
                 last_notice_seq=released.release_seq)  # fmt: skip
    await store.upsert_lease(seen, NOW, MAX_TTL)
    node = await store.get_node("d1", NOW)
    assert node.open_compute == ComputeTime(us=600_000, tokens=600)
    assert node.available(NOW).compute_tokens == 1_000 - 600 - 100


async def test_timed_debits_that_each_fit_never_sum_above_the_lease(store: Store) -> None:
    """Safety checks the state AFTER the grant: the open node time with the debit's, under one
    ``ceil``. Checking the debit's own ``ceil(us x rate / 1e6)`` against the room left by the
    open debits' is not the same on doubles (``ceil`` of a rounded product is not subadditive):
    at 2329.3333333333335 tokens/s, 1.5 s (3,494 tokens) and 5.25 s (12,229) each fit a lease of
    15,723, and granting both left 6.75 s open, ``ceil(15723.000000000002)`` = 15,724 tokens."""
    rate = 2329.3333333333335
    await register(store, "d1")
    room = credits(10, compute_tokens=15_723)
    await store.upsert_lease(lease(credits=room, borrowed_prefill_rate_tps=rate), NOW, MAX_TTL)
    first = await store.try_debit("d1", credits(1, compute_tokens=3_494), 1.0, NOW, 5_000,
                                  "", "", 1_500_000)  # fmt: skip
    assert first.granted
    second = await store.try_debit("d1", credits(1, compute_tokens=12_229), 1.0, NOW, 5_000,
                                   "", "", 5_250_000)  # fmt: skip
    assert (second.refusal, second.short_credits) == ("short", ("compute_tokens",))
    node = await store.get_node("d1", NOW)
    assert not over_committed(room, node.open_debits, 1.0, rate, node.open_compute)
    # One microsecond less fits, to the token: 6.749999 s open are 15,723 tokens.
    less = await store.try_debit("d1", credits(1, compute_tokens=12_229), 1.0, NOW, 5_000,
                                 "", "", 5_249_999)  # fmt: skip
    assert less.granted
    node = await store.get_node("d1", NOW)
    assert node.open_compute.tokens_at(node.open_debits.compute_tokens, rate) == 15_723
    assert not over_committed(room, node.open_debits, 1.0, rate, node.open_compute)


# -- §5.5 expiry -------------------------------------------------------------------------------
async def test_lease_expires_on_store_clock_with_capped_ttl(store: Store) -> None:
    await register(store, "d1")
    await store.upsert_lease(lease(ttl_ms=60_000), NOW, MAX_TTL)
    node = await store.get_node("d1", NOW)
    assert node.lease is not None and node.lease.expires_at_ms == NOW + MAX_TTL
    assert (await store.try_debit("d1", credits(1), 1.0, NOW + MAX_TTL - 1, 10)).granted
    late = await store.try_debit("d1", credits(1), 1.0, NOW + MAX_TTL, 10)
    assert (late.granted, late.refusal) == (False, "expired")
    short_ttl = lease(version=2, ttl_ms=300)
    await store.upsert_lease(short_ttl, NOW + MAX_TTL, MAX_TTL)
    node = await store.get_node("d1", NOW)
    assert node.lease is not None and node.lease.expires_at_ms == NOW + MAX_TTL + 300


@pytest.mark.parametrize("zero", ["reason", "credits"])
async def test_zero_lease_allows_no_debit(store: Store, zero: str) -> None:
    await register(store, "d1")
    if zero == "reason":
        z = lease(zero_reason=ZeroReason.ITL_OVER_SLO, zero_detail="itl 60 > 50")
    else:
        z = lease(credits=Credits())
    await store.upsert_lease(z, NOW, MAX_TTL)
    outcome = await store.try_debit("d1", Credits(), 1.0, NOW, 1_000)
    assert (outcome.granted, outcome.refusal) == (False, "zero_lease")
    assert await store.read_notices("d1", 0, 10) == []


async def test_refusals_name_their_cause(store: Store) -> None:
    assert (await store.try_debit("ghost", credits(1), 1.0, NOW, 100)).refusal == "unknown_node"
    assert (await store.try_debit("bad id!", credits(1), 1.0, NOW, 100)).refusal == "unknown_node"
    await register(store, "d1")
    assert (await store.try_debit("d1", credits(1), 1.0, NOW, 100)).refusal == "no_lease"


async def test_cordon_blocks_debits_until_uncordoned(store: Store) -> None:
    await register(store, "d1")
    await store.upsert_lease(lease(), NOW, MAX_TTL)
    info = await store.set_cordon("d1", True, "maintenance", NOW)
    assert info.cordoned and info.cordon_reason == "maintenance"
    outcome = await store.try_debit("d1", credits(1), 1.0, NOW, 100)
    assert (outcome.granted, outcome.refusal) == (False, "cordoned")
    # Re-registering (agent reconnect) keeps the cordon.
    info = await store.register_node("d1", NodeRole.DECODE, "default", {"zone": "a"}, NOW)
    assert info.cordoned and info.labels == {"zone": "a"}
    await store.set_cordon("d1", False, "", NOW + 1)
    assert (await store.try_debit("d1", credits(1), 1.0, NOW + 1, 100)).granted
    kinds = [n.kind for n in await store.read_notices("d1", 0, 10)]
    assert kinds == [NoticeKind.CORDON, NoticeKind.UNCORDON, NoticeKind.GRANT]


# -- §5.3 safety per credit, share -------------------------------------------------------------
@pytest.mark.parametrize("short", CREDIT_NAMES)
async def test_debit_refused_when_one_credit_is_short(store: Store, short: str) -> None:
    await register(store, "d1")
    await store.upsert_lease(lease(value=10), NOW, MAX_TTL)
    outcome = await store.try_debit("d1", credits(10, **{short: 11}), 1.0, NOW, 100)
    assert (outcome.granted, outcome.refusal, outcome.short_credits) == (False, "short", (short,))
    assert (outcome.lease_epoch, outcome.lease_version) == (1, 1)
    assert await store.list_reservations("d1", NOW) == []
    assert await store.read_notices("d1", 0, 10) == []
    assert (await store.try_debit("d1", credits(10), 1.0, NOW, 100)).granted


async def test_share_limits_what_is_lent(store: Store) -> None:
    await register(store, "d1")
    await store.upsert_lease(lease(value=10), NOW, MAX_TTL)
    # floor(10 x 0.25) = 2 on every credit
    assert (await store.try_debit("d1", credits(2), 0.25, NOW, 100)).granted
    assert (await store.try_debit("d1", credits(1), 0.25, NOW, 100)).short_credits == CREDIT_NAMES
    assert (await store.try_debit("d1", credits(3), 0.5, NOW, 100)).granted
    assert not (await store.try_debit("d1", credits(1), 0.5, NOW, 100)).granted
    assert (await store.try_debit("d1", credits(5), 1.0, NOW, 100)).granted
    assert not (await store.try_debit("d1", credits(0, slots=1), 1.0, NOW, 100)).granted
    with pytest.raises(InvalidArgument) as err:
        await store.try_debit("d1", credits(1), 1.5, NOW, 100)
    assert err.value.field == "share"


async def test_each_credit_is_lent_at_its_own_share(store: Store) -> None:
    """``PolicySettings.shares``: KV and KV transfer at ``borrow_kv_share``, the rest at
    ``borrow_share``; the store applies each credit's own."""
    await register(store, "d1")
    await store.upsert_lease(lease(value=10), NOW, MAX_TTL)
    shares = PolicySettings(borrow_share=0.5, borrow_kv_share=1.0).shares
    # floor(10 x 0.5) = 5 on compute, output and slots; the whole 10 on kv and kv_transfer
    big = credits(5, kv_tokens=8, kv_transfer_bytes=10)
    assert (await store.try_debit("d1", big, shares, NOW, 100)).granted
    short = await store.try_debit("d1", credits(0, kv_tokens=3, slots=1), shares, NOW, 100)
    assert short.short_credits == ("kv_tokens", "slots")
    with pytest.raises(InvalidArgument) as err:
        await store.try_debit("d1", credits(1), Shares(0.5, 1.5, 0.5, 0.5, 0.5), NOW, 100)
    assert err.value.field == "share.kv_tokens"


# -- reservations ------------------------------------------------------------------------------
async def test_reservation_lifecycle(store: Store) -> None:
    await register(store, "d1")
    await store.upsert_lease(lease(), NOW, MAX_TTL)
    outcome = await store.try_debit("d1", credits(5), 1.0, NOW, 100, request_id="req|1")
    res = outcome.reservation
    assert res is not None and res.state is ReservationState.HELD
    assert (res.expires_at_ms, res.request_id, res.grant_seq) == (NOW + 100, "req|1", 1)
    assert await store.list_reservations("d1", NOW) == [res]
    committed = await store.commit(res.reservation_id, NOW + 50, 10_000)
    assert committed.state is ReservationState.COMMITTED
    assert committed.expires_at_ms == NOW + 10_050
    assert await store.commit(res.reservation_id, NOW + 60, 99_999) == committed
    released = await store.release(res.reservation_id, NOW + 70)
    assert released.state is ReservationState.RELEASED and released.release_seq == 3
    assert await store.release(res.reservation_id, NOW + 80) == released
    with pytest.raises(FailedPrecondition):
        await store.commit(res.reservation_id, NOW + 90, 1_000)
    assert await store.list_reservations(None, NOW + 90) == [released]
    kinds = [n.kind for n in await store.read_notices("d1", 0, 10)]
    assert kinds == [NoticeKind.GRANT, NoticeKind.COMMIT, NoticeKind.RELEASE]


async def test_only_the_owner_commits_or_releases_and_a_refusal_changes_nothing(
    store: Store,
) -> None:
    await register(store, "d1")
    await store.upsert_lease(lease(), NOW, MAX_TTL)
    outcome = await store.try_debit("d1", credits(5), 1.0, NOW, 10_000, "q|9", owner="router/a")
    res = outcome.reservation
    assert res is not None and (res.owner, res.request_id) == ("router/a", "q|9")
    assert await store.list_reservations("d1", NOW) == [res]
    before = await snapshot(store)
    with pytest.raises(PermissionDenied) as denied:
        await store.commit(res.reservation_id, NOW + 1, 10_000, owner="router/b")
    assert denied.value.field == "reservation_id"
    with pytest.raises(PermissionDenied):
        await store.release(res.reservation_id, NOW + 1, owner="router/b")
    with pytest.raises(PermissionDenied):  # the unauthenticated owner "" is an owner too
        await store.release(res.reservation_id, NOW + 1, owner="")
    assert await snapshot(store) == before
    committed = await store.commit(res.reservation_id, NOW + 2, 10_000, owner="router/a")
    assert committed.owner == "router/a"
    released = await store.release(res.reservation_id, NOW + 3)  # None: anyone (an admin)
    assert released.state is ReservationState.RELEASED and released.owner == "router/a"
    with pytest.raises(InvalidArgument):
        await store.try_debit("d1", credits(1), 1.0, NOW, 100, owner="router/a|x")
    with pytest.raises(InvalidArgument):
        await store.release(res.reservation_id, NOW + 4, owner="*")


async def test_held_and_committed_reservations_expire(store: Store) -> None:
    await register(store, "d1")
    await store.upsert_lease(lease(value=10, ttl_ms=60_000), NOW, 60_000)
    held = (await store.try_debit("d1", credits(10), 1.0, NOW, 100)).reservation
    assert held is not None
    assert (await store.get_node("d1", NOW + 99)).open_reservations == 1
    assert (await store.get_node("d1", NOW + 100)).open_debits == Credits()
    with pytest.raises(NotFound) as err:
        await store.commit(held.reservation_id, NOW + 100, 1_000)
    assert err.value.field == "reservation_id"
    expire = (await store.read_notices("d1", 1, 10))[0]
    assert (expire.kind, expire.reservation_id, expire.debit) == (
        NoticeKind.EXPIRE,
        held.reservation_id,
        credits(10),
    )
    second = (await store.try_debit("d1", credits(10), 1.0, NOW + 200, 100)).reservation
    assert second is not None
    await store.commit(second.reservation_id, NOW + 250, 500)
    assert not (await store.try_debit("d1", credits(1), 1.0, NOW + 749, 100)).granted
    assert (await store.try_debit("d1", credits(10), 1.0, NOW + 750, 100)).granted
    with pytest.raises(NotFound):
        await store.release(second.reservation_id, NOW + 751)


# -- §5.4 causal release -----------------------------------------------------------------------
async def test_released_credit_returns_only_with_a_causally_later_lease(store: Store) -> None:
    await register(store, "d1")
    await store.upsert_lease(lease(version=1, value=100, ttl_ms=60_000), NOW, 60_000)
    res = (await store.try_debit("d1", credits(60), 1.0, NOW, 1_000)).reservation  # seq 1
    assert res is not None
    await store.commit(res.reservation_id, NOW + 1, 30_000)  # seq 2
    released = await store.release(res.reservation_id, NOW + 2)  # seq 3
    assert released.release_seq == 3
    # Still counts right after the release...
    assert not (await store.try_debit("d1", credits(50), 1.0, NOW + 3, 1_000)).granted
    # ...and after a lease whose snapshot predates the release notice.
    before = await store.upsert_lease(lease(version=2, last_notice_seq=2), NOW + 4, 60_000)
    assert before.accepted and before.purged_reservations == 0
    assert not (await store.try_debit("d1", credits(50), 1.0, NOW + 5, 1_000)).granted
    assert [r.reservation_id for r in await store.list_reservations("d1", NOW + 5)] == [
        res.reservation_id
    ]
    after = await store.upsert_lease(lease(version=3, last_notice_seq=3), NOW + 6, 60_000)
    assert after.purged_reservations == 1
    assert await store.list_reservations("d1", NOW + 6) == []
    assert (await store.try_debit("d1", credits(100), 1.0, NOW + 7, 1_000)).granted
    with pytest.raises(NotFound):
        await store.release(res.reservation_id, NOW + 8)


# -- notices -----------------------------------------------------------------------------------
async def test_notices_carry_a_gapless_per_node_sequence(store: Store) -> None:
    await register(store, "d1", "d2")
    for node in ("d1", "d2"):
        await store.upsert_lease(lease(node), NOW, MAX_TTL)
    ids = []
    for _ in range(4):
        res = (await store.try_debit("d1", credits(1), 1.0, NOW, 1_000)).reservation
        assert res is not None
        ids.append(res.reservation_id)
    await store.release(ids[0], NOW)
    await store.try_debit("d2", credits(1), 1.0, NOW, 1_000)
    d1 = await store.read_notices("d1", 0, 100)
    assert [n.seq for n in d1] == [1, 2, 3, 4, 5]
    assert [n.reservation_id for n in d1] == [*ids, ids[0]]
    assert d1[-1].kind is NoticeKind.RELEASE and d1[-1].debit == credits(1)
    assert [n.seq for n in await store.read_notices("d1", 2, 2)] == [3, 4]
    assert await store.read_notices("d1", 5, 10) == []
    assert [n.seq for n in await store.read_notices("d2", 0, 10)] == [1]
    assert (await store.get_node("d1", NOW)).info.notice_seq == 5
    with pytest.raises(NotFound):
        await store.read_notices("ghost", 0, 10)


async def test_a_grant_notice_carries_the_pulled_tokens_of_its_own_debit(store: Store) -> None:
    """The agent reads a grant's pulled-in prefix from the grant itself, written with the debit
    in the same atomic step (not from the relaying replica's policy); a debit that does not
    say (a caller before the field) leaves it out, and the release notice needs none."""
    await register(store, "d1")
    await store.upsert_lease(lease(), NOW, MAX_TTL)
    told = await store.try_debit("d1", credits(1), 1.0, NOW, 1_000, pulled_tokens=4_000)
    batch = DebitRequest("d1", credits(1), pulled_tokens=0)
    (local,) = await store.try_debits([batch], 1.0, NOW, 1_000)
    untold = await store.try_debit("d1", credits(1), 1.0, NOW, 1_000)
    assert told.reservation is not None and local.granted and untold.granted
    await store.release(told.reservation.reservation_id, NOW)
    notices = await store.read_notices("d1", 0, 10)
    assert [(n.kind, n.pulled_tokens) for n in notices] == [
        (NoticeKind.GRANT, 4_000),
        (NoticeKind.GRANT, 0),
        (NoticeKind.GRANT, None),
        (NoticeKind.RELEASE, None),
    ]
    before = await snapshot(store)
    for bad in (-1, 1_000_000_001):
        with pytest.raises(InvalidArgument) as err:
            await store.try_debit("d1", credits(1), 1.0, NOW, 1_000, pulled_tokens=bad)
        assert err.value.field == "pulled_tokens"
    assert await snapshot(store) == before


async def test_a_notice_batch_is_the_notices_as_the_relay_sends_them(store: Store) -> None:
    """``read_notice_rows`` encoded by the transport (the agent stream's relay) equals
    ``read_notices`` converted by ``notice_to_proto``, field for field and byte for byte:
    grants with and without pulled tokens, a release, expiries, a cordon; resumed, limited,
    blocking, and refused alike."""
    await register(store, "d1", "d2")
    await store.upsert_lease(lease(), NOW, MAX_TTL)
    told = await store.try_debit("d1", credits(3), 1.0, NOW, 1_000, pulled_tokens=4_000)
    (local,) = await store.try_debits(
        [DebitRequest("d1", credits(1), pulled_tokens=0)], 1.0, NOW, 100
    )
    held = (await store.try_debit("d1", credits(2), 1.0, NOW, 100)).reservation
    assert told.reservation is not None and local.granted and held is not None
    await store.release(told.reservation.reservation_id, NOW)
    await store.set_cordon("d1", True, "maintenance", NOW)
    with pytest.raises(NotFound):  # the held reservations expire (EXPIRE notices)
        await store.commit(held.reservation_id, NOW + 5_000, 1_000)

    async def same(after: int, limit: int, block_ms: int = 0) -> int:
        notices = await store.read_notices("d1", after, limit, block_ms)
        rows = await store.read_notice_rows("d1", after, limit, block_ms)
        assert rows == [NoticeRow.of(n) for n in notices]
        batch = notice_rows_to_proto(rows)
        expected = lease_pb2.NoticeBatch(notices=[notice_to_proto(n) for n in notices])
        assert batch == expected
        assert batch.SerializeToString(deterministic=True) == expected.SerializeToString(
            deterministic=True
        )
        return len(batch.notices)

    kinds = {n.kind for n in await store.read_notices("d1", 0, 100)}
    assert {NoticeKind.GRANT, NoticeKind.RELEASE, NoticeKind.EXPIRE, NoticeKind.CORDON} <= kinds
    total = await same(0, 100)
    assert total >= 5
    assert await same(2, 2) == 2
    assert await same(total, 10) == 0
    assert await same(total, 10, block_ms=20) == 0
    assert await same(0, 0) == 0
    assert await store.read_notice_rows("d2", 0, 10) == []
    with pytest.raises(NotFound):
        await store.read_notice_rows("ghost", 0, 10)


async def test_blocking_read_wakes_on_a_new_notice(store: Store) -> None:
    await register(store, "d1")
    await store.upsert_lease(lease(), NOW, MAX_TTL)
    assert await store.read_notices("d1", 0, 10, block_ms=20) == []
    reader = asyncio.create_task(store.read_notices("d1", 0, 10, block_ms=10_000))
    await asyncio.sleep(0.05)
    assert not reader.done()
    granted = await store.try_debit("d1", credits(1), 1.0, NOW, 1_000)
    notices = await asyncio.wait_for(reader, timeout=10)
    assert granted.reservation is not None
    assert [(n.seq, n.reservation_id) for n in notices] == [(1, granted.reservation.reservation_id)]


# -- admission view ----------------------------------------------------------------------------
async def test_admission_view_samples_only_live_lenders(store: Store) -> None:
    nodes = [f"d{i:02d}" for i in range(12)]
    await register(store, *nodes)
    for i, node in enumerate(nodes):
        if i < 5:
            await store.upsert_lease(lease(node, ttl_ms=5_000), NOW, 5_000)
        elif i < 7:
            await store.upsert_lease(lease(node, zero_reason=ZeroReason.STARTING), NOW, 5_000)
        elif i == 7:
            await store.upsert_lease(lease(node), NOW, 5_000)
            await store.set_cordon(node, True, "ops", NOW)
        elif i == 8:
            await store.upsert_lease(lease(node, ttl_ms=100), NOW, 5_000)
    live = set(nodes[:5])
    pool, states = await store.admission_view("default", [], 8, NOW + 200)
    assert pool is None
    assert {s.info.node_id for s in states} == live
    _, three = await store.admission_view("default", [], 3, NOW + 200)
    assert len({s.info.node_id for s in three}) == 3 <= len(live)
    assert {s.info.node_id for s in three} <= live
    # Named candidates come back as asked (unknown ids left out), lease and debits included.
    await store.try_debit("d01", credits(7), 1.0, NOW + 200, 1_000)
    _, named = await store.admission_view("default", ["d01", "ghost", "d06", "d01"], 8, NOW + 200)
    assert [s.info.node_id for s in named] == ["d01", "d06"]
    assert named[0].open_debits == credits(7) and named[0].open_reservations == 1
    assert named[1].lease is not None and named[1].lease.lease.zero_reason is ZeroReason.STARTING


async def test_pool_load_reports_expire(store: Store) -> None:
    for node, ttl in (("p1", 1_000), ("p2", 100)):
        load = PoolLoad(
            node_id=node, outstanding_uncached_tokens=1_000, processing_rate_tps=10.0, ttl_ms=ttl
        )
        await store.put_pool_load(load, NOW, 500)
    pool, _ = await store.admission_view("default", [], 0, NOW + 50)
    assert pool is not None and [r.node_id for r in pool.reports] == ["p1", "p2"]
    assert pool.outstanding_uncached_tokens == 2_000
    pool, _ = await store.admission_view("default", [], 0, NOW + 100)
    assert pool is not None and [r.node_id for r in pool.reports] == ["p1"]
    assert (await store.admission_view("default", [], 0, NOW + 500))[0] is None
    assert (await store.admission_view("other", [], 0, NOW))[0] is None
    pools = await store.list_pools(NOW + 100)
    assert [(p.pool, len(p.reports)) for p in pools] == [("default", 1)]


async def test_a_pool_report_says_whether_its_node_is_registered(store: Store) -> None:
    """The stream ends on a deleted node's report (its agent registers it again): the store
    tells, and stores the report either way (it expires)."""
    load = PoolLoad(
        node_id="p7", outstanding_uncached_tokens=5, processing_rate_tps=1.0, ttl_ms=900
    )
    assert await store.put_pool_load(load, NOW, 5_000) is False
    await store.register_node("p7", NodeRole.PREFILL, "default", {}, NOW)
    assert await store.put_pool_load(load, NOW, 5_000) is True
    await store.delete_node("p7", False, NOW)
    assert await store.put_pool_load(load, NOW, 5_000) is False
    pool, _ = await store.admission_view("default", [], 0, NOW)
    assert pool is not None and [r.node_id for r in pool.reports] == ["p7"]


async def test_pool_reports_take_rising_ingest_sequences(store: Store) -> None:
    """Each stored report gets a sequence above every earlier one of its pool, whatever the
    caller's clock says (here it goes back): replicas order reports by it, not by receipt."""
    seen: list[int] = []
    for node, now in (("p1", NOW), ("p2", NOW - 400), ("p1", NOW - 900)):
        load = PoolLoad(
            node_id=node, outstanding_uncached_tokens=10, processing_rate_tps=10.0, ttl_ms=5_000
        )
        await store.put_pool_load(load, now, 5_000)
        pool, _ = await store.admission_view("default", [], 0, NOW)
        assert pool is not None
        seqs = dict(zip((r.node_id for r in pool.reports), pool.report_seqs, strict=True))
        assert seqs[node] > max(seen, default=0)
        seen.append(seqs[node])
        assert pool.reports[0].outstanding_uncached_tokens == 10  # the report reads back whole
    listed = await store.list_pools(NOW)
    assert sorted(listed[0].report_seqs) == sorted(seen[1:])


# -- operators ---------------------------------------------------------------------------------
async def test_list_get_history_and_events(store: Store) -> None:
    await register(store, "d2", "d1")
    assert [s.info.node_id for s in await store.list_nodes(NOW)] == ["d1", "d2"]
    with pytest.raises(NotFound):
        await store.get_node("ghost", NOW)
    for version in range(1, 5):
        await store.upsert_lease(lease(version=version, value=version), NOW + version, MAX_TTL)
    history = await store.lease_history("d1", 3)
    assert [h.lease.version for h in history] == [4, 3, 2]
    assert history[0].received_at_ms == NOW + 4
    await store.upsert_lease(lease(version=5, zero_reason=ZeroReason.ITL_OVER_SLO), NOW, MAX_TTL)
    await store.upsert_lease(lease(version=6), NOW, MAX_TTL)
    await store.set_cordon("d1", True, "disk", NOW + 9)
    await store.upsert_lease(lease(epoch=2, version=1), NOW + 10, MAX_TTL)
    events = await store.node_events("d1", 10)
    assert [(e.kind, e.message) for e in events] == [
        ("new_epoch", "new epoch 2"),
        ("cordon", "cordoned: disk"),
        ("lease_restored", "lease restored"),
        ("lease_zeroed", "lease zeroed: itl_over_slo"),
        ("new_epoch", "new epoch 1"),
    ]
    assert events[0].at_ms == NOW + 10
    assert len(await store.node_events("d1", 2)) == 2
    for read in (store.lease_history, store.node_events):
        with pytest.raises(NotFound):
            await read("ghost", 10)
    d1 = (await store.list_nodes(NOW + 10))[0]
    assert d1.info.cordoned and d1.lease is not None and d1.lease.lease.epoch == 2


async def test_policy_round_trip_is_versioned_compare_and_set(store: Store) -> None:
    assert await store.get_policy() is None
    first = VersionedPolicy(
        policy=PolicySettings().updated({"borrow_share": 0.3, "hold_ttl_ms": 1234}), version=1
    )
    await store.set_policy(first, expected_version=0)
    assert await store.get_policy() == first
    second = VersionedPolicy(policy=PolicySettings(shadow_mode=True), version=2)
    for stale in (0, 2, 7):  # not the stored version: refused, nothing changes
        with pytest.raises(Aborted) as lost:
            await store.set_policy(second, expected_version=stale)
        assert lost.value.current_version == 1 and lost.value.field == "expected_version"
        assert await store.get_policy() == first
    await store.set_policy(second, expected_version=1)
    assert await store.get_policy() == second
    await store.ping()


async def test_request_records_first_outcome_wins(store: Store) -> None:
    assert await store.read_request("admit:r1") is None
    assert await store.record_request("admit:r1", "first", 60_000) is None
    assert await store.record_request("admit:r1", "second", 60_000) == "first"  # lost the race
    assert await store.read_request("admit:r1") == "first"
    assert await store.record_request("short", "x", 1) is None
    await asyncio.sleep(0.05)
    assert await store.read_request("short") is None  # the record expired
    assert await store.record_request("short", "y", 60_000) is None


async def test_a_record_is_forgotten_only_for_the_reservation_it_names(store: Store) -> None:
    record = '{"decision":"borrow","reservation_id":"abc@d1","lease_epoch":1}'
    assert await store.record_request("admit:r2", record, 60_000) is None
    await store.forget_request("admit:r2", "ab")  # a prefix of the id is not the id
    await store.forget_request("admit:r2", "other@d1")
    assert await store.read_request("admit:r2") == record
    await store.forget_request("admit:r2", "abc@d1")
    assert await store.read_request("admit:r2") is None
    await store.forget_request("admit:none", "abc@d1")  # nothing recorded: nothing happens


async def test_a_record_rides_with_its_debit_only_where_the_store_folds_records(
    store: Store,
) -> None:
    """A store that cannot write the record in the debit's atomic step refuses it, debiting
    nothing; dropping it would leave a retry of the request with no outcome to find."""
    await register(store, "d1")
    await store.upsert_lease(lease(value=80), NOW, MAX_TTL)
    before = await snapshot(store)
    record = RequestRecord(key="admit:r9", ttl_ms=60_000, payload="{}")
    item = DebitRequest("d1", credits(10), "r9", "", record)
    if not store.folds_request_records:
        with pytest.raises(InvalidArgument):
            await store.try_debits([item], 1.0, NOW, 100)
        assert await snapshot(store) == before
        assert await store.read_request("admit:r9") is None
        return
    (outcome,) = await store.try_debits([item], 1.0, NOW, 100)
    assert outcome.granted and outcome.reservation is not None
    assert outcome.record_key == "admit:r9"
    stored = await store.read_request("admit:r9")
    assert stored is not None and outcome.reservation.reservation_id in stored


async def test_a_batch_with_a_bad_item_debits_nothing(store: Store) -> None:
    """Every item is checked before any is debited: the in-process store granted the items
    before a bad one (a negative node time), then raised, and that grant reached no caller."""
    await register(store, "d1")
    await store.upsert_lease(lease(value=80), NOW, MAX_TTL)
    before = await snapshot(store)
    good = DebitRequest("d1", credits(10), "r1", "")
    bad = DebitRequest("d1", credits(10), "r2", "", None, -1)
    with pytest.raises(InvalidArgument):
        await store.try_debits([good, bad], 1.0, NOW, 100)
    assert await snapshot(store) == before


async def test_a_node_keeps_the_time_it_first_registered(store: Store) -> None:
    """``get nodes`` AGE was the age of the latest lease (always 0s): it is the node's own age,
    from its first registration, which reconnects and agent restarts keep and a delete ends."""
    first = await store.register_node("n1", NodeRole.DECODE, "default", {}, NOW)
    assert first.registered_at_ms == NOW
    again = await store.register_node("n1", NodeRole.DECODE, "default", {"a": "b"}, NOW + 5_000)
    assert again.registered_at_ms == NOW
    assert (await store.get_node("n1", NOW + 5_000)).info.registered_at_ms == NOW
    assert [n.info.registered_at_ms for n in await store.list_nodes(NOW + 5_000)] == [NOW]
    await store.delete_node("n1", False, NOW + 6_000)
    anew = await store.register_node("n1", NodeRole.DECODE, "default", {}, NOW + 7_000)
    assert anew.registered_at_ms == NOW + 7_000


async def test_identity_is_fixed_unless_cordoned(store: Store) -> None:
    await store.register_node("n1", NodeRole.DECODE, "default", {"zone": "a"}, NOW)
    for role, pool, named in (
        (NodeRole.PREFILL, "default", "role"),
        (NodeRole.DECODE, "other", "pool"),
    ):
        with pytest.raises(FailedPrecondition) as refused:
            await store.register_node("n1", role, pool, {}, NOW)
        assert refused.value.field == named
    info = (await store.get_node("n1", NOW)).info
    assert (info.role, info.pool, info.labels) == (NodeRole.DECODE, "default", {"zone": "a"})
    # Same identity: a re-register refreshes labels.
    await store.register_node("n1", NodeRole.DECODE, "default", {"zone": "b"}, NOW)
    await store.set_cordon("n1", True, "moving to prefill", NOW)
    moved = await store.register_node("n1", NodeRole.PREFILL, "p2", {}, NOW)
    assert (moved.role, moved.pool, moved.cordoned) == (NodeRole.PREFILL, "p2", True)


# -- §5.7 bad input ----------------------------------------------------------------------------
async def test_bad_input_is_refused(store: Store) -> None:
    await register(store, "d1")
    with pytest.raises(NotFound) as nf:
        await store.commit(f"{'0' * 32}@d1", NOW, 1_000)
    assert nf.value.field == "reservation_id"
    with pytest.raises(NotFound):
        await store.release(f"{'a' * 32}@ghost", NOW)
    for bad in ("", "nope", "xyz@d1", f"{'0' * 32}@", f"{'0' * 32}@bad id", "0" * 32):
        with pytest.raises(InvalidArgument) as err:
            await store.release(bad, NOW)
        assert err.value.field == "reservation_id"
    with pytest.raises(NotFound) as nf:
        await store.set_cordon("ghost", True, "x", NOW)
    assert nf.value.field == "node_id"
    with pytest.raises(FailedPrecondition):
        await store.upsert_lease(lease("unregistered"), NOW, MAX_TTL)
    with pytest.raises(NotFound):
        await store.list_reservations("ghost", NOW)
    with pytest.raises(InvalidArgument) as err:
        await store.register_node("bad id", NodeRole.DECODE, "default", {}, NOW)
    assert err.value.field == "node_id"
    assert [s.info.node_id for s in await store.list_nodes(NOW)] == ["d1"]
