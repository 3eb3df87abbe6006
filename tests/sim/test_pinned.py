"""A small leases run's key outputs, pinned: speed work on the simulator (agents, store, broker,
router queue) must leave what it computes exactly as it was.

Re-pin only with a change that means to change results, and say in its commit why they moved.
"""

from __future__ import annotations

from pathlib import Path

from crossflow_ctl.sim.cluster import simulate
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.metrics import summarize
from crossflow_ctl.sim.traces import load_mooncake


async def test_a_mooncake_slice_at_8x_gives_the_pinned_run(traces_dir: Path) -> None:
    """400 Mooncake prompts at 8x on 2P4D: borrows, holds, late borrows and re-offers."""
    trace = load_mooncake(traces_dir / "mooncake_conversation_trace.jsonl", limit=400).scaled(8)
    rec = await simulate(
        trace, SimConfig(prefill_nodes=2, decode_nodes=4, policy=PolicyKind.LEASES)
    )
    s = summarize(rec)
    assert (rec.completed, rec.borrowed, rec.overcommits) == (400, 223, 0)
    assert (rec.held, rec.reoffers, rec.leases) == (235, 131, 1617)
    assert rec.outcomes == {
        "borrowed": 151,
        "borrowed_late": 72,
        "not_held": 10,
        "prefill_room": 167,
    }
    assert rec.admit_reasons == {
        "pool_load_missing": 10,
        "borrowed": 223,
        "no_benefit": 17,
        "no_room": 281,
    }
    assert rec.zero_reasons == {"itl_over_slo": 9}
    assert (rec.input_tokens, rec.output_tokens) == (5_710_530, 146_073)
    assert rec.lease_chunk_sum == 1_286_912
    assert rec.lease_credit_sums["compute_tokens"] == 39_156_289
    assert round(s.ttft_mean_ms, 3) == 10_519.617
    assert round(s.ttft_p99_ms, 3) == 41_354.971
    assert round(s.itl_p99_ms, 3) == 45.8
