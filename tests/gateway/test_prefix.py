"""The gateway's cached-prefix estimate: chained block hashes, longest run, a bounded LRU."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossflow_ctl.gateway.prefix import PrefixIndex, block_hashes


def test_blocks_chain_so_equal_hashes_mean_equal_prefixes() -> None:
    a = block_hashes(list(range(64)), 16)
    b = block_hashes([*range(16), 999, *range(17, 64)], 16)
    assert len(a) == 4
    assert a[0] == b[0]
    assert a[1] != b[1]
    assert a[2] != b[2]  # the same tokens after a different block: another prefix


def test_a_partial_last_block_is_never_counted() -> None:
    assert block_hashes(list(range(31)), 16) == block_hashes(list(range(16)), 16)
    assert block_hashes(list(range(15)), 16) == []


def test_cached_tokens_are_the_longest_run_from_the_start() -> None:
    index = PrefixIndex(block_tokens=4, max_blocks=100)
    prompt = block_hashes(list(range(16)), 4)
    index.record("d1", prompt[:2])
    index.record("d2", prompt)
    other = block_hashes([7, *range(1, 16)], 4)
    assert index.cached_tokens(prompt, ["d1", "d2", "d3"]) == {"d1": 8, "d2": 16, "d3": 0}
    assert index.cached_tokens(other, ["d1", "d2"]) == {"d1": 0, "d2": 0}


def test_memory_is_bounded_and_the_least_recently_used_goes_first() -> None:
    index = PrefixIndex(block_tokens=1, max_blocks=3)
    old, new = block_hashes([1, 2], 1), block_hashes([5, 6], 1)
    index.record("d1", old)
    index.record("d1", old[:1])  # used again: now the most recent
    index.record("d1", new)
    assert index.size("d1") == 3
    assert index.cached_tokens(old, ["d1"]) == {"d1": 1}
    assert index.cached_tokens(new, ["d1"]) == {"d1": 2}


def test_forget_clears_an_engine_that_restarted() -> None:
    index = PrefixIndex(block_tokens=2, max_blocks=10)
    hashes = block_hashes([1, 2, 3, 4], 2)
    index.record("d1", hashes)
    index.forget("d1")
    assert index.cached_tokens(hashes, ["d1"]) == {"d1": 0}


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        PrefixIndex(block_tokens=0, max_blocks=1)


@given(
    tokens=st.lists(st.integers(0, 50), max_size=60),
    recorded=st.lists(st.lists(st.integers(0, 50), max_size=60), max_size=5),
    bound=st.integers(1, 8),
)
def test_never_more_than_the_bound_and_never_more_than_the_prompt(
    tokens: list[int], recorded: list[list[int]], bound: int
) -> None:
    index = PrefixIndex(block_tokens=4, max_blocks=bound)
    for prompt in recorded:
        index.record("d", block_hashes(prompt, 4))
    assert index.size("d") <= bound
    cached = index.cached_tokens(block_hashes(tokens, 4), ["d"])["d"]
    assert 0 <= cached <= len(tokens)
    assert cached % 4 == 0
