"""Counting a request's prompt tokens with the served model's own tokenizer.

The engines serve it: vLLM's and SGLang's ``POST /tokenize`` take the same ``prompt`` or chat
``messages`` as the completion routes and answer the token ids (a chat request is counted after
the model's chat template, as the engine will see it). The gateway asks an up engine of the
pool, the least busy prefill engine first. Any failure answers None: the request then takes the
normal path without asking Admit (a prompt whose size is unknown is never borrowed).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import structlog

from crossflow_ctl.gateway.engines import Engine

log = structlog.get_logger()

CHAT_FIELDS = (
    "messages",
    "add_generation_prompt",
    "chat_template",
    "tools",
    "continue_final_message",
)


def tokenize_body(route: str, body: dict[str, Any], model: str) -> dict[str, Any] | None:
    """The /tokenize body for a completion request, or None when its prompt is not a single
    string or a chat (token-id prompts and batches are not borrowed: no count is asked)."""
    if route == "chat":
        out: dict[str, Any] = {"model": model}
        for key in CHAT_FIELDS:
            if key in body:
                out[key] = body[key]
        out.setdefault("add_generation_prompt", True)
        return out if isinstance(body.get("messages"), list) else None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return {"model": model, "prompt": prompt}
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return {"model": model, "prompt": prompt[0]}
    return None


async def tokenize(
    session: aiohttp.ClientSession,
    engine: Engine,
    body: dict[str, Any],
    timeout_s: float,
) -> list[int] | None:
    """The prompt's token ids as ``engine`` counts them; None on any failure."""
    try:
        async with session.post(
            f"{engine.url}/tokenize", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                log.debug("gateway.tokenize_refused", node_id=engine.node_id, status=resp.status)
                return None
            data = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        log.debug("gateway.tokenize_failed", node_id=engine.node_id, error=str(exc))
        return None
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        return None
    return tokens
