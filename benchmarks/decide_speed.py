"""Cost of one lease decision (``crossflow_ctl.domain.leasing.decide``), against two floors.

    python benchmarks/decide_speed.py [--number 5000] [--repeat 7]

The simulator calls ``decide`` for every decode node every agent period, so its cost sets how
much slower a leases run is than a static one. Printed, best of ``--repeat`` timeit loops:

* floor: one step-time evaluation of the roofline (``Roofline.step_s``), measured in the same
  run; ``decide`` costs a few of these (chunk search, cost line, batch room) plus the rules;
* floor: the snapshot's plausibility check alone;
* decide, on a light, a busy and an overloaded decode node (GPT-OSS-120B on H200 and GB300).
"""

from __future__ import annotations

import argparse
import timeit

from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS, roofline
from crossflow_ctl.domain.lease_credits import LeaseSettings
from crossflow_ctl.domain.leasing import ItlGuard, decide, implausibility
from crossflow_ctl.domain.lending import OpenDebits
from crossflow_ctl.domain.telemetry import EngineSnapshot


def snapshot(batch: int, per_request: int, outstanding: int = 0) -> EngineSnapshot:
    return EngineSnapshot(
        taken_at_ms=1_000,
        running_requests=batch,
        decode_context_tokens=batch * per_request,
        kv_used_tokens=batch * per_request,
        kv_total_tokens=2_000_000,
        itl_p50_ms=20.0,
        itl_p99_ms=25.0,
        outstanding_uncached_tokens=outstanding,
    )


def best_us(fn: object, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--number", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    model, settings, guard = MODEL_PRESETS["gpt-oss-120b"], LeaseSettings(), ItlGuard()
    ledger = OpenDebits(kv=10_000, output=500)
    for name in ("h200", "gb300"):
        report(name, model, settings, guard, ledger, args.number, args.repeat)


def report(
    name: str,
    model: object,
    settings: LeaseSettings,
    guard: ItlGuard,
    ledger: OpenDebits,
    number: int,
    repeat: int,
) -> None:
    node = NODE_PRESETS[name]
    roof = roofline(model, node)  # type: ignore[arg-type]
    light = snapshot(8, 2_000)
    step = best_us(lambda: roof.step_s(16, 64_000, 1024, 8192), number, repeat)
    rules = best_us(lambda: implausibility(light), number, repeat)
    print(f"{name}: floor step_s {step:.2f} us, floor plausibility check {rules:.2f} us")
    for label, snap in (
        ("light (B=8)", light),
        ("busy (B=64, 3k queued)", snapshot(64, 4_000, 3_000)),
        ("overloaded (B=200)", snapshot(200, 8_000)),
    ):

        def call(snap: EngineSnapshot = snap) -> object:
            return decide(snap, now_ms=1_000, model=model, node=node, settings=settings,  # type: ignore[arg-type]
                          guard=guard, open_debits=ledger)  # fmt: skip

        us = best_us(call, number, repeat)
        print(f"  decide {label:<24} {us:6.1f} us  ({us / step:.1f} x step_s)")


if __name__ == "__main__":
    main()
