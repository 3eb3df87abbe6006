"""How fast the simulator replays one hour of the Mooncake trace, per policy.

Prints wall time, events per second and simulated seconds per wall second for the static
policy (the floor: servers and routing only) and for leases (plus agents, broker and store),
measured in the same run. Usage: ``python benchmarks/sim_speed.py [--limit N] [--load X]``.
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
    print(f"{args.trace.name}: {len(trace.requests)} requests over {span:.0f} s at {args.load:g}x")
    floor = None
    for policy in (PolicyKind.STATIC, PolicyKind.THRESHOLD, PolicyKind.LEASES):
        cfg = SimConfig(prefill_nodes=2, decode_nodes=4, policy=policy)
        started = time.perf_counter()
        rec = asyncio.run(simulate(trace, cfg))
        wall = time.perf_counter() - started
        floor = floor or wall
        print(
            f"{cfg.label:16s} wall {wall:6.2f} s  events {rec.sim_events:8d}"
            f"  {rec.sim_events / wall:9.0f} ev/s  {span / wall:7.0f} sim-s/s"
            f"  x{wall / floor:5.1f} the static floor"
        )


if __name__ == "__main__":
    main()
