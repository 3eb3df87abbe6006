"""The fake engine's prefix cache: an LRU of chained block hashes, as vLLM's is.

A block is 16 prompt tokens; its hash covers its token ids and the previous block's hash, so a
block hits only when everything before it is the same. A prompt's cached tokens are the longest
run of leading full blocks already present, within its first ``len - 1`` tokens (the last token
is always computed, as vLLM does, so the model has logits to sample from). Blocks are inserted
when a prompt's KV is complete (its prefill finished, or its KV arrived); the least recently used
are evicted beyond ``capacity_blocks``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

BLOCK_TOKENS = 16


def block_hashes(token_ids: Sequence[int]) -> list[bytes]:
    """The chained hash of every full block of ``token_ids``."""
    out: list[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        block = token_ids[start : start + BLOCK_TOKENS]
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(b"".join(t.to_bytes(4, "little") for t in block))
        parent = digest.digest()
        out.append(parent)
    return out


class PrefixCache:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[bytes], prompt_tokens: int) -> int:
        """Cached tokens of a prompt of ``prompt_tokens`` tokens with these block hashes; the
        blocks that hit become the most recently used."""
        usable = min(len(hashes), max(prompt_tokens - 1, 0) // BLOCK_TOKENS)
        hit = 0
        while hit < usable and hashes[hit] in self._blocks:
            self._blocks.move_to_end(hashes[hit])
            hit += 1
        return hit * BLOCK_TOKENS

    def insert(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
