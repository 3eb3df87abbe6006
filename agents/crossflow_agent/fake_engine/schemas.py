"""Request bodies of the fake engine's API, validated with pydantic as vLLM's are.

Unknown fields are ignored (``temperature``, ``top_p``, ``logprobs``, ... are accepted and have
no effect), as real engines accept the OpenAI API's many knobs. The fields read are validated
and a bad one is answered 400 naming it (:func:`.errors.bad_request`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from crossflow_agent.fake_engine.tokenizer import VOCAB_SIZE

MAX_TOKENS_LIMIT = 1_000_000


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


def _text_parts(value: Any) -> Any:
    """Chat content as one string: a list of ``{"type": "text", "text"}`` parts joined by
    newlines; None (an assistant turn with tool calls) is empty."""
    if value is None:
        return ""
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError("content parts must be {'type': 'text', 'text': ...}")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError("a text part needs a string 'text'")
            texts.append(text)
        return "\n".join(texts)
    return value


def _one_or_many(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


class ChatMessage(Lenient):
    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: Annotated[str, BeforeValidator(_text_parts)] = ""


class StreamOptions(Lenient):
    include_usage: bool = False


class KvTransferParams(Lenient):
    """vLLM's ``kv_transfer_params`` (NIXL-style connectors); other keys are kept and ignored."""

    model_config = ConfigDict(extra="allow", frozen=True)

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    remote_request_id: str | None = None

    @model_validator(mode="after")
    def _one_direction(self) -> KvTransferParams:
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError("do_remote_decode and do_remote_prefill are exclusive")
        return self


class GenerateParams(Lenient):
    """What completions and chat completions share."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[list[str], BeforeValidator(_one_or_many)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    kv_transfer_params: KvTransferParams | None = None
    bootstrap_host: Annotated[str, Field(min_length=1, max_length=255)] | None = None
    bootstrap_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    bootstrap_room: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None

    @property
    def output_tokens(self) -> int:
        """``max_tokens`` (or ``max_completion_tokens``), 16 when neither is given."""
        return self.max_tokens or self.max_completion_tokens or 16

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerateParams):
    prompt: str | list[int]
    """One prompt: text, or token ids."""

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            if any(not 0 <= t < VOCAB_SIZE for t in value):
                raise ValueError(f"token ids must be in 0..{VOCAB_SIZE - 1}")
            return value
        raise ValueError("must be a string or a list of token ids (one prompt; no batches)")


class ChatRequest(GenerateParams):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]


class TokenizeRequest(Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    """Accepted; the fake tokenizer has no special tokens."""
