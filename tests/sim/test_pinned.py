"""A small leases run's key outputs, pinned: speed work on the simulator (agents, store, broker,
router queue) must leave what it computes exactly as it was.

Re-pin only with a change that means to change results, and say in its commit why they moved
(on a mismatch pytest shows the whole dict: copy the new one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crossflow_ctl.sim.cluster import simulate
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.metrics import summarize
from crossflow_ctl.sim.traces import load_mooncake

PINNED: dict[str, Any] = {
    "completed": 400,
    "borrowed": 276,
    "overcommits": 0,
    "held": 194,
    "reoffers": 118,
    "leases": 985,
    "outcomes": {"borrowed": 183, "borrowed_late": 93, "not_held": 10, "prefill_room": 114},
    "admit_reasons": {"pool_load_missing": 10, "borrowed": 276, "no_benefit": 59, "no_room": 173},
    "zero_reasons": {"no_capacity": 6},
    "tokens": (5_710_530, 146_073),
    "lease_chunk_sum": 445_952,
    "lease_compute_sum": 54_970_864,
    "ttft_mean_ms": 10_589.082,
    "ttft_p99_ms": 33_609.103,
    "itl_p99_ms": 45.0,
}


async def test_a_mooncake_slice_at_8x_gives_the_pinned_run(mooncake_sample: Path) -> None:
    """400 Mooncake prompts at 8x on 2P4D: borrows, holds, late borrows and re-offers."""
    trace = load_mooncake(mooncake_sample, limit=400).scaled(8)
    rec = await simulate(
        trace, SimConfig(prefill_nodes=2, decode_nodes=4, policy=PolicyKind.LEASES)
    )
    s = summarize(rec)
    got = {
        "completed": rec.completed,
        "borrowed": rec.borrowed,
        "overcommits": rec.overcommits,
        "held": rec.held,
        "reoffers": rec.reoffers,
        "leases": rec.leases,
        "outcomes": rec.outcomes,
        "admit_reasons": rec.admit_reasons,
        "zero_reasons": rec.zero_reasons,
        "tokens": (rec.input_tokens, rec.output_tokens),
        "lease_chunk_sum": rec.lease_chunk_sum,
        "lease_compute_sum": rec.lease_credit_sums["compute_tokens"],
        "ttft_mean_ms": round(s.ttft_mean_ms, 3),
        "ttft_p99_ms": round(s.ttft_p99_ms, 3),
        "itl_p99_ms": round(s.itl_p99_ms, 3),
    }
    assert got == PINNED
