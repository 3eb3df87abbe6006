"""Late binding in the simulator (the client's AdmissionQueue over the in-process broker), and
agents that sleep over a fixed point without changing any result."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from crossflow_ctl.client.holding import QueueConfig
from crossflow_ctl.client.queue import Outcome
from crossflow_ctl.sim.agents import Period
from crossflow_ctl.sim.cluster import Simulation, simulate
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.servers import Req
from crossflow_ctl.sim.traces import Trace, TraceRequest
from crossflow_ctl.store.memory import MemoryStore

LEASES = SimConfig(prefill_nodes=1, decode_nodes=2, policy=PolicyKind.LEASES)


def _bursts(bursts: int, per_burst: int, gap_s: float) -> Trace:
    """Bursts of 12k-token prompts 20 ms apart, ``gap_s`` apart: busy, then idle."""
    reqs = tuple(
        TraceRequest(12_000, 200, arrival_s=b * gap_s + i * 0.02, cached_tokens=0)
        for b in range(bursts)
        for i in range(per_burst)
    )
    return Trace(name="bursts", requests=reqs)


@pytest.mark.parametrize("late_binding", [False, True])
async def test_sleeping_agents_change_no_result(late_binding: bool) -> None:
    """Idle gaps of 60 s: agents sleep through most periods, and the run is the same as one
    that ticks every period (but the lease figures, counted over the leases stored)."""
    trace = _bursts(4, 20, 60.0)
    runs = []
    for fast in (False, True):
        cfg = LEASES.model_copy(update={"fast_forward_agents": fast, "late_binding": late_binding})
        runs.append(await simulate(trace, cfg))
    every, fast = runs
    assert fast.sim_events < every.sim_events / 2
    assert fast.ttft_s == every.ttft_s
    assert fast.borrowed == every.borrowed > 0
    assert 0 < fast.leases < every.leases
    assert fast.admit_reasons == every.admit_reasons
    assert fast.outcomes == every.outcomes
    assert fast.overcommits == every.overcommits == 0


async def test_held_prompts_are_borrowed_when_room_appears() -> None:
    """A burst on a busy prefill pool: prompts that found no room are held and some borrow on
    a re-offer (room from a new lease or a release); offering once holds nothing."""
    trace = _bursts(1, 60, 1.0)
    once = await simulate(trace, LEASES.model_copy(update={"late_binding": False}))
    late = await simulate(trace, LEASES)
    assert once.held == 0 and once.reoffers == 0
    assert "borrowed_late" not in once.outcomes
    assert late.held > 0 and late.reoffers > 0
    assert late.outcomes.get("borrowed_late", 0) > 0
    assert late.borrowed == late.outcomes.get("borrowed", 0) + late.outcomes["borrowed_late"]
    assert late.completed == once.completed == 60
    assert late.overcommits == 0


async def test_held_prompts_go_to_prefill_by_deadline_or_prefill_room() -> None:
    """Every held prompt gets one outcome: borrowed late, or sent to prefill when its deadline
    passed or prefill had room; none is lost and none waits past its deadline for a borrow."""
    cfg = LEASES.model_copy(update={"queue": QueueConfig(max_hold_ms=100)})
    sim = Simulation(_bursts(1, 60, 1.0), cfg)
    rec = await sim.run()
    assert rec.completed == 60
    assert sum(rec.outcomes.values()) == 60  # one outcome each
    held = {k: v for k, v in rec.outcomes.items() if k not in ("borrowed", "not_held")}
    assert sum(held.values()) >= rec.held > 0  # prefill_room also counts prompts never held
    assert held.get("deadline", 0) + held.get("prefill_room", 0) > 0
    assert sim.control is not None and sim.control.queue.held == 0


async def test_a_full_queue_sends_prompts_to_prefill_at_once() -> None:
    cfg = LEASES.model_copy(update={"queue": QueueConfig(max_held=1)})
    rec = await simulate(_bursts(1, 60, 1.0), cfg)
    assert rec.outcomes.get("overflow", 0) > 0
    assert rec.completed == 60


def test_period_schedule_skips_to_the_same_times_it_ticks() -> None:
    ticking, sleeping = Period(0.2, 0.05), Period(0.2, 0.05)
    times = []
    while ticking.next_s <= 1234.5:
        times.append(ticking.next_s)
        ticking.advance()
    n, last = sleeping.skip_to(1234.5)
    assert (n, last) == (len(times), times[-1])
    assert sleeping.next_s == ticking.next_s
    assert sleeping.skip_to(sleeping.next_s - 1e-9) == (0, 0.0)


async def test_prefill_room_is_judged_with_the_prompts_already_sent_in_the_same_pass() -> None:
    """Held prompts go to prefill one by one while the pool's wait, counting those already sent
    in the same pass, is within ``prefill_room_ms``. Before, the whole held queue went at once
    whenever the pool's wait dipped under it (the pass read the pool before any of them landed),
    so prompts queued at prefill for minutes where no lease could reach them."""
    cfg = LEASES.model_copy(update={"prefill_room_ms": 300.0})
    sim = Simulation(_bursts(1, 60, 1.0), cfg)
    control = sim.control
    assert control is not None
    causes: dict[str, str] = {}
    decided = control.queue.on_outcome

    def record(outcome: Outcome) -> None:
        causes[outcome.request.request_id] = outcome.dispatch.value
        if decided is not None:
            decided(outcome)

    control.queue.on_outcome = record
    waits: list[float] = []
    dispatch = control.dispatch

    async def spy(req: Req, node: int | None, t: float) -> None:
        if node is None and causes.get(str(req.rid)) == "prefill_room":
            waits.append(sim._pool_wait_s(t))  # before this prompt joins the pool
        await dispatch(req, node, t)

    control.dispatch = spy
    rec = await sim.run()
    assert rec.completed == 60 and rec.outcomes.get("prefill_room", 0) > 1
    assert len(waits) == rec.outcomes["prefill_room"]
    assert max(waits) * 1000.0 <= cfg.prefill_room_ms


class _StallingStore(MemoryStore):
    """A store whose admission reads stall 80 ms of the host's clock (a busy host): simulated
    time does not pass meanwhile."""

    async def admission_view(self, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.08)
        return await super().admission_view(*args, **kwargs)


async def test_a_slow_host_changes_no_admission() -> None:
    """The broker's store deadlines are on the host's clock; in a simulation they only fire
    when the host is slow, and a TIMEOUT sends every held prompt to prefill. The simulated
    broker waits for the store, so a stalling host gives the same run as a quick one."""
    trace = _bursts(1, 20, 1.0)
    quick = await simulate(trace, LEASES)
    stalled = await simulate(trace, LEASES, store=_StallingStore(seed=LEASES.seed))
    assert "timeout" not in stalled.admit_reasons
    assert stalled.admit_reasons == quick.admit_reasons
    assert stalled.outcomes == quick.outcomes


async def test_under_overload_held_prompts_wait_for_room_not_for_a_deadline() -> None:
    """A minute and a half of prompts faster than prefill and borrowing together serve. A held
    prompt sent to prefill at its deadline starts there no sooner than one still held, but can
    no longer borrow: with a 20 s deadline prompts pile up at prefill and fewer borrow; with
    the default (a safety net) every prompt goes to prefill only when prefill has room."""
    trace = Trace(
        name="overload",
        requests=tuple(
            TraceRequest(6_000, 50, arrival_s=i * 0.04, cached_tokens=0) for i in range(2000)
        ),
    )
    deadline = LEASES.queue.model_copy(update={"max_hold_ms": 20_000})
    short = await simulate(trace, LEASES.model_copy(update={"queue": deadline}))
    default = await simulate(trace, LEASES)
    assert short.outcomes.get("deadline", 0) > 0
    assert "deadline" not in default.outcomes
    assert default.borrowed > short.borrowed
    assert default.completed == short.completed == 2000
    assert default.overcommits == short.overcommits == 0
