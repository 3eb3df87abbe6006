"""The fake engine's tokenizer and its deterministic output text.

One token per whitespace-separated word: ``zlib.crc32(word.encode()) % 32000``. Chat messages are
rendered by a fixed template, ``"<|{role}|>\\n{content}\\n"`` per message and then
``"<|assistant|>\\n"``, and tokenized the same way. There are no special tokens.

Output token ``i`` (from 0) is the word ``w{i}``; the text of ``n`` tokens is ``"w0 w1 ... w{n-1}"``
(token ``i`` > 0 carries its leading space, so streamed pieces concatenate to the same text).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Sequence
from typing import Protocol

VOCAB_SIZE = 32_000
OUTPUT_WORD = re.compile(r"w(0|[1-9][0-9]{0,8})")


class Message(Protocol):
    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...


def token_id(word: str) -> int:
    return zlib.crc32(word.encode()) % VOCAB_SIZE


def tokenize(text: str) -> list[int]:
    return [token_id(word) for word in text.split()]


def render_chat(messages: Iterable[Message]) -> str:
    return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"


def output_piece(i: int) -> str:
    return f"w{i}" if i == 0 else f" w{i}"


def output_text(count: int) -> str:
    return "".join(output_piece(i) for i in range(count))


def stop_index(stops: Sequence[str], max_tokens: int) -> int | None:
    """The first output position ``k`` < ``max_tokens`` whose word ``w{k}`` is a stop string."""
    found = [int(m[1]) for s in stops if (m := OUTPUT_WORD.fullmatch(s))]
    found = [k for k in found if k < max_tokens]
    return min(found) if found else None
