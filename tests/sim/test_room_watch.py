"""The simulated router gets room updates as a broker's WatchRoom would send them: through the
watch's filter (a material change, or a heartbeat) and no faster than its rate."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from crossflow_ctl.client.queue import Outcome
from crossflow_ctl.domain.room import RoomUpdate, material_change, update_due
from crossflow_ctl.service.config import RoomWatchSettings
from crossflow_ctl.sim.cluster import Simulation
from crossflow_ctl.sim.config import PolicyKind, SimConfig
from crossflow_ctl.sim.traces import load_mooncake


def test_update_due_is_a_material_change_after_the_gap_or_a_heartbeat() -> None:
    assert update_due(True, 0.1, 0.1, 1.0)
    assert not update_due(True, 0.09, 0.1, 1.0)
    assert not update_due(False, 0.5, 0.1, 1.0)
    assert update_due(False, 1.0, 0.1, 1.0)


async def test_room_updates_reach_the_queue_filtered_and_rate_limited(
    mooncake_sample: Path,
) -> None:
    trace = load_mooncake(mooncake_sample, limit=400).scaled(8)
    sim = Simulation(trace, SimConfig(prefill_nodes=2, decode_nodes=4, policy=PolicyKind.LEASES))
    control = sim.control
    assert control is not None
    seen: list[tuple[float, RoomUpdate]] = []
    on_room = control.queue.on_room

    async def recording(update: RoomUpdate) -> list[Outcome]:
        seen.append((control.now, update))
        return await on_room(update)

    control.queue.on_room = recording  # type: ignore[method-assign]
    await sim.run()
    settings = RoomWatchSettings()
    gap_s, heartbeat_s = 1.0 / settings.max_updates_per_s, settings.heartbeat_ms / 1000.0
    assert len(seen) > 10  # prompts were held and room came back
    for (was_s, was), (now_s, now) in pairwise(seen):
        assert now_s - was_s >= gap_s - 1e-9
        material = material_change(was.view, now.view, settings.min_change)
        assert now.heartbeat is not material
        assert material or now_s - was_s >= heartbeat_s - 1e-9
