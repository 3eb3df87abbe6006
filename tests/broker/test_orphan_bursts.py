"""A burst of orphaned debits (a round whose Admits all timed out) is released a few at a
time: one store call per orphan at once took the Redis pool from the Admits that followed."""

from __future__ import annotations

import asyncio

from crossflow_ctl.service.requests import ORPHAN_RELEASES_AT_ONCE, OrphanDebits


async def test_a_burst_of_orphans_is_released_a_few_at_a_time_and_all_of_them() -> None:
    in_flight = peak = 0
    released: list[str] = []

    async def release(reservation_id: str) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.001)  # a store round trip
        in_flight -= 1
        released.append(reservation_id)

    orphans = OrphanDebits(release)
    burst = [f"{i:032x}@d1" for i in range(10 * ORPHAN_RELEASES_AT_ONCE)]
    for rid in burst:
        orphans.release(rid, "admission timed out")
    await orphans.drain(timeout_s=30.0)
    assert sorted(released) == burst
    assert peak == ORPHAN_RELEASES_AT_ONCE
