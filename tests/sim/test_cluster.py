"""The simulated cluster on hand-checkable cases, and the leases policy through the real store."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

from crossflow_ctl.domain.capacity import StepShape, step_time_s
from crossflow_ctl.domain.lease_credits import LeaseSettings
from crossflow_ctl.sim.cluster import Simulation, simulate
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.metrics import summarize
from crossflow_ctl.sim.report import write_report
from crossflow_ctl.sim.traces import Trace, TraceRequest, load_mooncake
from tests.conftest import patient_redis_store

CFG = SimConfig(prefill_nodes=1, decode_nodes=1)


def _trace(*reqs: TraceRequest) -> Trace:
    return Trace(name="hand", requests=reqs)


def _step(cfg: SimConfig, **shape: int) -> float:
    return step_time_s(cfg.model_spec, cfg.node_profile, StepShape(**shape))


async def test_one_request_normal_path_exact_ttft() -> None:
    """TTFT = chunked prefill (two chunks: 8192 then 1808 over an 8192 prefix) + KV transfer."""
    rec = await simulate(_trace(TraceRequest(10_000, 1, cached_tokens=0)), CFG)
    spec, node = CFG.model_spec, CFG.node_profile
    prefill = _step(CFG, prefill_tokens=8192) + _step(CFG, prefill_tokens=1808, prefix_tokens=8192)
    transfer = 10_000 * spec.kv_bytes_per_token / node.network_bytes_per_s
    assert rec.ttft_s == [pytest.approx(prefill + transfer, rel=1e-12)]
    assert rec.borrowed == 0 and rec.completed == 1


async def test_one_request_itl_is_one_decode_step() -> None:
    """Two output tokens: the second comes one decode step t(B=1, C=input+1) after the first."""
    rec = await simulate(_trace(TraceRequest(4000, 2, cached_tokens=1000)), CFG)
    assert rec.itl_req_s == [pytest.approx(_step(CFG, batch=1, context_tokens=4001), rel=1e-12)]


async def test_short_prompt_threshold_borrow_exact_ttft() -> None:
    """Threshold heuristic, short prompt, idle decode node: TTFT = one prefill chunk step there."""
    cfg = CFG.model_copy(update={"policy": PolicyKind.THRESHOLD})
    rec = await simulate(_trace(TraceRequest(1500, 1, cached_tokens=0)), cfg)
    assert rec.borrowed == 1
    assert rec.ttft_s == [pytest.approx(_step(cfg, prefill_tokens=1500), rel=1e-12)]


def _burst(n: int, gap_s: float, inp: int = 12_000, out: int = 200) -> Trace:
    return _trace(*(TraceRequest(inp, out, arrival_s=i * gap_s, cached_tokens=0) for i in range(n)))


LEASES = SimConfig(prefill_nodes=1, decode_nodes=2, policy=PolicyKind.LEASES)


async def test_burst_on_a_busy_prefill_pool_borrows() -> None:
    """The control case for the three below: demand, benefit and room, so leases borrow."""
    rec = await simulate(_burst(60, 0.02), LEASES)
    assert rec.borrowed > 0
    assert rec.overcommits == 0
    assert rec.admit_reasons.get("borrowed", 0) == rec.borrowed


async def test_idle_prefill_pool_never_borrows() -> None:
    """Requests far apart: the prefill pool is idle at every arrival, Demand fails."""
    rec = await simulate(_burst(20, 5.0), LEASES)
    assert rec.borrowed == 0
    assert set(rec.admit_reasons) <= {"no_demand", "pool_load_missing"}
    assert rec.admit_reasons.get("no_demand", 0) >= 19


async def test_saturated_decode_node_never_borrows() -> None:
    """Decode KV full of long-running requests: the agents' leases carry no room at all.

    Phase 1 fills both decode servers' KV (about 47 requests of 21k tokens each per 1M-token
    server; their prompts are mostly cached, so prefill is quick). Phase 2 is the burst of the
    control case above, which borrows on its own, arriving once the KV is full."""
    fill = [
        TraceRequest(18_000, 3000, arrival_s=i * 0.01, cached_tokens=17_000) for i in range(100)
    ]
    burst = [
        TraceRequest(12_000, 200, arrival_s=8.0 + i * 0.02, cached_tokens=0) for i in range(60)
    ]
    sim = Simulation(_trace(*fill, *burst), LEASES)
    await sim.run()
    assert not any(sim.reqs[i].borrowed for i in range(100, 160))
    assert all(sim.reqs[i].first_token_s > 0 for i in range(160))
    for agent in sim.decode_agents:
        assert agent.zero_reasons.get("no_capacity", 0) > 0


async def test_zero_lease_never_borrows() -> None:
    """An ITL SLO below the fixed step overhead: every lease is a zero lease."""
    cfg = LEASES.model_copy(update={"lease": LeaseSettings(itl_slo_ms=1.0)})
    sim = Simulation(_burst(60, 0.02), cfg)
    rec = await sim.run()
    assert rec.borrowed == 0
    assert all(a.leases > 0 and a.zero_leases == a.leases for a in sim.decode_agents)
    assert rec.admit_reasons.get("no_leases", 0) > 0


async def test_same_seed_same_report(tmp_path: Path) -> None:
    trace = _burst(80, 0.05)
    reports = []
    for run in ("a", "b"):
        records = [
            await simulate(trace, LEASES.model_copy(update={"seed": 7})),
            await simulate(trace, LEASES.model_copy(update={"policy": PolicyKind.STATIC})),
        ]
        path = write_report(tmp_path / run, records, LEASES, plots=False)
        reports.append(path.read_text())
    assert reports[0] == reports[1]
    assert "2P4D" not in reports[0] and "1P2D/leases" in reports[0]


async def test_mooncake_slice_leases_borrow_without_over_commit(mooncake_sample: Path) -> None:
    trace = load_mooncake(mooncake_sample, limit=600).scaled(4)
    cfg = SimConfig(prefill_nodes=2, decode_nodes=4, policy=PolicyKind.LEASES)
    rec = await simulate(trace, cfg)
    s = summarize(rec)
    assert rec.completed == 600
    assert rec.borrowed > 0
    assert s.overcommits == 0
    assert rec.release_failures == 0


@pytest.mark.redis
async def test_leases_on_the_redis_store(redis_url: str, redis_namespace: str) -> None:
    store = patient_redis_store(redis_url, redis_namespace)
    try:
        rec = await simulate(_burst(40, 0.02), LEASES, store)
    finally:
        await store.close()
    assert rec.borrowed > 0
    assert rec.overcommits == 0
    assert rec.completed == 40


async def test_record_counts_zero_leases_by_reason_and_the_mean_live_lease(
    tmp_path: Path,
) -> None:
    """The report says why leases were zero and what a live lease offered on average."""
    zero_cfg = LEASES.model_copy(update={"lease": LeaseSettings(itl_slo_ms=1.0)})
    zero = await Simulation(_burst(60, 0.02), zero_cfg).run()
    assert zero.leases > 0
    assert sum(zero.zero_reasons.values()) == zero.leases
    assert not any(zero.lease_credit_sums.values())

    sim = Simulation(_burst(60, 0.02), LEASES)
    live = await sim.run()
    assert live.leases == sum(a.leases for a in sim.decode_agents)
    assert live.zero_reasons == _merged(a.zero_reasons for a in sim.decode_agents)
    live_leases = live.leases - sum(live.zero_reasons.values())
    assert live_leases > 0
    assert live.lease_credit_sums["compute_tokens"] > 0 and live.lease_chunk_sum > 0

    text = write_report(tmp_path, [zero, live], LEASES, plots=False).read_text()
    section = text.split("## Decode agents' leases", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| hand | 1x | 1P2D/leases")]
    assert len(rows) == 2
    assert f"| {zero.leases:,} | 100.0 % |" in rows[0]  # every lease of the first run was zero
    assert "| 100.0 % |" not in rows[1]


def _merged(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out
