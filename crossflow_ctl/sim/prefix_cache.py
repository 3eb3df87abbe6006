"""Prefix-cache model over Mooncake ``hash_ids`` (prefix-chained ids of 512-token blocks).

Choice (stated, as the issue asks): a **bounded LRU of blocks**, in one of two variants:

* ``cluster`` (default): one cache shared by the whole prefill pool, as Mooncake's distributed
  KV store gives; a request's hit does not depend on which prefill server it lands on.
* ``node``: one LRU per prefill server; the router sends a request to the server holding its
  longest cached prefix (ties: the least loaded), so hits depend on routing.

A lookup counts leading blocks present (ids are prefix-chained, so the first miss ends the hit);
the request's blocks are then inserted (most recently used) at routing time, i.e. we assume the
prefix becomes reusable as soon as the request is admitted, not when its prefill ends. At least
one prompt token is always left uncached (the engine must compute the last position).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from enum import StrEnum

BLOCK_TOKENS = 512


class CacheScope(StrEnum):
    CLUSTER = "cluster"
    NODE = "node"


class LruBlockCache:
    """A bounded LRU set of block ids."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be at least 1")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def hit_blocks(self, hash_ids: Sequence[int]) -> int:
        """Leading blocks of ``hash_ids`` present now (no state change)."""
        n = 0
        for h in hash_ids:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hash_ids: Sequence[int]) -> None:
        """Touch every block (most recently used last), evicting the least recently used."""
        blocks = self._blocks
        for h in hash_ids:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
            self.evictions += 1


def cached_tokens(hit_blocks: int, input_tokens: int) -> int:
    """Cached prefix tokens for ``hit_blocks`` leading hits, leaving at least one token to do."""
    return max(0, min(hit_blocks * BLOCK_TOKENS, input_tokens - 1))


class PrefixCacheModel:
    """The cluster's prefix caches: one shared LRU, or one per prefill server."""

    def __init__(self, scope: CacheScope, capacity_tokens: int, prefill_nodes: int) -> None:
        self.scope = scope
        blocks = max(1, capacity_tokens // BLOCK_TOKENS)
        count = prefill_nodes if scope is CacheScope.NODE else 1
        self.caches = [LruBlockCache(blocks) for _ in range(count)]
        self.hit_tokens = 0
        self.input_tokens = 0

    def best_node(self, hash_ids: Sequence[int]) -> tuple[int | None, int]:
        """(prefill node index holding the longest prefix or None when shared/none, hit blocks)."""
        if self.scope is CacheScope.CLUSTER:
            return None, self.caches[0].hit_blocks(hash_ids)
        best, best_hit = None, 0
        for i, cache in enumerate(self.caches):
            hit = cache.hit_blocks(hash_ids)
            if hit > best_hit:
                best, best_hit = i, hit
        return best, best_hit

    def admit(self, hash_ids: Sequence[int], input_tokens: int, node: int | None) -> int:
        """Record a routed request: its cached tokens now, then insert its blocks."""
        if self.scope is CacheScope.CLUSTER or node is None:
            cache = self.caches[0]
        else:
            cache = self.caches[node]
        hit = cached_tokens(cache.hit_blocks(hash_ids), input_tokens)
        cache.insert(hash_ids)
        self.hit_tokens += hit
        self.input_tokens += input_tokens
        return hit

    @property
    def hit_share(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0
