"""One hop to an engine, and relaying its answer to the client.

:class:`EngineFailed` means the engine did not answer usefully (no connection, a 5xx, a body
that is not what its protocol says) *before anything reached the client*: the request can still
go elsewhere. A 4xx is the client's fault and is relayed as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from crossflow_ctl.gateway.engines import Engine

RELAYED_HEADERS = ("Content-Type", "Cache-Control")


class EngineFailed(Exception):
    def __init__(self, engine: Engine, detail: str) -> None:
        super().__init__(f"{engine.role} engine {engine.node_id}: {detail}")
        self.engine = engine
        self.detail = detail


async def open_call(
    session: aiohttp.ClientSession,
    engine: Engine,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
) -> aiohttp.ClientResponse:
    """POST ``body`` to ``engine``; the response is open (headers read, body not). A 5xx or a
    failed connection raises EngineFailed (and closes what was opened)."""
    try:
        resp = await session.post(f"{engine.url}{path}", json=body, headers=headers)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise EngineFailed(engine, f"{type(exc).__name__}: {exc}") from None
    if resp.status >= 500:
        text = await _text(resp)
        resp.release()
        raise EngineFailed(engine, f"answered {resp.status}: {text[:200]}")
    return resp


async def call_json(
    session: aiohttp.ClientSession,
    engine: Engine,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
) -> tuple[int, dict[str, Any]]:
    """A whole unstreamed hop: status and JSON body (EngineFailed when it is not JSON)."""
    resp = await open_call(session, engine, path, body, headers)
    async with resp:
        try:
            data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise EngineFailed(engine, f"unreadable answer: {exc}") from None
    if not isinstance(data, dict):
        raise EngineFailed(engine, "answer is not a JSON object")
    return resp.status, data


async def relay(
    request: web.Request,
    engine: Engine,
    upstream: aiohttp.ClientResponse,
    on_first_byte: Callable[[int], None],
    extra_headers: Mapping[str, str] | None = None,
) -> web.StreamResponse:
    """Stream ``upstream``'s body to the client chunk by chunk as it arrives (SSE or not),
    with ``extra_headers`` added to the engine's.
    ``on_first_byte(status)`` runs when the first bytes arrive from the engine, before they
    are sent on with ``status``: for a streamed completion that is the first token, so the
    prompt's prefill is done.
    An engine failing before its first byte raises EngineFailed; after it, the client's
    response is cut (nothing else can be done: part of the answer is already out)."""
    headers = CIMultiDict[str]()
    for name in RELAYED_HEADERS:
        if name in upstream.headers:
            headers[name] = upstream.headers[name]
    headers.update(extra_headers or {})
    response = web.StreamResponse(status=upstream.status, headers=headers)
    chunks = upstream.content.iter_any()
    try:
        first = await anext(chunks, b"")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise EngineFailed(engine, f"failed before its first byte: {exc}") from None
    on_first_byte(upstream.status)
    await response.prepare(request)
    if first:
        await response.write(first)
    async for chunk in chunks:
        await response.write(chunk)
    await response.write_eof()
    return response


async def _text(resp: aiohttp.ClientResponse) -> str:
    try:
        return await resp.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return ""
