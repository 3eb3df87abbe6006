"""The fake engine's prefix cache: chained block hashes, longest leading hit, LRU bound."""

from __future__ import annotations

from crossflow_agent.fake_engine.prefix_cache import BLOCK_TOKENS, PrefixCache, block_hashes


def test_a_block_hits_only_after_the_same_blocks() -> None:
    a = list(range(64))
    b = [*range(16), 999, *range(17, 64)]  # block 1 differs
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == 4 and ha[0] == hb[0] and ha[1] != hb[1]
    assert ha[2] != hb[2] and ha[3] != hb[3]  # the same tokens, after a different block
    assert block_hashes(a[:15]) == [] and block_hashes(a) == block_hashes(list(a))
    cache = PrefixCache(100)
    cache.insert(ha)
    assert cache.match(hb, 64) == 16
    assert cache.match(ha, 65) == 64
    assert cache.match(ha, 64) == 48  # the last token is always computed: 63 usable


def test_least_recently_used_blocks_go_first() -> None:
    cache = PrefixCache(4)
    first, second = block_hashes(list(range(32))), block_hashes(list(range(100, 132)))
    cache.insert(first)
    cache.insert(second)
    assert len(cache) == 4
    assert cache.match(first, 33) == 2 * BLOCK_TOKENS  # touched: now the most recent
    cache.insert(block_hashes(list(range(200, 232))))
    assert len(cache) == 4
    assert cache.match(second, 33) == 0 and cache.match(first, 33) == 32
