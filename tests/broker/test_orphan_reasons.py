"""Grants no caller hears of are released with the reason they were orphaned, as it happened:
the Admit timed out, its caller went away, another debit round of its batch failed, or another
debit of its own round did. (Every one used to be logged as "admission timed out".)"""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping, Sequence
from typing import Any

import pytest
from redis.asyncio import Redis
from structlog.testing import capture_logs

from crossflow_ctl.domain.admission import AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.errors import StoreUnavailable
from crossflow_ctl.domain.models import ReservationState
from crossflow_ctl.service.broker import Broker
from crossflow_ctl.store.base import DebitOutcome
from crossflow_ctl.store.memory import MemoryStore
from tests.broker.conftest import TEST_POLICY, lending_broker
from tests.conftest import patient_redis_store

POLICY = TEST_POLICY.updated({"admit_timeout_ms": 10_000, "hold_ttl_ms": 600_000})
"""A deadline no test here meets by accident on a loaded machine (100 ms once turned a failed
round into a TIMEOUT, with its other reason); the timeout test sets its own."""
PATIENCE_S = 30.0
"""How long a release may take to show: a hang guard, never a latency bound."""


async def _released(
    broker: Broker, logs: Sequence[MutableMapping[str, Any]], node_id: str = ""
) -> list[str]:
    """The reasons logged for orphan releases, once the one reservation (on ``node_id``, when
    given) is no longer HELD and the background release that changed it has finished.

    The release logs its reason after the store answers it, so a reservation already RELEASED
    in Redis does not mean the log is written: on a loaded machine the test read the logs in
    between (``[] == [...]``). ``Broker.drain`` waits for the releases in flight."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PATIENCE_S
    while True:  # the release starts in the background, after the answers
        listed = await broker.list_reservations(node_id)
        if listed and all(r.state is not ReservationState.HELD for r in listed):
            break
        if loop.time() > deadline:
            break
        await asyncio.sleep(0.01)
    await broker.drain(PATIENCE_S)
    assert [r.state for r in listed] == [ReservationState.RELEASED]
    return [e["why"] for e in logs if e["event"] == "admit.orphan_released"]


async def test_a_grant_whose_caller_left_is_released_as_such() -> None:
    store = MemoryStore(seed=1)
    broker = await lending_broker(store, POLICY)
    with capture_logs() as logs:
        async with store._lock:  # a concurrent store call holds it: the debit waits
            admit = asyncio.ensure_future(broker.admit(AdmissionRequest(uncached_prompt_tokens=9)))
            for _ in range(10):
                await asyncio.sleep(0)
            admit.cancel()  # long before its deadline
            with pytest.raises(asyncio.CancelledError):
                await admit
        assert await _released(broker, logs) == ["the caller stopped waiting"]


async def test_a_grant_whose_admit_timed_out_is_released_as_such() -> None:
    store = MemoryStore(seed=1)
    broker = await lending_broker(store, POLICY.updated({"admit_timeout_ms": 100}))
    with capture_logs() as logs:
        async with store._lock:
            answer = await broker.admit(AdmissionRequest(uncached_prompt_tokens=9))
        assert (answer.decision, answer.reason) == (Decision.NORMAL, Reason.TIMEOUT)
        assert await _released(broker, logs) == ["admission timed out"]


async def test_a_grant_whose_later_round_failed_is_released_as_such() -> None:
    """Two Admits in one batch race for d1's one slot: round 1 grants one, the other's round 2
    (d2) fails, so the batch answers NORMAL (STORE_UNAVAILABLE) to both."""
    store = MemoryStore(seed=1)
    broker = await lending_broker(store, POLICY, decode=("d1", "d2"), slots=1)
    rounds = 0
    debits_settled = store.try_debits_settled

    async def second_round_fails(*args: Any, **kwargs: Any) -> list[DebitOutcome]:
        nonlocal rounds
        rounds += 1
        if rounds == 2:
            raise StoreUnavailable("d2 is down")
        return await debits_settled(*args, **kwargs)

    store.try_debits_settled = second_round_fails  # type: ignore[method-assign]
    first = AdmissionRequest(uncached_prompt_tokens=100, candidate_node_ids=("d1",))
    second = AdmissionRequest(uncached_prompt_tokens=100, candidate_node_ids=("d1", "d2"))
    with capture_logs() as logs:
        answers = await broker.admit_many([first, second])
        assert [a.reason for a in answers] == [Reason.STORE_UNAVAILABLE] * 2
        assert await _released(broker, logs) == ["a later debit round failed: d2 is down"]


async def test_redis_a_grant_whose_round_failed_on_another_node_is_released_as_such(
    redis_url: str, redis_namespace: str
) -> None:
    """One debit round on two nodes: d2's script fails (its reservations key of the wrong
    type), d1's grants, and no caller gets it."""
    store = patient_redis_store(redis_url, redis_namespace)
    raw = Redis.from_url(redis_url)
    try:
        broker = await lending_broker(store, POLICY, decode=("d1", "d2"), slots=5)
        key = store._k.node("d2").reservations
        await raw.delete(key)
        await raw.set(key, "not a hash")
        one = AdmissionRequest(uncached_prompt_tokens=100, candidate_node_ids=("d1",))
        two = AdmissionRequest(uncached_prompt_tokens=100, candidate_node_ids=("d2",))
        with capture_logs() as logs:
            answers = await broker.admit_many([one, two])
            assert [a.reason for a in answers] == [Reason.STORE_UNAVAILABLE] * 2
            assert await _released(broker, logs, "d1") == ["another debit of its round failed"]
    finally:
        await raw.delete(store._k.node("d2").reservations)
        await raw.aclose()
        await store.close()
