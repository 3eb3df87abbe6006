"""A real HTTP server on loopback serving whatever metric text a test sets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import crossflow_agent

FIXTURES = Path(next(iter(crossflow_agent.__path__))) / "fixtures"


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


class MetricsServer:
    """GET /metrics -> ``text`` with ``status``, after ``delay_s``; one response per connection."""

    def __init__(self) -> None:
        self.text = ""
        self.status = 200
        self.delay_s = 0.0
        self.hits = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/metrics"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            for task in list(self._tasks):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.hits += 1
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            body = self.text.encode()
            writer.write(
                f"HTTP/1.1 {self.status} X\r\nContent-Type: text/plain; version=0.0.4\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


@pytest.fixture
async def metrics_server() -> AsyncIterator[MetricsServer]:
    server = MetricsServer()
    await server.start()
    try:
        yield server
    finally:
        await server.close()
