"""Prompt text for a trace's turns: as many words as the turn has prompt tokens (the fake
engines' tokenizer counts one token per word), laid out so the engines' and the gateway's
prefix caches see what the trace says is cached.

A session's turns are prefixes of one stream of words: turn k's prompt is the stream's first
``cached_tokens + uncached_tokens`` words, so a turn repeats the turns before it (an agent's
growing context) and its cached tokens are cached wherever those turns ran. The stream starts
with the words every session shares (a system prompt, as long as the session's first turn says
is cached), then a block that names the session (so sessions part there), then filler. A salt
in every named word gives each replay of a trace its own text: a second replay on the same
engines starts as cold as the first.

Filler words are one letter (two bytes with their space), so a 100k-token prompt stays well
under the fake engines' 1 MiB body limit.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field

from crossflow_ctl.demo.trace import Session

MARK_WORDS = 16
"""Words naming the session: one whole block of the engines' (and the gateway's) prefix cache,
so two sessions never share a block after their common system prompt."""
_LETTERS = string.ascii_lowercase


def _word(text: str) -> str:
    return re.sub(r"\s+", "_", text) or "_"


def filler(start: int, count: int) -> list[str]:
    return [_LETTERS[i % len(_LETTERS)] for i in range(start, start + count)]


@dataclass
class Prompts:
    """The prompts of one replay (``salt`` tells replays apart)."""

    salt: str
    _shared: list[str] = field(default_factory=list)
    _streams: dict[str, list[str]] = field(default_factory=dict)

    def _system(self, length: int) -> list[str]:
        """The first ``length`` words every session shares."""
        if len(self._shared) < length:
            start = len(self._shared)
            if start == 0:
                self._shared.append(_word(f"system-{self.salt}"))
                start = 1
            self._shared += filler(start, length - start)
        return self._shared[:length]

    def text(self, session: Session, index: int) -> str:
        """Turn ``index``'s prompt: ``cached_tokens + uncached_tokens`` words (at least 1)."""
        turn = session.turns[index]
        length = max(1, turn.cached_tokens + turn.uncached_tokens)
        stream = self._streams.get(session.session_id)
        if stream is None:
            first = session.turns[0]
            shared = min(first.cached_tokens, max(0, length - 1))
            mark = _word(f"{self.salt}:{session.session_id}")
            stream = self._system(shared) + [f"{mark}#{j}" for j in range(MARK_WORDS)]
            self._streams[session.session_id] = stream
        if len(stream) < length:
            stream += filler(len(stream), length - len(stream))
        return " ".join(stream[:length])

    def forget(self, session: Session) -> None:
        """The session is done: its stream is no longer needed."""
        self._streams.pop(session.session_id, None)
