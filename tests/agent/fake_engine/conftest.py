"""Fake engines served in-process on loopback, and an SSE reader for their streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from crossflow_agent.fake_engine import FakeEngineServer
from crossflow_agent.sources.synthetic import EngineScript, SyntheticEngine
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS

MODEL, NODE = MODEL_PRESETS["gpt-oss-120b"], NODE_PRESETS["h200"]
LIMIT_S = 60.0
"""Only stops a hang; nothing here measures time."""


@contextlib.asynccontextmanager
async def serving(
    script: EngineScript | None = None, **kwargs: Any
) -> AsyncIterator[FakeEngineServer]:
    server = FakeEngineServer(SyntheticEngine(MODEL, NODE, script), **kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


def client(server: FakeEngineServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=LIMIT_S)


async def sse_events(response: httpx.Response) -> list[str]:
    """The data of every event of an SSE stream (comments skipped; multi-line data joined)."""
    events: list[str] = []
    data: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                events.append("\n".join(data))
                data = []
        elif line.startswith(":"):
            continue
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    assert not data, "stream ended inside an event"
    return events


def chunks(events: list[str]) -> list[dict[str, Any]]:
    """The JSON chunks of a finished OpenAI stream (its last event must be [DONE])."""
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


async def state(server: FakeEngineServer) -> dict[str, Any]:
    async with client(server) as http:
        return dict((await http.get("/state")).json())


async def eventually(check: Callable[[], Awaitable[Any]], what: str) -> Any:
    """Poll ``check`` until it returns something truthy (the limit only stops a hang)."""
    try:
        async with asyncio.timeout(LIMIT_S):
            while True:
                value = await check()
                if value:
                    return value
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(what) from None
