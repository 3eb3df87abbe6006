"""SGLang-style P/D: a prefill engine's bootstrap server hands rooms' KV to decode engines.

As SGLang's router (mini_lb) does it: the router adds ``bootstrap_host``, ``bootstrap_port``
(the prefill engine's bootstrap server) and ``bootstrap_room`` (an int) to a request and sends
it to a prefill engine and a decode engine at once; the client gets the decode engine's answer.
The prefill engine prefills the prompt (one token), then holds its KV as the room's, ready.
The decode engine asks the bootstrap server for the room and waits, bounded, until it is ready.
The fake's bootstrap server is a second aiohttp site on ``--bootstrap-port``::

    GET  /health                                  200
    POST /fake/bootstrap/pull {"bootstrap_room": int, "timeout_s"?: float (0..300, default 30)}
      200 {"bootstrap_room", "prompt_tokens": n}   the room's KV, now freed on the prefill side
      404 OpenAI-style error: the room was not ready within timeout_s

A room ready but not pulled within its TTL is freed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Annotated

import aiohttp
from aiohttp import web
from pydantic import Field, ValidationError
from yarl import URL

from crossflow_agent.fake_engine.driver import EngineDriver, Run
from crossflow_agent.fake_engine.errors import ApiError, bad_request
from crossflow_agent.fake_engine.schemas import Lenient

PULL_PATH = "/fake/bootstrap/pull"


class RoomPull(Lenient):
    bootstrap_room: Annotated[int, Field(ge=0, le=2**63 - 1)]
    timeout_s: Annotated[float, Field(ge=0.0, le=300.0)] = 30.0


@dataclass
class _Room:
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    prefilling: bool = False
    run: Run | None = None
    prompt_tokens: int = 0
    timer: asyncio.TimerHandle | None = None
    waiters: int = 0


class Rooms:
    """The prefill side: rooms being prefilled, ready, and waited for."""

    def __init__(self, driver: EngineDriver, ttl_s: float) -> None:
        self.driver, self.ttl_s = driver, ttl_s
        self._rooms: dict[int, _Room] = {}
        self._closed = False

    def __len__(self) -> int:
        return sum(1 for r in self._rooms.values() if r.run is not None)

    def open(self, room: int) -> None:
        """A prefill for ``room`` starts (400 when one is already under way or ready)."""
        entry = self._rooms.setdefault(room, _Room())
        if entry.prefilling or entry.run is not None:
            raise ApiError(400, f"bootstrap_room: {room} is already in use", "bootstrap_room")
        entry.prefilling = True

    def drop(self, room: int) -> None:
        """The prefill for ``room`` failed before its KV was ready."""
        entry = self._rooms.get(room)
        if entry is not None and entry.run is None:
            entry.prefilling = False
            if entry.waiters == 0:
                del self._rooms[room]

    def ready(self, room: int, run: Run, prompt_tokens: int) -> None:
        entry = self._rooms.setdefault(room, _Room())
        entry.run, entry.prompt_tokens, entry.prefilling = run, prompt_tokens, False
        entry.timer = asyncio.get_running_loop().call_later(self.ttl_s, self._expire, room, entry)
        entry.ready.set()

    def _expire(self, room: int, entry: _Room) -> None:
        if self._rooms.get(room) is entry:
            del self._rooms[room]
        if entry.run is not None:
            self.driver.release(entry.run)
            entry.run = None

    async def take(self, room: int, timeout_s: float) -> int | None:
        """Wait until ``room`` is ready, take its KV (freed here); its prompt tokens, or None."""
        entry = self._rooms.setdefault(room, _Room())
        entry.waiters += 1
        try:
            async with asyncio.timeout(timeout_s):
                await entry.ready.wait()
        except TimeoutError:
            return None
        finally:
            entry.waiters -= 1
            if entry.run is None and not entry.prefilling and entry.waiters == 0:
                self._rooms.pop(room, None)
        if entry.run is None or self._rooms.get(room) is not entry:
            return None  # taken by another waiter, or the server is closing
        del self._rooms[room]
        if entry.timer is not None:
            entry.timer.cancel()
        self.driver.release(entry.run)
        entry.run = None
        return entry.prompt_tokens

    def close(self) -> None:
        for room, entry in list(self._rooms.items()):
            if entry.timer is not None:
                entry.timer.cancel()
            self._expire(room, entry)
            entry.ready.set()  # waiters find no run: not ready

    async def handle_pull(self, request: web.Request) -> web.Response:
        try:
            body = RoomPull.model_validate(await request.json())
        except ValueError as exc:
            if isinstance(exc, ValidationError):
                raise bad_request(exc) from None
            raise ApiError(400, "body: not a JSON object", "body") from None
        tokens = await self.take(body.bootstrap_room, body.timeout_s)
        if tokens is None:
            raise ApiError(
                404,
                f"bootstrap room {body.bootstrap_room} not ready within {body.timeout_s:g} s",
                "bootstrap_room",
            )
        return web.json_response({"bootstrap_room": body.bootstrap_room, "prompt_tokens": tokens})


async def pull_room(
    session: aiohttp.ClientSession, host: str, port: int, room: int, timeout_s: float
) -> int:
    """The decode side: wait for ``room`` at the bootstrap server ``host:port``; its prompt
    tokens. Not ready in ``timeout_s``, or the server unreachable: 500."""
    url = URL.build(scheme="http", host=host, port=port, path=PULL_PATH)
    payload = {"bootstrap_room": room, "timeout_s": timeout_s}
    try:
        async with session.post(
            url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s + 10.0)
        ) as resp:
            data = await resp.json(content_type=None)
            status = resp.status
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ApiError(
            500, f"KV transfer failed: bootstrap server {host}:{port}: {exc!r}", "bootstrap_room"
        ) from None
    if status != 200 or not isinstance(data, dict) or "prompt_tokens" not in data:
        message = data.get("error", {}).get("message") if isinstance(data, dict) else None
        raise ApiError(500, f"KV transfer failed: {message or status}", "bootstrap_room")
    return int(data["prompt_tokens"])
