"""The simulated agents' snapshots are whole, valid EngineSnapshots.

They are built without validation (``EngineSnapshot.observed``: the caller's dict becomes the
model's own, with no check of its keys), so these tests hold them to what validation and
pydantic's own bookkeeping would give: every field, in order, each one as validated.
"""

from __future__ import annotations

from crossflow_ctl.domain.telemetry import EngineSnapshot
from crossflow_ctl.sim.agents import DecodeAgent, PrefillAgent
from crossflow_ctl.sim.config import SimConfig
from crossflow_ctl.sim.servers import DecodeServer, EventQueue, PrefillServer, Req, StepModel

CFG = SimConfig()
FIELDS = tuple(EngineSnapshot.model_fields)


def _check(snap: EngineSnapshot) -> None:
    assert tuple(snap.__dict__) == FIELDS  # every field, in declaration order, nothing else
    assert snap.model_fields_set == set(FIELDS)
    assert snap.model_extra is None
    valid = EngineSnapshot.model_validate(snap.__dict__)
    assert valid == snap and valid.__dict__ == snap.__dict__
    assert snap.model_copy(update={"window_s": 9.0}).window_s == 9.0  # a working model
    assert snap.kv_free_tokens == valid.kv_free_tokens


def test_a_decode_agent_snapshot_is_a_whole_valid_snapshot() -> None:
    events = EventQueue()
    steps = StepModel(CFG.model_spec, CFG.node_profile)
    server = DecodeServer(
        0,
        steps,
        events,
        kv_capacity=100_000,
        max_batch=CFG.max_batch,
        max_macro=CFG.max_macro_steps,
        borrow_chunk=CFG.borrow_chunk_tokens,
    )
    agent = DecodeAgent(server, "d0", CFG.model_spec, CFG.node_profile, CFG.lease, 0.2, 600)
    _check(agent.snapshot(0.0, 0))  # idle: no ITL yet (None quantiles)
    server.arrive_normal(Req(0, 2_000, 50_000, 0, 0.0, measured=True), 0.0)
    t, _, _, gen = events.pop()
    server.step_end(t, gen)  # type: ignore[arg-type]
    snap = agent.snapshot(t, 60)
    assert snap.itl_p50_ms is not None and snap.running_requests == 1
    _check(snap)
    # two snapshots never share their field dict (each model owns its own)
    assert agent.snapshot(0.07, 70).__dict__ is not snap.__dict__


def test_a_prefill_agent_snapshot_is_a_whole_valid_snapshot() -> None:
    server = PrefillServer(
        0, StepModel(CFG.model_spec, CFG.node_profile), CFG.prefill_chunk_tokens, EventQueue()
    )
    agent = PrefillAgent(server, "p0", CFG.lease, 0.2, 600, CFG.kv_capacity_tokens)
    _check(agent.snapshot(0.0, 0))
    server.enqueue(Req(0, 4_000, 10, 0, 0.0, measured=True), 0.0)
    snap = agent.snapshot(0.01, 10)
    assert snap.queued_requests + snap.running_requests == 1
    _check(snap)
