"""The OpenAI-shaped bodies the fake engine answers with (as vLLM and SGLang shape them)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass
class Reply:
    """One request's answer: its id, its creation time and its shape (chat or text)."""

    chat: bool
    model: str
    request_id: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(init=False)

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.chat else "cmpl"
        self.id = f"{prefix}-{self.request_id or uuid.uuid4().hex}"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(
        self, text: str, finish: str, use: dict[str, Any], extra: dict[str, Any]
    ) -> dict[str, Any]:
        """The unstreamed answer."""
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            body = self._head("text_completion")
        return {**body, "choices": [choice], "usage": use, **extra}

    def chunk(self, text: str, finish: str | None, *, role: bool = False) -> dict[str, Any]:
        """One streamed chunk: a piece of text (chat: the first carries the role only)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
            }
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, use: dict[str, Any]) -> dict[str, Any]:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use}
