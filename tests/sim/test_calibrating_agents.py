"""Simulated agents that calibrate online: from the wrong hardware preset, fed their servers' own
step counters, they move toward the servers' true step model and lend as agents given the truth
do. Off by default; calibrating agents never sleep, so fast-forward changes no result."""

from __future__ import annotations

import dataclasses
import math
import statistics

from crossflow_ctl.domain.capacity import NODE_PRESETS, roofline
from crossflow_ctl.domain.online_calibration import CalibrationSettings
from crossflow_ctl.domain.step_fit import FitStatus
from crossflow_ctl.sim.agents import STORED_LEASE_FIGURES
from crossflow_ctl.sim.cluster import Simulation
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.metrics import RunRecord, summarize
from crossflow_ctl.sim.synthetic import AgenticSpec, generate_agentic

TRUTH = NODE_PRESETS["h200"]
LEASES = SimConfig(policy=PolicyKind.LEASES, hardware="h200")
ON = CalibrationSettings(enabled=True)
TRACE = generate_agentic(AgenticSpec(duration_s=400.0), seed=1).scaled(8.0)


def test_calibration_is_off_unless_asked_for() -> None:
    assert not SimConfig().agent_calibration.enabled
    sim = Simulation(TRACE, LEASES)
    assert all(agent.calibrator is None for agent in sim.decode_agents)
    assert all(agent.node is TRUTH for agent in sim.decode_agents)


async def test_a_servers_step_totals_are_its_own_steps() -> None:
    sim = Simulation(TRACE, LEASES)
    await sim.run()
    for server in sim.decode:
        totals = server.step_totals(sim.now)
        assert totals.steps == server.steps_done > 0
        assert totals.step_token_buckets[-1][1] == server.steps_done  # every step bucketed
        assert totals.decode_tokens == totals.itl_count == server.tokens_out
        assert totals.step_tokens_sum == server.tokens_out + server.prefill_tokens
        assert totals.itl_sum_s > 0


async def test_agents_from_a_slower_preset_calibrate_and_lend_again() -> None:
    """The h100 preset prices the h200 servers' steps slower than they are: its agents lend
    next to nothing. Calibrating from it, they move toward the h200's HBM rate and lend about
    as much as agents given the truth."""
    truth = summarize(await Simulation(TRACE, LEASES).run())
    wrong_cfg = LEASES.model_copy(update={"agent_hardware": "h100"})
    wrong = summarize(await Simulation(TRACE, wrong_cfg).run())
    sim = Simulation(TRACE, wrong_cfg.model_copy(update={"agent_calibration": ON}))
    calibrated = summarize(await sim.run())
    prior = NODE_PRESETS["h100"]
    model = LEASES.model_spec
    shape = (16, 16 * 8000, 0)  # a decode step of 16 requests of 8K context: memory-bound
    misses = []
    for agent in sim.decode_agents:
        cal = agent.calibrator
        assert cal is not None and agent.node is cal.profile
        state = cal.state()
        assert state.periods >= 10  # counted periods, not time
        assert state.fit is not None and state.fit.status is FitStatus.FITTED
        assert state.fit.error < state.fit.prior_error
        true_s = roofline(model, TRUTH).step_s(*shape)
        assert abs(roofline(model, agent.node).step_s(*shape) - true_s) < abs(
            roofline(model, prior).step_s(*shape) - true_s
        )
        misses.append(abs(math.log(agent.node.hbm_bytes_per_s / TRUTH.hbm_bytes_per_s)))
    # the HBM rate shows only in the steps it bounds (most are host-bound on these servers):
    # the typical agent has it closer than the preset, not necessarily every one
    assert statistics.median(misses) < abs(math.log(prior.hbm_bytes_per_s / TRUTH.hbm_bytes_per_s))
    assert wrong.borrowed_share < 0.5 * truth.borrowed_share
    assert calibrated.borrowed_share > 0.6 * truth.borrowed_share
    assert calibrated.ttft_mean_ms < wrong.ttft_mean_ms


def _fields(rec: RunRecord) -> dict[str, object]:
    """Every figure of a run but its wall time and its count of events (the prefill agents
    still sleep with fast-forward, so fewer events run)."""
    skip = ("wall_s", "sim_events", *STORED_LEASE_FIGURES)
    return {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec) if f.name not in skip}


async def test_fast_forward_changes_no_result_for_calibrating_agents() -> None:
    trace = generate_agentic(AgenticSpec(duration_s=120.0), seed=2).scaled(8.0)
    cfg = LEASES.model_copy(update={"agent_hardware": "gb300", "agent_calibration": ON})
    eager = await Simulation(trace, cfg.model_copy(update={"fast_forward_agents": False})).run()
    fast = await Simulation(trace, cfg).run()
    assert _fields(fast) == _fields(eager)
