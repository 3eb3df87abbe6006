"""``crossflow-agent fake-engine``: a synthetic engine behind a small HTTP/1.1 server on loopback.

    GET  /metrics    SGLang-format Prometheus text (what a real engine serves)
    GET  /state      the engine's state as JSON
    GET  /healthz    "ok"
    POST /requests   JSON {"prompt_tokens", "output_tokens", "cached_tokens"?, "borrowed"?,
                     "count"?} -> 200 {"accepted": n, "queued_requests": q}; 400 names the field
    POST /control    JSON {"slowdown": x} (step time multiplier, 0.01..1000) -> 200 state

Keep-alive connections are served until the client closes them or stays idle; heads over
16 KiB and bodies over 1 MiB are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import structlog
from pydantic import ValidationError

from crossflow_agent.sources.synthetic import EngineRequest, SyntheticEngine
from crossflow_ctl.aio import cancel_and_wait

log = structlog.get_logger()

MAX_HEAD_BYTES = 16 * 1024
MAX_BODY_BYTES = 1024 * 1024
MAX_COUNT = 10_000
IDLE_TIMEOUT_S = 30.0
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Payload Too Large",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


class FakeEngineServer:
    """Serves one :class:`SyntheticEngine`; ``port=0`` picks a free port (see ``.port``)."""

    def __init__(self, engine: SyntheticEngine, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine = engine
        self._host, self._port = host, port
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("server not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self._host, self._port)
        log.info("fake_engine.serving", url=self.url)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        await cancel_and_wait(self._conns)
        await self._server.wait_closed()
        self._server = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE_TIMEOUT_S)
            except (TimeoutError, asyncio.IncompleteReadError):
                return
            except asyncio.LimitOverrunError:
                await _respond(writer, 431, b"head too large\n", "text/plain", close=True)
                return
            if len(head) > MAX_HEAD_BYTES:
                await _respond(writer, 431, b"head too large\n", "text/plain", close=True)
                return
            lines = head.decode("latin-1").split("\r\n")
            parts = lines[0].split()
            if len(parts) != 3:
                await _respond(writer, 400, b"bad request line\n", "text/plain", close=True)
                return
            method, target, version = parts
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    k, v = line.split(":", 1)
                    headers[k.strip().lower()] = v.strip()
            close = headers.get("connection", "").lower() == "close" or version == "HTTP/1.0"
            try:
                try:
                    body = await _read_body(reader, headers)
                except HttpError:
                    close = True  # the body was not read: the connection cannot be reused
                    raise
                status, payload, ctype = self._route(method, target.split("?", 1)[0], body)
            except HttpError as exc:
                status, ctype = exc.status, "application/json"
                payload = json.dumps({"error": exc.message}).encode()
            await _respond(writer, status, payload, ctype, close=close, head=method == "HEAD")
            if close:
                return

    def _route(self, method: str, path: str, body: bytes) -> tuple[int, bytes, str]:
        if path == "/metrics":
            _allow(method, "GET", "HEAD")
            return 200, self.engine.render().encode(), METRICS_CONTENT_TYPE
        if path == "/healthz":
            _allow(method, "GET", "HEAD")
            return 200, b"ok\n", "text/plain"
        if path == "/state":
            _allow(method, "GET")
            return 200, _json(self.engine.state()), "application/json"
        if path == "/requests":
            _allow(method, "POST")
            return 200, _json(self._add_requests(_parse_json(body))), "application/json"
        if path == "/control":
            _allow(method, "POST")
            return 200, _json(self._control(_parse_json(body))), "application/json"
        raise HttpError(404, f"no route {path}")

    def _add_requests(self, data: dict[str, Any]) -> dict[str, Any]:
        count = data.pop("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_COUNT:
            raise HttpError(400, f"count: must be an integer in 1..{MAX_COUNT}")
        try:
            request = EngineRequest.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "body"
            raise HttpError(400, f"{field}: {err['msg']}") from None
        accepted = 0
        try:
            for _ in range(count):
                self.engine.submit(request)
                accepted += 1
        except OverflowError as exc:
            if accepted == 0:
                raise HttpError(503, str(exc)) from None
        return {"accepted": accepted, "queued_requests": len(self.engine.waiting)}

    def _control(self, data: dict[str, Any]) -> dict[str, Any]:
        unknown = set(data) - {"slowdown"}
        if unknown:
            raise HttpError(400, f"{sorted(unknown)[0]}: unknown control")
        if "slowdown" in data:
            value = data["slowdown"]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise HttpError(400, "slowdown: must be a number")
            if not 0.01 <= float(value) <= 1000.0:
                raise HttpError(400, "slowdown: must be within 0.01..1000")
            self.engine.advance()  # time so far ran at the old speed
            self.engine.slowdown = float(value)
        return self.engine.state()


def _allow(method: str, *allowed: str) -> None:
    if method not in allowed:
        raise HttpError(405, f"{method} not allowed here")


def _json(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode()


def _parse_json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise HttpError(400, f"body: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise HttpError(400, "body: must be a JSON object")
    return data


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "transfer-encoding" in headers:
        raise HttpError(411, "chunked bodies are not supported; send Content-Length")
    raw = headers.get("content-length", "0")
    if not raw.isdigit():
        raise HttpError(400, "content-length: not a number")
    length = int(raw)
    if length > MAX_BODY_BYTES:
        raise HttpError(413, f"body over {MAX_BODY_BYTES} bytes")
    return await asyncio.wait_for(reader.readexactly(length), IDLE_TIMEOUT_S) if length else b""


async def _respond(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    ctype: str,
    *,
    close: bool,
    head: bool = False,
) -> None:
    lines = [
        f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}",
        f"Content-Type: {ctype}",
        f"Content-Length: {len(body)}",
        f"Connection: {'close' if close else 'keep-alive'}",
    ]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    if not head:
        writer.write(body)
    await writer.drain()
