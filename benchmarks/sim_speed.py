"""How fast the simulator replays one hour of the Mooncake trace, per policy.

Prints CPU time (this process: steadier than wall time on a shared machine), wall time, events
per second and simulated seconds per CPU second for the static policy (the floor: servers and
routing only), the threshold heuristic and leases (plus agents, broker, store and the router's
late-binding queue), measured in the same run, and each one's ratio to the static floor (issue
10 said 3x, issue 32 says 4x: leases within 4x the static run). Usage:
``python benchmarks/sim_speed.py [--trace FILE] [--limit N] [--load X] [--no-rules]``. Without
``--trace`` it reads ``mooncake_conversation_trace.jsonl`` (the whole hour) in the folder
``$CROSSFLOW_TRACES_DIR``; tests/data/traces/README.md says where to get it.

Then, unless ``--no-rules``, a floor under the leases row: the domain rules a leases run must
apply, alone. A further leases run records the arguments of every lease decision
(:func:`~crossflow_ctl.domain.leasing.decide`, each decode agent each period) and every Admit's
plan (:func:`~crossflow_ctl.domain.admission.plan_admission`: Demand, Benefit and Safety on each
candidate), with their results; the benchmark then calls them again on those very inputs,
checks each result is the one the run got, and prints their CPU time against the static floor.
No broker, store, queue or agent bookkeeping runs in it, so a leases run cannot be cheaper than
the static floor plus this (short of making the rules themselves cheaper).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import structlog

from crossflow_ctl.domain.admission import plan_admission
from crossflow_ctl.domain.leasing import decide
from crossflow_ctl.sim.cluster import simulate
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.traces import Trace, load_trace

TRACE = "mooncake_conversation_trace.jsonl"
"""The default trace's file name, in $CROSSFLOW_TRACES_DIR."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--trace", type=Path, help=f"trace file (default: $CROSSFLOW_TRACES_DIR/{TRACE})"
    )
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--load", type=float, default=1.0)
    parser.add_argument(
        "--no-rules", action="store_true", help="skip the domain-rules floor (a further run)"
    )
    args = parser.parse_args()
    if args.trace is None:
        folder = os.environ.get("CROSSFLOW_TRACES_DIR")
        if not folder:
            parser.error(
                f"give --trace FILE or set CROSSFLOW_TRACES_DIR to a folder holding {TRACE} "
                "(where to get it: tests/data/traces/README.md)"
            )
        args.trace = Path(folder) / TRACE
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    trace = load_trace(args.trace, limit=args.limit).scaled(args.load)
    span = trace.open_span_s
    print(
        f"{args.trace.name}: {len(trace.requests)} requests over {span:.0f} s at {args.load:g}x",
        flush=True,
    )
    floor = None
    for policy in (PolicyKind.STATIC, PolicyKind.THRESHOLD, PolicyKind.LEASES):
        cfg = cluster(policy)
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
    if not args.no_rules and floor is not None:
        rules_floor(trace, floor)


def cluster(policy: PolicyKind) -> SimConfig:
    """The cluster every row runs: 2P4D under ``policy``."""
    return SimConfig(prefill_nodes=2, decode_nodes=4, policy=policy)


Call = tuple[tuple[Any, ...], dict[str, Any], object]
"""One recorded call: positional and keyword arguments, and what it returned."""


def recording(fn: Callable[..., Any], calls: list[Call], copied: tuple[str, ...]) -> Any:
    """``fn``, recording each call; the keyword arguments named in ``copied`` are mutable (the
    agent's open debits change with the next notice) and are recorded as they were then."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        frozen = {k: copy.deepcopy(v) if k in copied else v for k, v in kwargs.items()}
        result = fn(*args, **kwargs)
        calls.append((args, frozen, result))
        return result

    return wrapper


def replay(fn: Callable[..., Any], calls: list[Call]) -> float:
    """CPU seconds to call ``fn`` again on every recorded call; each must return as it did.
    The collector is off meanwhile: the recording holds the whole run's inputs, which a run
    never does, and full collections over them would be charged to the rules."""
    gc.collect()
    gc.disable()
    try:
        started = time.process_time()
        results = [fn(*args, **kwargs) for args, kwargs, _ in calls]
        cpu = time.process_time() - started
    finally:
        gc.enable()
    wrong = sum(1 for got, (_, _, want) in zip(results, calls, strict=True) if got != want)
    if wrong:
        raise SystemExit(f"{fn.__name__}: {wrong} of {len(calls)} replayed calls differ")
    return cpu


def rules_floor(trace: Trace, floor: float) -> None:
    """Record a leases run's decide and plan_admission calls, replay them, print the floor."""
    decisions: list[Call] = []
    plans: list[Call] = []
    with (
        mock.patch(
            "crossflow_ctl.sim.agents.decide",
            recording(decide, decisions, ("open_debits",)),
        ),
        mock.patch(
            "crossflow_ctl.service.admission.plan_admission",
            recording(plan_admission, plans, ()),
        ),
    ):
        asyncio.run(simulate(trace, cluster(PolicyKind.LEASES)))
    decide_cpu = min(replay(decide, decisions) for _ in range(3))
    plan_cpu = min(replay(plan_admission, plans) for _ in range(3))
    rules = decide_cpu + plan_cpu
    print(
        f"{'rules alone':16s} cpu {rules:7.2f} s  decide {len(decisions)} x"
        f" {decide_cpu / max(len(decisions), 1) * 1e6:.1f} us, plan_admission {len(plans)} x"
        f" {plan_cpu / max(len(plans), 1) * 1e6:.1f} us (best of 3, on the run's own inputs)"
        f"  x{rules / floor:5.1f} the static floor",
        flush=True,
    )
    print(
        f"{'':16s} so a leases run costs at least the static floor + this:"
        f" x{(floor + rules) / floor:.1f} the static floor",
        flush=True,
    )


if __name__ == "__main__":
    main()
