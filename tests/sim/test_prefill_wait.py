"""A simulated prefill server's agent reports its wait in time, context cost included.

A prompt with a huge cached prefix and a small uncached part holds a prefill server for far
longer than its uncached tokens say: the server's wait must count its prefix's cost, as the
pool's tokens over rate cannot (``PoolLoad.queue_wait_ms``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from crossflow_ctl.domain.admission import AdmissionRequest
from crossflow_ctl.domain.leasing import pool_load
from crossflow_ctl.sim.agents import PrefillAgent
from crossflow_ctl.sim.cluster import Simulation
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.servers import EventQueue, PrefillServer, Req, StepModel
from crossflow_ctl.sim.traces import load_mooncake

CFG = SimConfig(hardware="gb300")


def _req(rid: int, uncached: int, cached: int) -> Req:
    return Req(rid, uncached + cached, 10, cached, 0.0, measured=True)


def test_the_agent_reports_the_time_to_clear_the_running_and_queued_prompts() -> None:
    steps = StepModel(CFG.model_spec, CFG.node_profile)
    chunk = CFG.prefill_chunk_tokens
    server = PrefillServer(0, steps, chunk, EventQueue())
    agent = PrefillAgent(server, "p0", CFG.lease, 0.2, 600, CFG.kv_capacity_tokens)
    assert agent.snapshot(0.0, 0).prefill_queue_wait_ms == 0.0  # idle: a prompt starts at once
    jam = _req(0, 4_000, 600_000)  # small uncached part, huge cached prefix
    small = _req(1, 4_000, 0)
    server.enqueue(jam, 0.0)
    server.enqueue(small, 0.0)
    jam_s = steps.prefill_s(4_000, 600_000, chunk)
    small_s = steps.prefill_s(4_000, 0, chunk)
    assert jam_s > 5 * small_s  # the prefix is most of its cost
    t = jam_s / 2
    snap = agent.snapshot(t, 1)
    assert snap.prefill_queue_wait_ms == pytest.approx((jam_s - t + small_s) * 1000.0)
    load = pool_load(snap, now_ms=1, node_id="p0", pool="default", ttl_ms=600, settings=CFG.lease)
    assert load is not None and load.queue_wait_ms == snap.prefill_queue_wait_ms
    # tokens over the modelled rate see only the uncached 6,000 left: far less than the time
    tokens_ms = load.outstanding_uncached_tokens / agent.modelled_rate_tps * 1000.0
    assert tokens_ms < load.queue_wait_ms / 3
    server.finish(jam_s)
    assert agent.snapshot(jam_s, 2).prefill_queue_wait_ms == pytest.approx(small_s * 1000.0)
    server.finish(jam_s + small_s)
    assert agent.snapshot(jam_s + small_s, 3).prefill_queue_wait_ms == 0.0


async def test_each_offer_names_the_prefill_server_the_prompt_would_go_to_now(
    mooncake_sample: Path,
) -> None:
    """The simulated router names, on every Admit (a re-offer too), the server a NORMAL answer
    would send the prompt to at that moment: the least-loaded one with a cluster-wide cache."""
    trace = load_mooncake(mooncake_sample, limit=5)
    sim = Simulation(trace, CFG.model_copy(update={"policy": PolicyKind.LEASES}))
    control = sim.control
    assert control is not None
    await control.start()
    sim.prefill[0].enqueue(_req(0, 4_000, 0), 0.0)
    for agent in control.prefill_agents:
        await agent.tick(control.broker, 0.0, control.sync(0.0))
    waits = []
    for request_id in ("7", "7#2"):  # an offer, and a re-offer of the same prompt
        request = AdmissionRequest(request_id=request_id, uncached_prompt_tokens=1_000)
        answer = await control.admit(request)
        assert answer.plan is not None and answer.plan.demand.prefill_node_id == "prefill-1"
        assert answer.plan.demand.timed
        waits.append(answer.plan.demand.pool_wait_ms)
    assert waits[0] == 0.0  # prefill-1 is idle (the second counts the first as sent there)
