"""Commit and Release over the in-process service Broker: one admin deadline and one store
timing per call, whether or not a request id makes the call exactly-once."""

from __future__ import annotations

import pytest

from crossflow_ctl.domain.admission import AdmissionRequest
from crossflow_ctl.domain.clock import ManualClock
from crossflow_ctl.domain.models import NodeRole, PoolLoad
from crossflow_ctl.service.broker import Broker
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.memory import MemoryStore
from tests.client.test_queue_in_process import POLICY, lease


async def test_commit_and_release_time_their_store_work_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One admin deadline and one ``admin`` timing per call, with or without a request id."""
    clock = ManualClock(1_700_000_000_000)
    broker = Broker(MemoryStore(seed=1), clock, BrokerSettings(policy=POLICY))
    timed: list[str] = []
    monkeypatch.setattr(
        broker.metrics, "record_store_operation", lambda op, s, ok=True: timed.append(op)
    )
    await broker.register("d1", NodeRole.DECODE, "default", {})
    await broker.register("p1", NodeRole.PREFILL, "default", {})
    load = PoolLoad(
        node_id="p1", outstanding_uncached_tokens=200_000, processing_rate_tps=20_000, ttl_ms=9_000
    )
    await broker.ingest_pool_load(load)
    await broker.ingest_lease(lease(1, compute=4_000))
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
