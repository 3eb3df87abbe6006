"""Waiting notice reads share a few loop timers (issue #11: one timer per idle agent stream
kept thousands of handles in the event loop, and every cancelled timer lingered among them)."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from crossflow_ctl.store.redis_notices import _Deadlines, _Signal, due_instant_ms


@given(
    now_ms=st.floats(min_value=0, max_value=1e9, allow_nan=False),
    wait_ms=st.floats(min_value=0, max_value=300_000, allow_nan=False),
)
def test_a_shared_instant_is_never_early_and_late_by_at_most_a_sixteenth(
    now_ms: float, wait_ms: float
) -> None:
    due = due_instant_ms(now_ms, wait_ms)
    assert due >= now_ms + wait_ms
    assert due - (now_ms + wait_ms) <= max(1.0, wait_ms / 16)


def test_waits_of_similar_length_share_an_instant_and_short_ones_stay_fine() -> None:
    long_waits = {due_instant_ms(1_000.5 + i * 0.37, 30_000.0) for i in range(1000)}
    assert len(long_waits) == 1  # 1,000 idle streams' 30 s waits: one timer
    assert due_instant_ms(1_000.2, 20.0) == 1_021  # a 20 ms wait keeps its millisecond


async def test_thousands_of_waiters_arm_a_few_timers_and_each_wakes_at_its_deadline() -> None:
    deadlines = _Deadlines()
    idle = [_Signal() for _ in range(2_000)]
    for sig in idle:
        deadlines.add(sig, 30.0)
    short = _Signal()
    deadlines.add(short, 0.01)
    assert len(deadlines) <= 3  # the 30 s waits (on one or two instants) and the short one
    await asyncio.wait_for(short.event.wait(), 10)  # a hang guard, not a latency assertion
    assert len(deadlines) <= 2
    assert not any(sig.event.is_set() for sig in idle)


async def test_a_signal_woken_before_its_deadline_is_not_nudged_again_by_it() -> None:
    deadlines = _Deadlines()
    sig = _Signal()
    deadlines.add(sig, 0.001)
    sig.wake()  # a notice came first: its waiter moved on and waits again, longer
    later = sig.event
    deadlines.add(sig, 60.0)
    await asyncio.sleep(0.05)  # the first instant has passed
    assert sig.event is later and not later.is_set()
    assert len(deadlines) == 1
