"""The normal path's wait is that of the prefill server a prompt would go to, in time
(``PoolLoad.queue_wait_ms``, ``AdmissionRequest.prefill_node_id``; DESIGN.md §4.1-2).

The pool's tokens over its rate misread a pool where one prompt with a huge cached prefix and
few uncached tokens holds one server for tens of seconds: with the other server idle it reads
seconds while a prompt sent there starts at once; with both held it reads far less than either
server needs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossflow_ctl.domain.admission import (
    AdmissionRequest,
    Reason,
    check_demand,
    plan_admission,
    target_demand,
)
from crossflow_ctl.domain.models import PoolLoad, PoolSnapshot
from crossflow_ctl.domain.pending import Unreported
from tests.domain.test_admission import NOW, SETTINGS, node


def load(node_id: str, outstanding: int, wait_ms: float | None) -> PoolLoad:
    return PoolLoad(
        node_id=node_id,
        outstanding_uncached_tokens=outstanding,
        processing_rate_tps=1000.0,
        prefill_rate_tps=1000.0,
        ttl_ms=1000,
        queue_wait_ms=wait_ms,
    )


# p0 runs a prompt whose cached prefix makes its 500 uncached tokens take 30 s; p1 is idle.
# Tokens over rate: 500 / 2000 tokens/s = 250 ms.
JAMMED_IDLE = PoolSnapshot(pool="default", reports=(load("p0", 500, 30_000.0), load("p1", 0, 0.0)))
BOTH_JAMMED = PoolSnapshot(
    pool="default", reports=(load("p0", 500, 30_000.0), load("p1", 800, 12_000.0))
)


def to(server: str | None, uncached: int = 1000) -> AdmissionRequest:
    return AdmissionRequest(
        uncached_prompt_tokens=uncached, expected_output_tokens=100, prefill_node_id=server
    )


def test_the_wait_is_the_named_servers_else_the_least_loaded_ones() -> None:
    assert JAMMED_IDLE.estimated_wait_ms(prefill_node_id="p0") == 30_000.0
    assert JAMMED_IDLE.estimated_wait_ms(prefill_node_id="p1") == 0.0
    assert JAMMED_IDLE.estimated_wait_ms() == 0.0  # a least-loaded router sends it to p1
    assert BOTH_JAMMED.estimated_wait_ms() == 12_000.0  # tokens over rate would say 650 ms


def test_tokens_sent_since_the_reports_add_at_the_pools_rate() -> None:
    # 2000 tokens over the pool's 2000 tokens/s: 1 s more, on the named server or not
    assert BOTH_JAMMED.estimated_wait_ms(2000, "p0") == pytest.approx(31_000.0)
    assert BOTH_JAMMED.estimated_wait_ms(2000) == pytest.approx(13_000.0)


def test_a_pool_not_all_in_time_reads_tokens_over_rate() -> None:
    """An agent that cannot tell its wait in time (an older one, a source without the figure)
    puts the whole pool back on tokens over rate: one figure of each kind cannot be compared."""
    mixed = PoolSnapshot(pool="default", reports=(load("p0", 500, 30_000.0), load("p1", 300, None)))
    assert mixed.server_waits_ms() is None
    assert mixed.estimated_wait_ms() == pytest.approx(400.0)
    assert mixed.estimated_wait_ms(prefill_node_id="p0") == pytest.approx(400.0)
    assert not check_demand(mixed, SETTINGS, prefill_node_id="p0").timed


def test_a_named_server_without_a_live_report_fails_demand() -> None:
    """Its wait is unknown (its agent stopped reporting, or the router names a server the broker
    has no report of): fail closed, as for a pool with no report at all."""
    for pool in (JAMMED_IDLE, PoolSnapshot(pool="default", reports=(load("p0", 0, None),))):
        assert pool.estimated_wait_ms(prefill_node_id="p9") is None
        plan = plan_admission(to("p9"), pool, [node()], SETTINGS, NOW)
        assert plan.reason is Reason.POOL_LOAD_MISSING and not plan.ranked
        assert "prefill server p9" in plan.summary()


def test_a_prompt_for_the_idle_server_has_no_demand_one_for_the_jammed_one_borrows() -> None:
    idle = plan_admission(to("p1"), JAMMED_IDLE, [node()], SETTINGS, NOW)
    assert idle.reason is Reason.NO_DEMAND and idle.demand.pool_wait_ms == 0.0
    jammed = plan_admission(to("p0"), JAMMED_IDLE, [node()], SETTINGS, NOW)
    assert jammed.reason is Reason.BORROWED
    assert jammed.demand.prefill_node_id == "p0" and jammed.demand.timed
    assert jammed.normal_path is not None and jammed.normal_path.wait_ms == 30_000.0
    assert "0.0 ms on p1" in idle.summary()


def test_benefit_weighs_the_least_loaded_servers_wait_in_time() -> None:
    """A 6000-token prompt on a node that needs 15 s for it (400 tokens/s): against the pool's
    tokens over rate (650 ms wait + 6 s prefill + 6 s transfer) it is no benefit; against the
    12 s the least-loaded server really needs before it can start, it is."""
    big = to(None, uncached=6000)
    untimed = PoolSnapshot(
        pool="default",
        reports=tuple(r.model_copy(update={"queue_wait_ms": None}) for r in BOTH_JAMMED.reports),
    )
    slow = node(rate=400.0)
    assert plan_admission(big, untimed, [slow], SETTINGS, NOW).reason is Reason.NO_BENEFIT
    assert plan_admission(big, BOTH_JAMMED, [slow], SETTINGS, NOW).reason is Reason.BORROWED


@settings(deadline=None)  # no wall-clock limit: a loaded test machine must not fail it
@given(
    waits=st.lists(st.floats(0.0, 1e6), min_size=1, max_size=6),
    sent=st.lists(st.integers(0, 10**6), min_size=6, max_size=6),
    which=st.integers(0, 5),
    pending=st.integers(0, 10**6),
    uncached=st.integers(0, 200_000),
)
def test_pool_wide_demand_still_implies_every_prompts_demand(
    waits: list[float], sent: list[int], which: int, pending: int, uncached: int
) -> None:
    """What a room watch reports (no server named: the least-loaded one's wait, tokens sent to
    each server since its report included) holds for a prompt bound for any server: no
    server's wait is below the least-loaded one's."""
    pool = PoolSnapshot(
        pool="default", reports=tuple(load(f"p{i}", 100, w) for i, w in enumerate(waits))
    )
    unreported = Unreported(pending, {f"p{i}": n for i, n in enumerate(sent)})
    request = to(f"p{which % len(waits)}", uncached)
    demand = check_demand(pool, SETTINGS, unreported.shared, None, unreported.by_server)
    plan = plan_admission(request, pool, [node()], SETTINGS, NOW, demand, None, unreported)
    if demand.holds:
        assert plan.demand.holds


def test_tokens_sent_to_a_server_since_its_report_add_to_its_wait_at_its_rate() -> None:
    """A burst sent to the idle server since its last report: its wait is that burst, at its
    own rate (1000 tokens/s), not spread over the pool; the jammed server's is unchanged."""
    sent = Unreported(0, {"p1": 3000})
    assert JAMMED_IDLE.estimated_wait_ms(0, "p1", sent.by_server) == pytest.approx(3000.0)
    assert JAMMED_IDLE.estimated_wait_ms(0, "p0", sent.by_server) == 30_000.0
    assert JAMMED_IDLE.estimated_wait_ms(0, None, sent.by_server) == pytest.approx(3000.0)
    plan = plan_admission(to("p1"), JAMMED_IDLE, [node()], SETTINGS, NOW, None, None, sent)
    assert plan.demand.pool_wait_ms == pytest.approx(3000.0)
    assert plan.demand.pending_uncached_tokens == 3000 and plan.reason is Reason.BORROWED
    pooled = check_demand(JAMMED_IDLE, SETTINGS, 0, None, sent.by_server)  # a room watch's
    assert pooled.pool_wait_ms == pytest.approx(3000.0) and pooled.pending_uncached_tokens == 3000


def test_a_demand_already_for_the_named_server_is_taken_as_it_is() -> None:
    """What a caller planning many prompts keeps per server (the service's memo) plans exactly
    as the pool's Demand it was made from."""
    sent = Unreported(0, {"p1": 3000})
    pooled = check_demand(JAMMED_IDLE, SETTINGS, 0, None, sent.by_server)
    for server in ("p0", "p1"):
        request = to(server)
        own = target_demand(pooled, JAMMED_IDLE, request, SETTINGS, sent)
        assert own.prefill_node_id == server
        assert target_demand(own, JAMMED_IDLE, request, SETTINGS, sent) is own
        kept = plan_admission(request, JAMMED_IDLE, [node()], SETTINGS, NOW, own, None, sent)
        made = plan_admission(request, JAMMED_IDLE, [node()], SETTINGS, NOW, pooled, None, sent)
        assert kept == made
