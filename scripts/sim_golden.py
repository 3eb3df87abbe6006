"""Write (or check) the simulator's golden runs: every decision and summary figure of short runs.

Speed work on the simulator's hot loop (agents, broker, store, router queue, numeric kernels)
must leave what a run computes exactly as it was. This script runs the committed short traces
(tests/data/traces) under every policy at 1x, 4x and 16x and records, per run, a digest of every
request's decisions (path, node, dispatch, prefill start and end, arrival, first token, finish)
and the run's summary figures and counters. ``tests/sim/test_golden.py`` runs the same and
compares. Usage: ``python scripts/sim_golden.py [--check]``; writes
``tests/data/sim_golden.json`` (re-generate it only with a change that means to move results,
and say why in its commit).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import structlog

from crossflow_ctl.sim.cluster import Simulation
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.metrics import summarize
from crossflow_ctl.sim.traces import load_trace

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "tests" / "data" / "traces"
GOLDEN = ROOT / "tests" / "data" / "sim_golden.json"

RUNS: tuple[tuple[str, int | None], ...] = (
    ("mooncake_conversation_trace_head600.jsonl", None),
    ("agent_sessions_sample_head483.jsonl", None),
    ("AzureLLMInferenceTrace_conv_head100.csv", None),
)
"""Trace files and how many requests of each to run."""
LOADS = (1.0, 4.0, 16.0)
POLICIES = (PolicyKind.STATIC, PolicyKind.THRESHOLD, PolicyKind.LEASES)


def _f(x: float) -> float | None:
    """A float as JSON holds it exactly (None for NaN)."""
    return None if math.isnan(x) else x


async def one_run(trace_file: str, limit: int | None, load: float, policy: PolicyKind) -> Any:
    trace = load_trace(TRACES / trace_file, limit=limit).scaled(load)
    sim = Simulation(trace, SimConfig(prefill_nodes=2, decode_nodes=4, policy=policy))
    rec = await sim.run()
    digest = hashlib.sha256()
    for rid in sorted(sim.reqs):
        r = sim.reqs[rid]
        row = (
            rid,
            r.cached_tokens,
            r.borrowed,
            r.node_id,
            r.dispatch_s,
            r.start_s,
            r.prefilled_s,
            r.arrive_s,
            r.first_token_s,
            r.finish_s,
        )
        digest.update(repr(row).encode())
    s = summarize(rec)
    return {
        "decisions_sha256": digest.hexdigest(),
        "requests": len(sim.reqs),
        "events": rec.sim_events,
        "completed": rec.completed,
        "borrowed": rec.borrowed,
        "dropped": rec.dropped,
        "overcommits": rec.overcommits,
        "held": rec.held,
        "reoffers": rec.reoffers,
        "leases": rec.leases,
        "outcomes": rec.outcomes,
        "admit_reasons": rec.admit_reasons,
        "zero_reasons": rec.zero_reasons,
        "short_credits": rec.short_credits,
        "lease_chunk_sum": rec.lease_chunk_sum,
        "lease_credit_sums": {k: _f(v) for k, v in sorted(rec.lease_credit_sums.items())},
        "release_failures": rec.release_failures,
        "borrow_kv_waits": rec.borrow_kv_waits,
        "tokens": [rec.input_tokens, rec.output_tokens],
        "steady_tokens": [rec.steady_input_tokens, rec.steady_output_tokens],
        "ttft_mean_ms": _f(s.ttft_mean_ms),
        "ttft_p50_ms": _f(s.ttft_p50_ms),
        "ttft_p99_ms": _f(s.ttft_p99_ms),
        "itl_mean_ms": _f(s.itl_mean_ms),
        "itl_p99_ms": _f(s.itl_p99_ms),
        "slo_attainment": _f(s.slo_attainment),
        "busy_s": _f(rec.busy_s),
    }


def key(trace_file: str, load: float, policy: PolicyKind) -> str:
    return f"{trace_file} {load:g}x {policy.value}"


async def all_runs() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for trace_file, limit in RUNS:
        for load in LOADS:
            for policy in POLICIES:
                out[key(trace_file, load, policy)] = await one_run(trace_file, limit, load, policy)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="compare with the file, write nothing")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    got = asyncio.run(all_runs())
    if args.check:
        want = json.loads(GOLDEN.read_text())
        bad = [k for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
        for k in bad:
            was, now = want.get(k) or {}, got.get(k) or {}
            fields = sorted(f for f in set(was) | set(now) if was.get(f) != now.get(f))
            moved = ", ".join(f"{f} {was.get(f)} -> {now.get(f)}" for f in fields)
            print(f"differs: {k}: {moved}")
        sys.exit(1 if bad else 0)
    GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN.relative_to(ROOT)}: {len(got)} runs")


if __name__ == "__main__":
    main()
