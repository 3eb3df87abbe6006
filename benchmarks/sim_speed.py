"""How fast the simulator replays one hour of the Mooncake trace, per policy.

Prints CPU time (this process: steadier than wall time on a shared machine), wall time, events
per second and simulated seconds per CPU second for the static policy (the floor: servers and
routing only), the threshold heuristic and leases (plus agents, broker, store and the router's
late-binding queue), measured in the same run, and each one's ratio to the static floor (issue
10's target: leases within 3x). Usage:
``python benchmarks/sim_speed.py [--trace FILE] [--limit N] [--load X]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from pathlib import Path

import structlog

from crossflow_ctl.sim.cluster import simulate
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.traces import load_trace

TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--load", type=float, default=1.0)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    trace = load_trace(args.trace, limit=args.limit).scaled(args.load)
    span = trace.open_span_s
    print(
        f"{args.trace.name}: {len(trace.requests)} requests over {span:.0f} s at {args.load:g}x",
        flush=True,
    )
    floor = None
    for policy in (PolicyKind.STATIC, PolicyKind.THRESHOLD, PolicyKind.LEASES):
        cfg = SimConfig(prefill_nodes=2, decode_nodes=4, policy=policy)
        started, cpu0 = time.perf_counter(), time.process_time()
        rec = asyncio.run(simulate(trace, cfg))
        wall = time.perf_counter() - started
        cpu = max(time.process_time() - cpu0, 1e-9)
        floor = floor or cpu
        print(
            f"{cfg.label:16s} cpu {cpu:7.2f} s  wall {wall:7.2f} s  events {rec.sim_events:8d}"
            f"  {rec.sim_events / cpu:8.0f} ev/s  {span / cpu:7.0f} sim-s/s"
            f"  x{cpu / floor:5.1f} the static floor",
            flush=True,
        )


if __name__ == "__main__":
    main()
