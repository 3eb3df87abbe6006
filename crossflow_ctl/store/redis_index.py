"""The Redis store's global indexes: known nodes and live lenders, split into hash-tagged buckets.

Every node is in the node index (a SET) of its bucket; a node with a live, non-zero, uncordoned
lease is in its bucket's lender index (a ZSET scored by lease expiry). ``INDEX_BUCKETS`` buckets,
each with its own hash tag, spread the indexes over a Redis Cluster's masters instead of making
one hot slot; every operation here is one pipeline over the buckets it needs (on a Cluster,
redis-py splits it per master). The lender index only steers sampling: admission re-reads every
sampled node, and entries leave by score once their lease expires.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from redis.asyncio import Redis, RedisCluster

from crossflow_ctl.store import redis_codec as codec
from crossflow_ctl.store.keys import INDEX_BUCKETS, Keys
from crossflow_ctl.store.redis_scripts import Scripts

LENDER_DRAW_PER_BUCKET = 8


class NodeIndex:
    def __init__(self, client: Redis | RedisCluster, keys: Keys, scripts: Scripts) -> None:
        self._r = client
        self._k = keys
        self._scripts = scripts

    def queue_add(self, pipe: Any, node_id: str) -> None:
        pipe.sadd(self._k.nodes(self._k.bucket(node_id)), node_id)

    def queue_remove(self, pipe: Any, node_id: str) -> None:
        bucket = self._k.bucket(node_id)
        pipe.srem(self._k.nodes(bucket), node_id)
        pipe.zrem(self._k.lenders(bucket), node_id)

    async def node_ids(self) -> list[str]:
        """Every known node id, sorted (one pipeline of SMEMBERS over the buckets)."""
        pipe = self._r.pipeline(transaction=False)
        for bucket in range(INDEX_BUCKETS):
            pipe.smembers(self._k.nodes(bucket))
        found: Iterable[Iterable[Any]] = await pipe.execute()
        return sorted(codec.text(n) for members in found for n in members)

    async def set_lenders(self, changes: Mapping[str, int | None]) -> None:
        """Add (lease expiry in ms) or drop (None) lenders, in one pipeline."""
        adds: dict[int, dict[str, int]] = {}
        drops: dict[int, list[str]] = {}
        for node_id, expires in changes.items():
            bucket = self._k.bucket(node_id)
            if expires is None:
                drops.setdefault(bucket, []).append(node_id)
            else:
                adds.setdefault(bucket, {})[node_id] = expires
        if not adds and not drops:
            return
        pipe = self._r.pipeline(transaction=False)
        for bucket, members in adds.items():
            pipe.zadd(self._k.lenders(bucket), members)
        for bucket, ids in drops.items():
            pipe.zrem(self._k.lenders(bucket), *ids)
        await pipe.execute()

    async def draw_lenders(
        self, sample: int, now_ms: int, also_hgetall: str | None = None
    ) -> tuple[list[tuple[str, int]], Any]:
        """Drop expired lenders and draw up to ``max(sample, 8)`` from every bucket
        (``draw_lenders.lua``, one call per bucket), with an HGETALL of ``also_hgetall`` when
        given (one pipeline): (node id, lease expiry ms) pairs, and that hash (None when not
        asked)."""
        per_bucket = max(sample, LENDER_DRAW_PER_BUCKET)
        before = [] if also_hgetall is None else [("HGETALL", also_hgetall)]
        calls = [([self._k.lenders(b)], (now_ms, per_bucket)) for b in range(INDEX_BUCKETS)]
        out = await self._scripts.run_after(before, "draw_lenders", calls)
        members: list[tuple[str, int]] = []
        for flat in out[len(before) :]:
            flat = flat or []
            members.extend(
                (codec.text(flat[i]), int(float(flat[i + 1]))) for i in range(0, len(flat), 2)
            )
        return members, (out[0] if before else None)
