"""The admission policy, condition by condition, on hand-checkable numbers (DESIGN.md §4)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossflow_ctl.domain.admission import (
    AdmissionRequest,
    Reason,
    check_demand,
    debit_for,
    estimate_normal_path,
    node_rooms,
    plan_admission,
)
from crossflow_ctl.domain.models import (
    Credits,
    Lease,
    NodeInfo,
    NodeState,
    PoolLoad,
    PoolSnapshot,
    Shares,
    StoredLease,
    ZeroReason,
)
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.domain.safety import fits

NOW = 1_000_000
# 1 KiB per token over 1,024,000 B/s keeps transfer times easy: 1 token = 1 ms.
SETTINGS = PolicySettings(
    demand_threshold_ms=100.0,
    borrow_share=1.0,
    kv_bytes_per_token=1024,
    kv_transfer_bytes_per_s=1_024_000.0,
    default_prefill_rate_tps=1000.0,
)
ROOMY = Credits(
    compute_tokens=10_000,
    kv_tokens=100_000,
    kv_transfer_bytes=10**9,
    output_tokens=10_000,
    slots=4,
)

NO_DEBITS = Credits()


def pool(outstanding: int, rate: float, prefill_rate: float = 1000.0) -> PoolSnapshot:
    load = PoolLoad(
        node_id="p0",
        outstanding_uncached_tokens=outstanding,
        processing_rate_tps=rate,
        prefill_rate_tps=prefill_rate,
        ttl_ms=1000,
    )
    return PoolSnapshot(pool="default", reports=(load,))


def node(
    node_id: str = "d0",
    credits: Credits = ROOMY,
    rate: float = 2000.0,
    queue_ms: float = 0.0,
    expires_at: int = NOW + 500,
    zero: ZeroReason | None = None,
    cordoned: bool = False,
    debits: Credits = NO_DEBITS,
) -> NodeState:
    lease = Lease(
        node_id=node_id,
        epoch=1,
        version=7,
        ttl_ms=1000,
        credits=Credits() if zero else credits,
        zero_reason=zero,
        queue_wait_ms=queue_ms,
        borrowed_prefill_rate_tps=rate,
    )
    return NodeState(
        info=NodeInfo(node_id=node_id, cordoned=cordoned),
        lease=StoredLease(lease=lease, received_at_ms=NOW - 100, expires_at_ms=expires_at),
        open_debits=debits,
    )


REQUEST = AdmissionRequest(uncached_prompt_tokens=1000, expected_output_tokens=100)


def test_borrow_when_demand_benefit_and_safety_hold() -> None:
    # Normal: wait 2000 ms (2000 tokens at 1000/s) + prefill 1000 ms + transfer 1000 ms.
    plan = plan_admission(REQUEST, pool(2000, 1000.0), [node()], SETTINGS, NOW)
    assert plan.reason is Reason.BORROWED
    assert plan.normal_path is not None
    assert plan.normal_path.total_ms == pytest.approx(2000 + 1000 + 1000)
    best = plan.ranked[0]
    assert best.node_id == "d0"
    assert best.predicted_ttft_ms == pytest.approx(500.0)  # 1000 tokens at 2000/s, no queue
    assert best.lease_version == 7


def test_demand_below_threshold_takes_the_normal_path() -> None:
    plan = plan_admission(REQUEST, pool(50, 1000.0), [node()], SETTINGS, NOW)  # 50 ms wait
    assert plan.reason is Reason.NO_DEMAND
    assert not plan.ranked


def test_a_short_prompt_has_demand_once_the_wait_exceeds_its_own_prefill_time() -> None:
    # 50 ms wait: below the pool's 100 ms threshold, but 2.5x a 20-token prompt's 20 ms prefill
    short = AdmissionRequest(uncached_prompt_tokens=20, expected_output_tokens=10)
    plan = plan_admission(short, pool(50, 1000.0), [node()], SETTINGS, NOW)
    assert plan.reason is Reason.BORROWED
    assert plan.demand.threshold_ms == pytest.approx(20.0) and plan.demand.holds
    # the 1,000-token prompt (1 s prefill) keeps the pool's threshold: no demand
    plan = plan_admission(REQUEST, pool(50, 1000.0), [node()], SETTINGS, NOW)
    assert plan.reason is Reason.NO_DEMAND and plan.demand.threshold_ms == 100.0
    # the ratio scales the prompt's threshold; None turns it off
    half = SETTINGS.updated({"demand_prefill_ratio": 2.5})
    plan = plan_admission(short, pool(50, 1000.0), [node()], half, NOW)
    assert plan.reason is Reason.NO_DEMAND and plan.demand.threshold_ms == pytest.approx(50.0)
    off = SETTINGS.updated({"demand_prefill_ratio": None})
    assert plan_admission(short, pool(50, 1000.0), [node()], off, NOW).reason is Reason.NO_DEMAND
    # an idle pool has no demand for any prompt, however short
    assert plan_admission(short, pool(0, 1000.0), [node()], SETTINGS, NOW).reason is (
        Reason.NO_DEMAND
    )


@given(
    outstanding=st.integers(0, 100_000),
    rate=st.floats(0.0, 1e6),
    uncached=st.integers(0, 200_000),
    ratio=st.one_of(st.none(), st.floats(0.0, 1000.0)),
)
def test_pool_wide_demand_implies_every_prompts_demand(
    outstanding: int, rate: float, uncached: int, ratio: float | None
) -> None:
    """What a room watch reports as Demand (the pool's threshold) holds for every prompt: a
    prompt's own threshold is never above it."""
    settings = SETTINGS.updated({"demand_prefill_ratio": ratio})
    snapshot = pool(outstanding, rate)
    request = AdmissionRequest(uncached_prompt_tokens=uncached)
    plan = plan_admission(request, snapshot, [node()], settings, NOW)
    assert plan.demand.threshold_ms <= settings.demand_threshold_ms
    if check_demand(snapshot, settings).holds:
        assert plan.demand.holds


def test_missing_pool_load_fails_demand() -> None:
    plan = plan_admission(REQUEST, None, [node()], SETTINGS, NOW)
    assert plan.reason is Reason.POOL_LOAD_MISSING
    assert not plan.ranked


def test_no_benefit_when_the_decode_node_is_slower() -> None:
    slow = node(rate=100.0)  # 10 s of service against a 4 s normal path
    plan = plan_admission(REQUEST, pool(2000, 1000.0), [slow], SETTINGS, NOW)
    assert plan.reason is Reason.NO_BENEFIT
    assert plan.nodes[0].predicted_ttft_ms == pytest.approx(10_000.0)


def test_benefit_is_strict_and_honours_the_margin() -> None:
    # Normal path total 4000 ms; node predicted 1000 ms queue + 500 ms service = 1500 ms.
    loaded = node(queue_ms=1000.0)
    margin = SETTINGS.updated({"benefit_margin_ms": 2500.0})
    assert plan_admission(REQUEST, pool(2000, 1000.0), [loaded], margin, NOW).reason is (
        Reason.NO_BENEFIT
    )
    margin = SETTINGS.updated({"benefit_margin_ms": 2499.0})
    assert plan_admission(REQUEST, pool(2000, 1000.0), [loaded], margin, NOW).reason is (
        Reason.BORROWED
    )


def test_safety_names_the_short_credit() -> None:
    tight = node(credits=ROOMY.model_copy(update={"output_tokens": 99}))
    plan = plan_admission(REQUEST, pool(2000, 1000.0), [tight], SETTINGS, NOW)
    assert plan.reason is Reason.NO_ROOM
    assert plan.nodes[0].short_credits == ("output_tokens",)


def test_open_debits_reduce_room_and_borrow_share_caps_it() -> None:
    debited = node(debits=Credits(slots=4))
    assert plan_admission(REQUEST, pool(2000, 1000.0), [debited], SETTINGS, NOW).reason is (
        Reason.NO_ROOM
    )
    half = SETTINGS.updated({"borrow_share": 0.5})
    small = node(credits=ROOMY.model_copy(update={"compute_tokens": 1999}))
    plan = plan_admission(REQUEST, pool(2000, 1000.0), [small], half, NOW)
    assert plan.nodes[0].short_credits == ("compute_tokens",)  # 1999 x 0.5 < 1000


def test_kv_is_lent_at_its_own_share_not_at_borrow_share() -> None:
    """A prompt whose KV (here 1,000 prompt + 100 output tokens) is over half the lease's KV
    credit still borrows at ``borrow_share`` 0.5: KV is lent at ``borrow_kv_share`` (whole by
    default), as that KV lands on a decode node on the normal path too."""
    half = SETTINGS.updated({"borrow_share": 0.5})
    assert half.shares == Shares(compute=0.5, kv=1.0, kv_transfer=1.0, output=0.5, slots=0.5)
    tight = node(credits=ROOMY.model_copy(update={"kv_tokens": 1_500}))
    plan = plan_admission(REQUEST, pool(2000, 1000.0), [tight], half, NOW)
    assert plan.reason is Reason.BORROWED
    assert plan.ranked[0].debit.kv_tokens == 1_100  # over 1,500 x 0.5
    kv_half = half.updated({"borrow_kv_share": 0.5})
    plan = plan_admission(REQUEST, pool(2000, 1000.0), [tight], kv_half, NOW)
    assert plan.reason is Reason.NO_ROOM
    assert plan.nodes[0].short_credits == ("kv_tokens",)


@pytest.mark.parametrize(
    "bad",
    [
        node(expires_at=NOW),
        node(zero=ZeroReason.ITL_OVER_SLO),
        node(cordoned=True),
        NodeState(info=NodeInfo(node_id="d0")),
    ],
    ids=["expired", "zero", "cordoned", "no-lease"],
)
def test_nodes_without_a_live_lease_never_borrow(bad: NodeState) -> None:
    plan = plan_admission(REQUEST, pool(2000, 1000.0), [bad], SETTINGS, NOW)
    assert plan.reason is Reason.NO_LEASES
    assert not plan.ranked


def test_best_node_is_the_lowest_predicted_ttft() -> None:
    nodes = [node("d0", queue_ms=300.0), node("d1", queue_ms=100.0), node("d2", rate=1.0)]
    plan = plan_admission(REQUEST, pool(2000, 1000.0), nodes, SETTINGS, NOW)
    assert [c.node_id for c in plan.ranked] == ["d1", "d0"]


def test_grants_since_the_lease_count_in_the_wait_so_prompts_spread_over_nodes() -> None:
    """Two idle leases, and d0 already granted 1,200 tokens since its lease: the next prompt
    waits 600 ms behind them there (1,200 at 2,000/s), so d1 ranks first. Before, the wait
    came from the lease alone, every prompt of a lease period went to d0 and queued there."""
    busy = node("d0", debits=Credits(compute_tokens=1_200, kv_tokens=2_000, slots=1))
    plan = plan_admission(REQUEST, pool(2000, 1000.0), [busy, node("d1")], SETTINGS, NOW)
    assert [c.node_id for c in plan.ranked] == ["d1", "d0"]
    by_id = {c.node_id: c for c in plan.nodes}
    assert by_id["d0"].queue_wait_ms == pytest.approx(600.0)
    assert by_id["d0"].predicted_ttft_ms == pytest.approx(600.0 + 500.0)
    # and the wait can take the Benefit away: 3,000 ms of open work beats a 4,000 ms normal path
    # no longer once the prompt's own 500 ms are added to 3,600 ms of queue
    swamped = node("d0", debits=Credits(compute_tokens=7_200, kv_tokens=2_000, slots=1))
    plan = plan_admission(REQUEST, pool(2000, 1000.0), [swamped], SETTINGS, NOW)
    assert plan.reason is Reason.NO_BENEFIT


def test_remote_prefix_costs_transfer_credit_and_time_local_prefix_does_not() -> None:
    req = AdmissionRequest(
        uncached_prompt_tokens=1000, cached_prefix_tokens=500, cached_prefix_node_id="d1"
    )
    assert debit_for(req, "d0", SETTINGS).credits.kv_transfer_bytes == 500 * 1024
    assert debit_for(req, "d1", SETTINGS).credits.kv_transfer_bytes == 0
    assert debit_for(req, "d0", SETTINGS).credits.kv_tokens == 1500
    plan = plan_admission(req, pool(2000, 1000.0), [node("d0"), node("d1")], SETTINGS, NOW)
    assert plan.ranked[0].node_id == "d1"
    by_id = {c.node_id: c for c in plan.nodes}
    assert by_id["d0"].service_ms == pytest.approx(500.0 + 500.0)  # + 500 tokens x 1 ms


def test_disabled_policy_never_borrows() -> None:
    off = SETTINGS.updated({"enabled": False})
    assert plan_admission(REQUEST, pool(2000, 1000.0), [node()], off, NOW).reason is (
        Reason.BORROWING_DISABLED
    )


@given(
    outstanding=st.integers(0, 10**6),
    rate=st.floats(0.0, 1e6),
    compute=st.integers(0, 5000),
    slots=st.integers(0, 3),
    uncached=st.integers(0, 5000),
    output=st.integers(0, 500),
    queue=st.floats(0.0, 10_000.0),
)
def test_a_ranked_node_always_satisfies_all_three_conditions(
    outstanding: int,
    rate: float,
    compute: int,
    slots: int,
    uncached: int,
    output: int,
    queue: float,
) -> None:
    credits = ROOMY.model_copy(update={"compute_tokens": compute, "slots": slots})
    request = AdmissionRequest(uncached_prompt_tokens=uncached, expected_output_tokens=output)
    plan = plan_admission(
        request, pool(outstanding, rate), [node(credits=credits, queue_ms=queue)], SETTINGS, NOW
    )
    for check in plan.ranked:
        assert plan.demand.holds
        assert plan.normal_path is not None
        assert check.predicted_ttft_ms < plan.normal_path.total_ms
        assert fits(credits, Credits(), SETTINGS.borrow_share, check.debit)


def _priced(node_id: str = "d0") -> NodeState:
    """A lease that prices prompts: 100 us per token plus 10 ns per token of attended context."""
    state = node(node_id, rate=5000.0)
    assert state.lease is not None
    lease = state.lease.lease.model_copy(
        update={"prefill_s_per_token": 1e-4, "prefill_s_per_token_context": 1e-8}
    )
    return state.model_copy(update={"lease": state.lease.model_copy(update={"lease": lease})})


def test_the_debit_and_the_benefit_use_the_prompts_own_cost() -> None:
    """Same uncached tokens, different cached prefixes: the longer prefix costs more compute
    credit and a longer predicted service on the borrowed path (issue #10 item 2)."""
    short = AdmissionRequest(uncached_prompt_tokens=1000, cached_prefix_tokens=0)
    long = AdmissionRequest(uncached_prompt_tokens=1000, cached_prefix_tokens=36_000)
    priced = _priced()
    lease = priced.lease.lease if priced.lease else None
    # 1000 x (100 us + 10 ns x 500) = 105 ms -> x 5000 tok/s = 525 tokens of credit
    assert debit_for(short, "d0", SETTINGS, lease).credits.compute_tokens == 525
    # 1000 x (100 us + 10 ns x 36,500) = 465 ms -> 2325 tokens
    assert debit_for(long, "d0", SETTINGS, lease).credits.compute_tokens == 2325
    # a lease without coefficients debits the uncached tokens
    plain = node().lease
    assert (
        debit_for(long, "d0", SETTINGS, plain.lease if plain else None).credits.compute_tokens
        == 1000
    )
    checks = [
        plan_admission(r, pool(2000, 1000.0), [priced], SETTINGS, NOW).nodes[0]
        for r in (short, long)
    ]
    assert checks[0].service_ms == pytest.approx(105.0)
    assert checks[1].service_ms == pytest.approx(465.0 + 36_000.0)  # + the remote prefix pull


def test_kv_debit_is_what_the_request_places_on_the_node() -> None:
    """Uncached prompt + a prefix that must be pulled in + the output decoded within the
    horizon; a prefix already cached on the node is in its own KV and not charged again."""
    req = AdmissionRequest(
        uncached_prompt_tokens=1000,
        cached_prefix_tokens=4000,
        cached_prefix_node_id="d1",
        expected_output_tokens=5000,
    )
    lease = Lease(node_id="d0", epoch=1, version=1, ttl_ms=1000, itl_ms=20.0)
    # the horizon at 20 ms per token: 400 of the 5000 output tokens fall in 8 s
    in_horizon = SETTINGS.borrow_horizon_ms // 20
    assert 0 < in_horizon < 5000
    remote = debit_for(req, "d0", SETTINGS, lease).credits
    assert (remote.kv_tokens, remote.output_tokens) == (1000 + 4000 + in_horizon, in_horizon)
    local = debit_for(req, "d1", SETTINGS, lease.model_copy(update={"node_id": "d1"})).credits
    assert local.kv_tokens == 1000 + in_horizon and local.kv_transfer_bytes == 0


def test_a_held_prompt_weighs_borrowing_against_the_tokens_held_ahead_of_it() -> None:
    # Normal path 4,000 ms (wait 2000 + prefill 1000 + transfer 1000); the node needs 5,000 ms.
    slow = node(rate=200.0)
    plan = plan_admission(REQUEST, pool(2000, 1000.0), [slow], SETTINGS, NOW)
    assert plan.reason is Reason.NO_BENEFIT
    # Held behind 2,000 tokens the router has not sent yet: the pool takes 2,000 ms more for
    # them (its processing rate, 1,000 tokens/s) before this prompt's own wait begins.
    held = REQUEST.model_copy(update={"held_ahead_tokens": 2000})
    plan = plan_admission(held, pool(2000, 1000.0), [slow], SETTINGS, NOW)
    assert plan.normal_path is not None
    assert plan.normal_path.hold_ms == pytest.approx(2000.0)
    assert plan.normal_path.total_ms == pytest.approx(6000.0)
    assert plan.reason is Reason.BORROWED and plan.ranked[0].node_id == "d0"


def test_the_hold_uses_the_prefill_rate_when_the_pool_reports_no_processing_rate() -> None:
    idle = pool(0, 0.0, prefill_rate=500.0)
    held = REQUEST.model_copy(update={"held_ahead_tokens": 1000})
    normal = estimate_normal_path(held, check_demand(idle, SETTINGS), idle, SETTINGS)
    assert normal.hold_ms == pytest.approx(2000.0)
    assert estimate_normal_path(REQUEST, check_demand(idle, SETTINGS), idle, SETTINGS).hold_ms == 0


def test_a_batch_plans_on_rooms_computed_once_per_node_with_the_same_result() -> None:
    """``node_rooms`` (what a batch computes once per view) gives each request's plan the same
    verdicts as planning alone, and plan_admission checks Safety against the rooms it is given."""
    nodes = [
        node("d0"),
        node("d1", credits=Credits(compute_tokens=1_500, kv_tokens=1_200, slots=1)),
        node("d2", debits=Credits(compute_tokens=9_500, kv_tokens=99_000, slots=4)),  # full
        node("d3", zero=ZeroReason.DRAINING),
        NodeState(info=NodeInfo(node_id="d4")),  # no lease: no room
    ]
    half = SETTINGS.model_copy(update={"borrow_share": 0.5})
    kv_half = half.model_copy(update={"borrow_kv_share": 0.5})
    for settings in (SETTINGS, half, kv_half):
        rooms = node_rooms(nodes, settings.shares)
        assert rooms[4] is None
        for prompt in (10, 1000, 3000):
            req = AdmissionRequest(uncached_prompt_tokens=prompt, expected_output_tokens=100)
            alone = plan_admission(req, pool(2000, 1000.0), nodes, settings, NOW)
            batched = plan_admission(req, pool(2000, 1000.0), nodes, settings, NOW, None, rooms)
            assert batched == alone
    # The rooms given are the ones checked: d0 told it is full has no room.
    full = node_rooms([node("d2", debits=ROOMY)], 1.0)
    plan = plan_admission(REQUEST, pool(2000, 1000.0), [node("d0")], SETTINGS, NOW, None, full)
    assert plan.reason is Reason.NO_ROOM
    assert plan.nodes[0].available == Credits()


@given(
    outstanding=st.integers(0, 10**6),
    rate=st.floats(0.0, 1e6),
    uncached=st.integers(0, 5000),
    cached=st.integers(0, 5000),
    held=st.integers(0, 10**6),
    ratio=st.one_of(st.none(), st.floats(0.01, 10.0)),
)
def test_a_plan_built_without_validation_is_what_validation_builds(
    outstanding: int, rate: float, uncached: int, cached: int, held: int, ratio: float | None
) -> None:
    """The plan, its normal path and a prompt's own Demand are built unvalidated (``trusted``,
    per Admit): validating their dump gives the same values, of the same types (every float a
    float), so answers and ``--explain`` numbers are those a validating build gives."""
    settings = SETTINGS.updated({"demand_prefill_ratio": ratio})
    request = AdmissionRequest(
        uncached_prompt_tokens=uncached, cached_prefix_tokens=cached, held_ahead_tokens=held
    )
    plan = plan_admission(request, pool(outstanding, rate), [node(), node("d1")], settings, NOW)
    revalidated = type(plan).model_validate(plan.model_dump())
    assert revalidated == plan
    assert revalidated.model_dump_json() == plan.model_dump_json()
    pairs = [(plan.demand, revalidated.demand), (plan.normal_path, revalidated.normal_path)]
    for built, validated in pairs:
        assert built is not None and validated is not None
        for name in type(built).model_fields:
            assert type(getattr(built, name)) is type(getattr(validated, name)), name
