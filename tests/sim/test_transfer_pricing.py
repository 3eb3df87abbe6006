"""The simulated broker prices KV transfers with the simulated cluster's own figures.

The policy's ``kv_bytes_per_token`` and ``kv_transfer_bytes_per_s`` default to GPT-OSS-120B over
25 GB/s; a simulated GB300 moves KV at 100 GB/s and GLM-4.5 stores 3x the bytes per token. The
broker's Benefit (normal path: the whole prompt's KV to decode; borrowed: the remote prefix to the
node) and its kv_transfer debit must use what the simulated servers use, or every prediction the
policy compares is off by the ratio."""

from __future__ import annotations

import pytest

from crossflow_ctl.domain.admission import (
    AdmissionRequest,
    DemandCheck,
    debit_for,
    estimate_normal_path,
)
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS
from crossflow_ctl.sim.cluster import Simulation
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.traces import Trace, TraceRequest

PROMPT = AdmissionRequest(
    uncached_prompt_tokens=3_000, cached_prefix_tokens=120_000, expected_output_tokens=400
)


@pytest.mark.parametrize("model", sorted(MODEL_PRESETS))
@pytest.mark.parametrize("hardware", sorted(NODE_PRESETS))
def test_predicted_transfers_are_the_simulated_ones(model: str, hardware: str) -> None:
    cfg = SimConfig(model=model, hardware=hardware, policy=PolicyKind.LEASES)
    trace = Trace(name="one", requests=(TraceRequest(123_000, 400, arrival_s=0.0),))
    sim = Simulation(trace, cfg)
    assert sim.control is not None
    policy = sim.control.broker.policy
    demand = DemandCheck(holds=True, pool_wait_ms=0.0, threshold_ms=0.0)

    normal = estimate_normal_path(PROMPT, demand, None, policy)
    whole_prompt = PROMPT.uncached_prompt_tokens + PROMPT.cached_prefix_tokens
    assert normal.kv_transfer_ms == pytest.approx(sim.steps.transfer_s(whole_prompt) * 1000.0)

    debit = debit_for(PROMPT, "decode-0", policy).credits
    per_token = sim.steps.model.kv_bytes_per_token
    assert debit.kv_transfer_bytes == PROMPT.cached_prefix_tokens * per_token
    borrowed_transfer_s = debit.kv_transfer_bytes / policy.kv_transfer_bytes_per_s
    assert borrowed_transfer_s == pytest.approx(sim.steps.transfer_s(PROMPT.cached_prefix_tokens))


def test_the_configured_policy_is_kept_apart_from_the_cluster_figures() -> None:
    """Only the two transfer figures follow the cluster; the rest is the configured policy."""
    base = SimConfig(hardware="gb300", policy=PolicyKind.LEASES)
    cfg = base.model_copy(
        update={"broker_policy": base.broker_policy.model_copy(update={"borrow_share": 0.3})}
    )
    sim = Simulation(Trace(name="none", requests=()), cfg)
    assert sim.control is not None
    policy = sim.control.broker.policy
    assert policy.borrow_share == 0.3
    assert policy.kv_transfer_bytes_per_s == NODE_PRESETS["gb300"].network_bytes_per_s
