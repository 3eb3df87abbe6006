"""The simulated agents' fixed-point test reads every snapshot field but the time it was taken."""

from __future__ import annotations

from crossflow_ctl.domain.telemetry import EngineSnapshot
from crossflow_ctl.sim.agents import snapshot_key


def test_snapshot_key_tells_apart_snapshots_that_differ_in_any_field_but_their_time() -> None:
    base = EngineSnapshot(taken_at_ms=1, kv_total_tokens=100)
    assert snapshot_key(base) == snapshot_key(base.model_copy(update={"taken_at_ms": 2}))
    for name, info in EngineSnapshot.model_fields.items():
        if name == "taken_at_ms":
            continue
        value = "other" if info.annotation is str else 7
        changed = base.model_copy(update={name: value})
        assert snapshot_key(changed) != snapshot_key(base), name
