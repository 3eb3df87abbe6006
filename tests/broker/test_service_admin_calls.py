"""Commit and Release over the in-process service Broker: one admin deadline and one store
timing per call, whether or not a request id makes the call exactly-once."""

from __future__ import annotations

import pytest

from crossflow_ctl.domain.admission import AdmissionRequest
from crossflow_ctl.domain.clock import ManualClock
from tests.client.test_queue_in_process import lending_broker


async def test_commit_and_release_time_their_store_work_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One admin deadline and one ``admin`` timing per call, with or without a request id."""
    broker = await lending_broker(ManualClock(1_700_000_000_000), compute=4_000)
    timed: list[str] = []
    monkeypatch.setattr(
        broker.metrics, "record_store_operation", lambda op, s, ok=True: timed.append(op)
    )
    granted = []
    for rid in ("a", "b"):
        got = await broker.admit(AdmissionRequest(request_id=rid, uncached_prompt_tokens=1_000))
        assert got.reservation_id
        granted.append(got.reservation_id)
    timed.clear()
    await broker.commit(granted[0])
    await broker.commit(granted[1], request_id="c1")
    await broker.release(granted[0])
    await broker.release(granted[1], request_id="r1")
    assert timed == ["admin"] * 4
