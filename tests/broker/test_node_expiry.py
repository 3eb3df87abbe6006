"""Nodes that have gone away expire from the store (issue #11): a replica's periodic sweep
removes nodes with no lease, pool load or registration for ``node_expiry_s``; nodes still
streaming stay. On the memory store and on Redis."""

from __future__ import annotations

import asyncio
from typing import Any

from crossflow_ctl.client import AdminClient
from tests.broker.conftest import target


async def test_silent_nodes_expire_and_streaming_ones_stay(
    cluster: Any, agents: Any, clock: Any
) -> None:
    server = await cluster.start(node_expiry_s=5.0, node_sweep_s=0.05)
    gone = await agents(server, "d-gone")
    live = await agents(server, "d-live")
    await gone.send_lease()
    await live.send_lease()
    await gone.close()
    async with AdminClient(target(server)) as admin:
        await asyncio.sleep(0.3)  # several sweeps: nobody is idle yet
        assert sorted(n.state.info.node_id for n in await admin.list_nodes()) == [
            "d-gone",
            "d-live",
        ]
        clock.advance(6_000)
        await live.send_lease()  # heard of since: stays
        for _ in range(400):
            names = [n.state.info.node_id for n in await admin.list_nodes()]
            if len(names) == 1:
                break
            await asyncio.sleep(0.05)
        assert names == ["d-live"]
        clock.advance(3_000)
        await asyncio.sleep(0.3)
        assert [n.state.info.node_id for n in await admin.list_nodes()] == ["d-live"]
