"""Prompts sent to the prefill pool that its reports do not show yet, and Demand's wait with them
(:mod:`crossflow_ctl.domain.pending`, ``PoolSnapshot.estimated_wait_ms``, ``check_demand``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossflow_ctl.domain.admission import Plan, Reason, check_demand
from crossflow_ctl.domain.models import PoolLoad, PoolSnapshot
from crossflow_ctl.domain.pending import sequence_restarted, unreported_tokens
from crossflow_ctl.domain.policy import PolicySettings

SETTINGS = PolicySettings(demand_threshold_ms=100.0)

seqs = st.integers(min_value=1, max_value=10_000)
sends = st.lists(st.tuples(seqs, st.integers(min_value=0, max_value=100_000)), max_size=30)
reports = st.lists(seqs, min_size=1, max_size=8)
"""Stored reports' sequences (from 1: 0 marks a report stored before sequences existed)."""


def pool(outstanding: int, rate: float, report_seqs: tuple[int, ...] = (1,)) -> PoolSnapshot:
    loads = tuple(
        PoolLoad(
            node_id=f"p{i}",
            outstanding_uncached_tokens=outstanding if i == 0 else 0,
            processing_rate_tps=rate if i == 0 else 0.0,
            ttl_ms=1000,
        )
        for i in range(len(report_seqs))
    )
    return PoolSnapshot(pool="default", reports=loads, report_seqs=report_seqs)


def test_a_prompt_counts_in_the_share_of_reports_stored_before_it_was_sent() -> None:
    # Two servers' reports got sequences 100 and 200: a prompt sent once the newest report seen
    # was 150 may be in the second one's.
    assert unreported_tokens([(150, 1000)], [200, 100]) == 500
    assert unreported_tokens([(250, 1000)], [100, 200]) == 1000
    assert unreported_tokens([(50, 1000)], [100, 200]) == 0
    # A prompt sent after the replica saw a report is not in it.
    assert unreported_tokens([(200, 1000)], [200]) == 1000
    assert unreported_tokens([(150, 999)], []) == 0  # no sequences: nothing counted
    # A report without a sequence (an older broker stored it) shows every prompt.
    assert unreported_tokens([(250, 1000)], [0, 200]) == 1000  # as if the 0 were not there
    assert unreported_tokens([(150, 1000)], [0]) == 0


def test_a_restarted_sequence_is_told_from_expired_reports() -> None:
    assert sequence_restarted((1, 2), (1000, 1001))  # the store's counter began again
    assert sequence_restarted((3,), (1000,))
    assert not sequence_restarted((1000,), (1000, 1001))  # the newest report expired
    assert not sequence_restarted((1002, 1003), (1000, 1001))
    assert not sequence_restarted((), (1000,)) and not sequence_restarted((5,), ())


@given(sends, reports)
def test_never_more_than_was_sent_nor_less_than_nothing(
    sent: list[tuple[int, int]], stored: list[int]
) -> None:
    assert 0 <= unreported_tokens(sent, stored) <= sum(t for _, t in sent)


@given(sends, reports)
def test_all_of_it_before_any_report_none_of_it_after_every_one(
    sent: list[tuple[int, int]], stored: list[int]
) -> None:
    later = [(max(stored) + 1 + t, n) for t, n in sent]
    assert unreported_tokens(later, stored) == sum(n for _, n in sent)
    earlier = [(min(stored) - 1 - t, n) for t, n in sent]
    assert unreported_tokens(earlier, stored) == 0


@given(sends, reports, st.integers(min_value=0, max_value=7), seqs)
def test_a_newer_report_never_adds(
    sent: list[tuple[int, int]], stored: list[int], which: int, later_by: int
) -> None:
    """A server reporting again (stored later) can only show more of what was sent."""
    i = which % len(stored)
    renewed = [*stored[:i], stored[i] + later_by, *stored[i + 1 :]]
    assert unreported_tokens(sent, renewed) <= unreported_tokens(sent, stored)


def test_pending_tokens_add_to_the_wait_at_the_pools_rate() -> None:
    snapshot = pool(outstanding=500, rate=10_000.0)
    assert snapshot.estimated_wait_ms() == pytest.approx(50.0)
    assert snapshot.estimated_wait_ms(pending_tokens=1000) == pytest.approx(150.0)


def test_pending_tokens_mean_nothing_without_a_rate() -> None:
    """An idle pool reports no rate: its first prompts must not read as an unbounded wait."""
    assert pool(outstanding=0, rate=0.0).estimated_wait_ms(pending_tokens=1000) == 0.0
    demand = check_demand(pool(outstanding=0, rate=0.0), SETTINGS, pending_tokens=1000)
    assert not demand.holds and demand.pending_uncached_tokens == 0


def test_demand_holds_once_the_tokens_sent_since_the_reports_push_the_wait_over() -> None:
    snapshot = pool(outstanding=500, rate=10_000.0)
    assert not check_demand(snapshot, SETTINGS).holds
    demand = check_demand(snapshot, SETTINGS, pending_tokens=1000)
    assert demand.holds
    assert demand.pool_wait_ms == pytest.approx(150.0)
    assert demand.outstanding_uncached_tokens == 500
    assert demand.pending_uncached_tokens == 1000
    # The explanation says why: the tokens sent since the reports.
    summary = Plan(reason=Reason.NO_DEMAND, demand=demand.model_copy(update={"holds": False}))
    assert "1000 tokens sent since its reports" in summary.summary()
