"""An Admit on the in-process store, as the simulator makes them: one caller, one at a time;
and a gRPC unary Admit, which waits no turn for others either.

A ``sequential`` broker decides a lone Admit at once, without the event-loop turn a lone Admit
otherwise waits for concurrent ones to join its group commit, and the in-process store lands a
debit without a task of its own when its lock is free (a debit that waits for the lock still
hands its outcome to ``late`` should its caller stop waiting)."""

from __future__ import annotations

import asyncio
from typing import Any

from crossflow_ctl.api.v1 import admission_pb2
from crossflow_ctl.broker.servicers.admission import AdmissionServicer
from crossflow_ctl.domain.admission import AdmissionRequest, Decision
from crossflow_ctl.domain.models import Credits
from crossflow_ctl.store.base import DebitOutcome, DebitRequest
from crossflow_ctl.store.memory import MemoryStore
from tests.broker.conftest import TEST_POLICY, lending_broker

NOW = 1_700_000_000_000


def _ask() -> AdmissionRequest:
    return AdmissionRequest(uncached_prompt_tokens=100)


def _counting_tasks(loop: asyncio.AbstractEventLoop, started: list[str]) -> Any:
    default = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        started.append(getattr(coro, "__qualname__", repr(coro)))
        if default is not None:
            return default(loop, coro, **kwargs)
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(counting)
    return default


async def _admit_watched(sequential: bool) -> tuple[Decision, list[int], list[str]]:
    """An Admit's decision, whether a callback scheduled before it ran during it, and the tasks
    it started."""
    broker = await lending_broker(MemoryStore(seed=1), TEST_POLICY, sequential=sequential)
    await broker.admit(_ask())  # warm (the policy read from the store)
    loop = asyncio.get_running_loop()
    ran: list[int] = []
    started: list[str] = []
    default = _counting_tasks(loop, started)
    try:
        loop.call_soon(ran.append, 1)
        answer = await broker.admit(_ask())
    finally:
        loop.set_task_factory(default)
    return answer.decision, list(ran), started


async def test_a_sequential_broker_decides_a_lone_admit_without_a_loop_turn_or_a_task() -> None:
    decision, ran, started = await _admit_watched(sequential=True)
    assert decision is Decision.BORROW
    assert ran == []  # nothing else ran while it was decided
    assert started == []  # no task for the debit either


async def test_a_default_broker_still_waits_one_turn_for_others_to_join() -> None:
    decision, ran, _ = await _admit_watched(sequential=False)
    assert decision is Decision.BORROW
    assert ran == [1]


async def test_a_lone_unary_grpc_admit_is_decided_without_a_loop_turn() -> None:
    """The servicer's Admit (the gRPC unary call) waits no turn for others to join it: another
    RPC's handler rarely starts in the same turn (grpc.aio starts each from its own completion
    event)."""
    broker = await lending_broker(MemoryStore(seed=1), TEST_POLICY)
    servicer = AdmissionServicer(broker)
    request = admission_pb2.AdmitRequest(uncached_prompt_tokens=100)
    await servicer.Admit(request, None)  # warm; no error to abort
    ran: list[int] = []
    asyncio.get_running_loop().call_soon(ran.append, 1)
    reply = await servicer.Admit(request, None)
    assert reply.decision == admission_pb2.DECISION_BORROW
    assert ran == []  # nothing else ran while it was decided: no loop turn


async def test_a_debit_waiting_for_the_memory_store_lock_still_hands_over_when_abandoned() -> None:
    store = MemoryStore(seed=1)
    broker = await lending_broker(store, TEST_POLICY)
    late: list[list[DebitOutcome]] = []
    debit = DebitRequest("d1", Credits(compute_tokens=10, slots=1), "r1", "", None, 0, 0)
    async with store._lock:  # a concurrent store call holds it: the debit must wait
        waiting = asyncio.ensure_future(
            store.try_debits_settled([debit], 1.0, NOW, 10_000, late.append)
        )
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.sleep(0)
        assert waiting.cancelled()
    for _ in range(100):  # the debit task takes the lock, then hands its outcome over
        if late:
            break
        await asyncio.sleep(0)
    assert len(late) == 1 and late[0][0].granted  # the debit landed, and late was told
    assert [r.request_id for r in await broker.list_reservations()] == ["r1"]


async def test_an_admit_arriving_while_a_sequential_one_waits_on_the_store_is_answered() -> None:
    """Sequential is the caller's promise, not enforced: an Admit that comes while a lone one
    waits for the store (its lock held here) queues, and is decided once that one is done."""
    store = MemoryStore(seed=1)
    broker = await lending_broker(store, TEST_POLICY, sequential=True)
    await broker.admit(_ask())  # warm (the policy read from the store)
    async with store._lock:
        first = asyncio.ensure_future(broker.admit(_ask()))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(broker.admit(_ask()))
        await asyncio.sleep(0)
        assert not first.done() and not second.done()
    answers = await asyncio.wait_for(asyncio.gather(first, second), timeout=5.0)
    assert [a.decision for a in answers] == [Decision.BORROW, Decision.BORROW]
    assert len({a.reservation_id for a in answers}) == 2
