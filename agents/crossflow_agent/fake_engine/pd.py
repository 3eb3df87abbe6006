"""Where a request's prompt KV comes from, by protocol and P/D role.

``--protocol vllm``:
  - ``kv_transfer_params.do_remote_decode`` (prefill or both): prefill, one token, hold the KV
    as an export; the answer carries the ``kv_transfer_params`` a decode engine needs.
  - ``kv_transfer_params.do_remote_prefill`` (decode or both): pull the KV from the prefill
    engine first (fails: 500), then decode with the prompt counted ``external_kv_transfer``.
  - neither: prefill locally (``local_compute``, cached blocks ``local_cache_hit``).
``--protocol sglang``:
  - prefill: ``bootstrap_room`` required; prefill, one token, hold the KV as the room's.
  - decode with ``bootstrap_room``: wait for the room at ``bootstrap_host:bootstrap_port``
    (bounded; not ready: 500), then decode with the prompt counted as transferred.
  - decode without, and both: prefill locally (both ignores the bootstrap fields).
A pulled prompt's token count must match this engine's count of the prompt (else 500: the two
engines did not see the same prompt).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from crossflow_agent.fake_engine.driver import Run
from crossflow_agent.fake_engine.errors import ApiError
from crossflow_agent.fake_engine.schemas import GenerateParams
from crossflow_agent.fake_engine.sglang_bootstrap import Rooms, pull_room
from crossflow_agent.fake_engine.vllm_kv import PARAM, KvExports, pull_remote_kv


class EngineProtocol(enum.StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"


class PdRole(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


@dataclass
class Placement:
    """How one request runs here: what the engine generates and where its prompt KV is from."""

    output_tokens: int
    kv_transferred: bool = False
    keep_kv: bool = False
    on_held: Callable[[Run], dict[str, Any]] | None = None
    """Called once the job holds its KV (it is handed over then); extra top-level answer fields."""
    on_failed: Callable[[], None] | None = None
    """Called when the request ends without reaching on_held."""

    @property
    def local(self) -> bool:
        return not self.kv_transferred


@dataclass
class PdContext:
    protocol: EngineProtocol
    role: PdRole
    exports: KvExports
    rooms: Rooms
    session: Callable[[], aiohttp.ClientSession]
    advertise: Callable[[], tuple[str, int]]
    """The host and port decode engines reach this engine's API at."""
    pull_timeout_s: float
    bootstrap_timeout_s: float

    async def place(self, params: GenerateParams, prompt_tokens: int) -> Placement:
        if self.protocol is EngineProtocol.VLLM:
            return await self._place_vllm(params, prompt_tokens)
        return await self._place_sglang(params, prompt_tokens)

    async def _place_vllm(self, params: GenerateParams, prompt_tokens: int) -> Placement:
        kv = params.kv_transfer_params
        if kv is not None and kv.do_remote_decode:
            if self.role is PdRole.DECODE:
                raise ApiError(
                    400,
                    f"{PARAM}.do_remote_decode: this is a decode engine",
                    f"{PARAM}.do_remote_decode",
                )
            if params.stream:
                raise ApiError(400, "stream: do_remote_decode needs stream=false", "stream")

            def export(run: Run) -> dict[str, Any]:
                host, port = self.advertise()
                return {PARAM: self.exports.export(run, prompt_tokens, host, port)}

            return Placement(output_tokens=1, keep_kv=True, on_held=export)
        if kv is not None and kv.do_remote_prefill:
            if self.role is PdRole.PREFILL:
                raise ApiError(
                    400,
                    f"{PARAM}.do_remote_prefill: this is a prefill engine",
                    f"{PARAM}.do_remote_prefill",
                )
            pulled = await pull_remote_kv(self.session(), kv, self.pull_timeout_s)
            _same_prompt(pulled, prompt_tokens, PARAM)
            return Placement(output_tokens=params.output_tokens, kv_transferred=True)
        return Placement(output_tokens=params.output_tokens)

    async def _place_sglang(self, params: GenerateParams, prompt_tokens: int) -> Placement:
        room = params.bootstrap_room
        if self.role is PdRole.PREFILL:
            if room is None:
                raise ApiError(
                    400, "bootstrap_room: required on a prefill engine", "bootstrap_room"
                )
            self.rooms.open(room)

            def ready(run: Run) -> dict[str, Any]:
                self.rooms.ready(room, run, prompt_tokens)
                return {}

            return Placement(
                output_tokens=1,
                keep_kv=True,
                on_held=ready,
                on_failed=lambda: self.rooms.drop(room),
            )
        if self.role is PdRole.DECODE and room is not None:
            if params.bootstrap_host is None or params.bootstrap_port is None:
                field = "bootstrap_host" if params.bootstrap_host is None else "bootstrap_port"
                raise ApiError(400, f"{field}: required with bootstrap_room", field)
            pulled = await pull_room(
                self.session(),
                params.bootstrap_host,
                params.bootstrap_port,
                room,
                self.bootstrap_timeout_s,
            )
            _same_prompt(pulled, prompt_tokens, "bootstrap_room")
            return Placement(output_tokens=params.output_tokens, kv_transferred=True)
        return Placement(output_tokens=params.output_tokens)


def _same_prompt(pulled: int, prompt_tokens: int, param: str) -> None:
    if pulled != prompt_tokens:
        raise ApiError(
            500,
            f"KV transfer failed: the prefill engine holds {pulled} prompt tokens, "
            f"this request's prompt has {prompt_tokens}",
            param,
        )
