"""Where TTFT goes: hold, queue, prefill, transfer and KV wait, per path, summing to the TTFT."""

from __future__ import annotations

from pathlib import Path

import pytest

from crossflow_ctl.sim.cluster import Simulation, simulate
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.metrics import PHASES, ttft_phases
from crossflow_ctl.sim.report import write_report
from crossflow_ctl.sim.traces import Trace, TraceRequest

BURST = Trace(
    name="burst",
    requests=tuple(
        TraceRequest(12_000, 100, arrival_s=i * 0.02, cached_tokens=4_000) for i in range(60)
    ),
)


def _mean(sums: list[float], phase: str) -> float:
    return sums[1 + PHASES.index(phase)] / sums[0]


async def test_each_request_phases_sum_to_its_ttft_on_both_paths() -> None:
    cfg = SimConfig(prefill_nodes=1, decode_nodes=2, policy=PolicyKind.LEASES)
    sim = Simulation(BURST, cfg)
    rec = await sim.run()
    done = [r for r in sim.reqs.values() if r.first_token_s >= 0]
    assert {r.borrowed for r in done} == {True, False}
    for r in done:  # every stamp the split reads was set (unset is -1), in order
        stamps = (r.dispatch_s, r.arrive_s, r.start_s) + (() if r.borrowed else (r.prefilled_s,))
        assert min(stamps) >= r.release_s >= 0.0
        assert min(ttft_phases(r)) >= 0.0
    assert set(rec.phase_sums) == {"normal", "borrowed"}
    total = sum(sum(s[1:]) for s in rec.phase_sums.values())
    assert total == pytest.approx(sum(rec.ttft_s))
    assert sum(s[0] for s in rec.phase_sums.values()) == rec.measured
    normal, borrowed = rec.phase_sums["normal"], rec.phase_sums["borrowed"]
    assert _mean(normal, "prefill") > 0.0 and _mean(borrowed, "prefill") > 0.0
    assert _mean(normal, "hold") > 0.0  # late binding held some of them in the router


async def test_static_has_no_hold_and_its_queue_is_the_prefill_backlog(tmp_path: Path) -> None:
    rec = await simulate(BURST, SimConfig(prefill_nodes=1, decode_nodes=2))
    assert set(rec.phase_sums) == {"normal"}
    normal = rec.phase_sums["normal"]
    assert _mean(normal, "hold") == 0.0
    # 60 prompts queue for one prefill server: the queue dominates the TTFT
    assert _mean(normal, "queue") > _mean(normal, "prefill") > 0.0
    report = write_report(tmp_path, [rec], SimConfig(), plots=False).read_text()
    assert "## Where TTFT goes" in report
    assert "| burst | 1x | 1P2D/static | normal | 60 |" in report
