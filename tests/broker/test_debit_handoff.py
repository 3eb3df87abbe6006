"""The Admitter's debit hand-off (``Admitter._shielded``): the debit runs in a task of its own,
its outcome or error reaches the waiting Admit, and an Admit that stops waiting (timeout or
cancel) leaves the debit to finish and hands it to ``abandoned`` (which releases what lands)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from crossflow_ctl.domain.errors import StoreUnavailable
from crossflow_ctl.observability import BrokerMetrics
from crossflow_ctl.service.admission import Admitter


def _admitter(abandoned: list[asyncio.Future[Any]]) -> Admitter:
    return Admitter(
        store=None,  # type: ignore[arg-type]  # the hand-off never reaches the store
        clock=None,  # type: ignore[arg-type]
        metrics=BrokerMetrics.noop(),
        policy=lambda: None,  # type: ignore[arg-type,return-value]
        abandoned=abandoned.append,
    )


async def _debit(gate: asyncio.Event, outcome: Any = "granted") -> Any:
    await gate.wait()
    if isinstance(outcome, BaseException):
        raise outcome
    return [outcome]


async def test_the_outcome_reaches_the_waiting_admit() -> None:
    abandoned: list[asyncio.Future[Any]] = []
    gate = asyncio.Event()
    gate.set()
    assert await _admitter(abandoned)._shielded(_debit(gate)) == ["granted"]
    assert abandoned == []


async def test_a_debit_error_reaches_the_admit_and_is_never_reported_unretrieved() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        gate = asyncio.Event()
        gate.set()
        with pytest.raises(StoreUnavailable):
            await _admitter([])._shielded(_debit(gate, StoreUnavailable("down")))
        await asyncio.sleep(0)
        gc.collect()  # an unretrieved task exception is reported when the task is collected
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert reported == []


async def test_an_admit_that_stops_waiting_leaves_the_debit_to_land_and_hands_it_over() -> None:
    abandoned: list[asyncio.Future[Any]] = []
    gate = asyncio.Event()
    admit = asyncio.ensure_future(_admitter(abandoned)._shielded(_debit(gate)))
    await asyncio.sleep(0.01)
    admit.cancel()
    with pytest.raises(asyncio.CancelledError):
        await admit
    assert len(abandoned) == 0  # handed over once the debit is done, as a done callback
    gate.set()  # the debit lands after its Admit went away
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(abandoned) == 1
    assert abandoned[0].result() == ["granted"]
