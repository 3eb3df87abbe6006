"""Where a prompt's prefix is cached, as far as this gateway can tell (pure: no I/O).

The gateway cannot see the engines' prefix caches, but it knows what it sent where: a prompt
routed to an engine leaves its KV blocks there. Prompts are cut into blocks of ``block_tokens``
token ids; each block's hash chains its parent's, so equal hashes mean equal prefixes (as the
engines' own prefix caches key their blocks). Per engine, the most recently used
``max_blocks`` hashes are kept (an LRU, like the engine's eviction), so memory is bounded.

An estimate: an engine may have evicted what the gateway remembers, or hold prefixes sent by
another router. Admit's debit covers the difference: a node that has to prefill more than the
estimate said has leased for it only what its credits allow.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

_ROOT = 0x9E3779B97F4A7C15


def block_hashes(tokens: Sequence[int], block_tokens: int) -> list[int]:
    """Chained hashes of the prompt's full blocks (a partial last block is never cached)."""
    out: list[int] = []
    parent = _ROOT
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = hash((parent, *tokens[start : start + block_tokens]))
        out.append(parent)
    return out


class PrefixIndex:
    """Block hashes each engine holds, most recently used last, at most ``max_blocks`` each."""

    def __init__(self, block_tokens: int, max_blocks: int) -> None:
        if block_tokens < 1 or max_blocks < 1:
            raise ValueError("block_tokens and max_blocks must be positive")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def cached_tokens(self, hashes: Sequence[int], engines: Iterable[str]) -> dict[str, int]:
        """Per engine, the tokens of the longest run of ``hashes`` from the start it holds."""
        out: dict[str, int] = {}
        for engine in engines:
            held = self._blocks.get(engine)
            count = 0
            if held:
                for h in hashes:
                    if h not in held:
                        break
                    count += 1
            out[engine] = count * self.block_tokens
        return out

    def record(self, engine: str, hashes: Sequence[int]) -> None:
        """``engine`` now holds these blocks (most recently used); the oldest beyond the
        bound are forgotten."""
        held = self._blocks.setdefault(engine, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def forget(self, engine: str) -> None:
        """The engine restarted or left: it holds nothing the gateway sent before."""
        self._blocks.pop(engine, None)

    def size(self, engine: str) -> int:
        return len(self._blocks.get(engine, ()))
