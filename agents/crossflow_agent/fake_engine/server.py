"""The fake engine's HTTP server (aiohttp): the API, the fake's own routes, the bootstrap site.

:class:`FakeEngineServer` serves one :class:`SyntheticEngine` in-process; tests start it on a
free port and speak to it over loopback exactly as to a real engine.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from crossflow_agent.fake_engine.control import Controls, Faults
from crossflow_agent.fake_engine.driver import EngineDriver
from crossflow_agent.fake_engine.errors import ApiError, ControlError
from crossflow_agent.fake_engine.openai_api import OpenAIApi
from crossflow_agent.fake_engine.pd import EngineProtocol, PdContext, PdRole
from crossflow_agent.fake_engine.prefix_cache import BLOCK_TOKENS, PrefixCache
from crossflow_agent.fake_engine.sglang_bootstrap import Rooms
from crossflow_agent.fake_engine.vllm_kv import PULL_PATH, KvExports
from crossflow_agent.sources.synthetic import SyntheticEngine

log = structlog.get_logger()

MAX_BODY_BYTES = 1024 * 1024
MAX_MODEL_LEN = 1_000_000
"""The engine's bound on a prompt's tokens."""
SHUTDOWN_GRACE_S = 2.0
API_PREFIXES = ("/v1/", "/tokenize", "/fake/")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _is_api(path: str) -> bool:
    return path.startswith(API_PREFIXES)


class FakeEngineServer:
    """Serves ``engine`` as a vLLM or SGLang engine would, in the given P/D role.

    ``port=0`` picks a free port (``.port``, ``.url`` once started); an SGLang prefill engine
    also serves its bootstrap site on ``bootstrap_port`` (0: a free one; ``.bootstrap_port``).
    ``model`` is the served model id of the API (the metrics' ``model_name`` label is the
    engine's own ``model_name``). ``advertise_host`` is the host decode engines reach this one at
    (default: ``host``, or 127.0.0.1 when that is a wildcard). ``kv_ttl_s``: how long exported KV
    (vLLM) or a ready room (SGLang) waits to be pulled; ``bootstrap_timeout_s``: how long an
    SGLang decode waits for its room; ``pull_timeout_s``: a vLLM decode's KV pull.
    ``prefix_cache_blocks``: the prefix cache's size in 16-token blocks (default: the KV cache's).
    """

    def __init__(
        self,
        engine: SyntheticEngine,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        protocol: EngineProtocol | str = EngineProtocol.SGLANG,
        pd_role: PdRole | str = PdRole.BOTH,
        model: str = "fake-model",
        max_model_len: int = 32_768,
        bootstrap_port: int = 0,
        engine_id: str | None = None,
        advertise_host: str | None = None,
        kv_ttl_s: float = 60.0,
        bootstrap_timeout_s: float = 30.0,
        pull_timeout_s: float = 30.0,
        prefix_cache_blocks: int | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        if not 2 <= max_model_len <= MAX_MODEL_LEN:
            raise ValueError(f"max_model_len must be in 2..{MAX_MODEL_LEN}")
        self.engine = engine
        self.protocol, self.pd_role = EngineProtocol(protocol), PdRole(pd_role)
        self.model = model
        self.engine_id = engine_id or uuid.uuid4().hex
        self._host, self._port, self._bootstrap_port_wanted = host, port, bootstrap_port
        wildcard = host in ("", "0.0.0.0", "::")
        self._advertise = advertise_host or ("127.0.0.1" if wildcard else host)
        self.faults = Faults()
        blocks = prefix_cache_blocks
        if blocks is None:
            blocks = engine.script.kv_total_tokens // BLOCK_TOKENS
        self.cache = PrefixCache(blocks)
        self.driver = EngineDriver(engine, self.cache)
        self.exports = KvExports(self.driver, self.engine_id, kv_ttl_s)
        self.rooms = Rooms(self.driver, kv_ttl_s)
        self._session: aiohttp.ClientSession | None = None
        pd = PdContext(
            protocol=self.protocol,
            role=self.pd_role,
            exports=self.exports,
            rooms=self.rooms,
            session=self._client,
            advertise=lambda: (self._advertise, self.port),
            pull_timeout_s=pull_timeout_s,
            bootstrap_timeout_s=bootstrap_timeout_s,
        )
        self.api = OpenAIApi(self.driver, pd, model=model, max_model_len=max_model_len)
        self.controls = Controls(engine, self.faults, self.protocol.value, self._extra_state)
        self._max_body = max_body_bytes
        self._closing = False
        self._runner: web.AppRunner | None = None
        self._bootstrap_runner: web.AppRunner | None = None

    # -- addresses -----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return _bound_port(self._runner)

    @property
    def url(self) -> str:
        host = f"[{self._advertise}]" if ":" in self._advertise else self._advertise
        return f"http://{host}:{self.port}"

    @property
    def bootstrap_port(self) -> int | None:
        """The SGLang bootstrap site's port (a prefill engine's), None where none is served."""
        return None if self._bootstrap_runner is None else _bound_port(self._bootstrap_runner)

    @property
    def serves_bootstrap(self) -> bool:
        return self.protocol is EngineProtocol.SGLANG and self.pd_role is PdRole.PREFILL

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application(
            client_max_size=self._max_body, middlewares=[self._errors, self._faults]
        )
        self.controls.add_routes(app)
        self.api.add_routes(app)
        app.router.add_post(PULL_PATH, self.exports.handle_pull)
        self._closing = False
        self.driver.start()
        try:
            self._runner = await _serve(app, self._host, self._port)
            if self.serves_bootstrap:
                boot = web.Application(
                    client_max_size=self._max_body, middlewares=[self._errors, self._faults]
                )
                boot.router.add_get("/health", self.controls.health)
                boot.router.add_post("/fake/bootstrap/pull", self.rooms.handle_pull)
                self._bootstrap_runner = await _serve(boot, self._host, self._bootstrap_port_wanted)
        except BaseException:
            await self.close()
            raise
        log.info(
            "fake_engine.serving",
            url=self.url,
            protocol=self.protocol.value,
            pd_role=self.pd_role.value,
            bootstrap_port=self.bootstrap_port,
        )

    async def close(self) -> None:
        """Stop serving: followed requests are aborted (their streams end with an error
        event), held KV is freed, then the sites close after at most a short grace."""
        self._closing = True
        await self.driver.close()
        self.exports.close()
        self.rooms.close()
        for runner in (self._bootstrap_runner, self._runner):
            if runner is not None:
                await runner.cleanup()
        self._runner = self._bootstrap_runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            # no connection cap: every SGLang decode may be long-polling its room at once
            connector = aiohttp.TCPConnector(limit=0)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        return self._session

    def _extra_state(self) -> dict[str, Any]:
        return {
            "protocol": self.protocol.value,
            "pd_role": self.pd_role.value,
            "engine_id": self.engine_id,
            "exported_kv": len(self.exports),
            "ready_rooms": len(self.rooms),
            "prefix_cache_blocks": len(self.cache),
        }

    # -- middlewares ---------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except (ApiError, ControlError) as exc:
            return exc.response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            messages = {
                404: f"no route {request.path}",
                405: f"{request.method} not allowed here",
                413: f"body over {self._max_body} bytes",
            }
            message = messages.get(exc.status, exc.reason)
            if _is_api(request.path):
                return ApiError(exc.status, message).response()
            return ControlError(exc.status, message).response()

    @web.middleware
    async def _faults(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if _is_api(request.path):
            if self._closing:
                raise ApiError(503, "engine is closing")
            if self.faults.down:
                raise ApiError(503, "engine is down (/control down)")
            if self.faults.fail_next > 0 and not request.path.startswith("/fake/"):
                self.faults.fail_next -= 1
                raise ApiError(500, "injected failure (/control fail_next)")
        return await handler(request)


async def _serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


def _bound_port(runner: web.AppRunner | None) -> int:
    if runner is None or not runner.addresses:
        raise RuntimeError("server not started")
    return int(runner.addresses[0][1])
