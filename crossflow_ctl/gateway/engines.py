"""The engines behind the gateway: which are up, how loaded, which one a request goes to.

Load is what this gateway itself has in flight on each engine: requests, and for prefill the
uncached prompt tokens not yet through their prefill. A failed request takes its engine out at
once; the health loop (``GET /health`` every ``health_period_s``) puts it back when it answers
200 again, and takes out one that fails ``HEALTH_MISSES`` checks in a row (one slow answer from
a busy engine is not a dead engine: on real vLLM engines sharing 2 cores one check in a burst
timed out while every request was served).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
import structlog

from crossflow_ctl.gateway.settings import EngineEndpoint

log = structlog.get_logger()

Role = Literal["prefill", "decode"]
HEALTH_MISSES = 2


@dataclass
class Engine:
    endpoint: EngineEndpoint
    role: Role
    healthy: bool = True
    inflight: int = 0
    """Requests this gateway has open on the engine."""
    prefill_tokens: int = 0
    """Uncached prompt tokens sent here whose prefill is not done yet."""
    failures: int = 0
    health_misses: int = 0
    """Health checks failed in a row (HEALTH_MISSES of them take the engine out)."""
    generation: int = field(default=0)
    """Bumped each time the engine comes back: its cache starts empty (PrefixIndex.forget)."""

    @property
    def node_id(self) -> str:
        return self.endpoint.node_id

    @property
    def url(self) -> str:
        return self.endpoint.url


def candidates(engines: list[Engine], exclude: frozenset[str]) -> list[Engine]:
    """The engines to choose from: those up and not yet tried; when none is up, the ones out
    of rotation not yet tried (a health check is advice: a request is tried on a suspect engine
    before it is refused)."""
    untried = [e for e in engines if e.node_id not in exclude]
    return [e for e in untried if e.healthy] or untried


class EnginePool:
    def __init__(self, prefill: list[EngineEndpoint], decode: list[EngineEndpoint]) -> None:
        self.prefill = [Engine(e, "prefill") for e in prefill]
        self.decode = [Engine(e, "decode") for e in decode]
        self._by_id = {e.node_id: e for e in self.all()}
        self.booked_tokens = 0
        """Uncached tokens the admission queue has sent to prefill, not yet dispatched."""

    def replace(
        self, prefill: list[EngineEndpoint], decode: list[EngineEndpoint]
    ) -> tuple[list[Engine], list[Engine]]:
        """The engines are now these (discovery): new ones join (up until a check says not),
        gone ones leave, the rest keep their state. Returns (joined, left)."""
        joined: list[Engine] = []
        left: list[Engine] = []
        for role, wanted, current in (("prefill", prefill, self.prefill),
                                      ("decode", decode, self.decode)):  # fmt: skip
            keep = {e.node_id: e for e in current}
            kept: list[Engine] = []
            for endpoint in wanted:
                engine = keep.pop(endpoint.node_id, None)
                if engine is None or engine.endpoint != endpoint:
                    if engine is not None:
                        left.append(engine)
                    engine = Engine(endpoint, role)  # type: ignore[arg-type]
                    joined.append(engine)
                kept.append(engine)
            left.extend(keep.values())
            current[:] = kept
        self._by_id = {e.node_id: e for e in self.all()}
        return joined, left

    def all(self) -> Iterator[Engine]:
        yield from self.prefill
        yield from self.decode

    def get(self, node_id: str) -> Engine | None:
        return self._by_id.get(node_id)

    def pick_prefill(self, exclude: frozenset[str] = frozenset()) -> Engine | None:
        """The up prefill engine with the fewest prompt tokens in flight."""
        up = candidates(self.prefill, exclude)
        return min(up, key=lambda e: (e.prefill_tokens, e.inflight), default=None)

    def pick_decode(
        self, cached: Mapping[str, int], exclude: frozenset[str] = frozenset()
    ) -> Engine | None:
        """The up decode engine holding the longest cached prefix, the least busy among equals."""
        up = candidates(self.decode, exclude)
        return min(up, key=lambda e: (-cached.get(e.node_id, 0), e.inflight), default=None)

    def prefill_has_room(self, tokens: int, room_tokens: int) -> bool:
        """Whether the least-loaded prefill engine, with what was just booked for it, takes
        ``tokens`` more within ``room_tokens``; if so they are booked (one queue pass does not
        send a burst)."""
        best = self.pick_prefill()
        if best is None:
            return True  # nothing to wait for: the request will fail over at dispatch
        if best.prefill_tokens + self.booked_tokens + tokens > room_tokens and (
            best.prefill_tokens + self.booked_tokens > 0
        ):
            return False
        self.booked_tokens += tokens
        return True

    def mark_failed(self, engine: Engine, error: str) -> None:
        engine.failures += 1
        if engine.healthy:
            log.warning(
                "gateway.engine_down", node_id=engine.node_id, role=engine.role, error=error
            )
        engine.healthy = False

    def mark_up(self, engine: Engine) -> bool:
        """The engine answered its health check; True when it was out (it is back)."""
        if engine.healthy:
            return False
        engine.healthy = True
        engine.generation += 1
        log.info("gateway.engine_up", node_id=engine.node_id, role=engine.role)
        return True

    async def check_health(self, session: aiohttp.ClientSession, timeout_s: float) -> list[Engine]:
        """GET /health on every engine at once; returns the engines that came back."""

        async def probe(engine: Engine) -> str | None:
            try:
                async with session.get(
                    f"{engine.url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
                ) as resp:
                    return None if resp.status == 200 else f"health answered {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                return f"health check failed: {type(exc).__name__} {exc}".strip()

        engines = list(self.all())
        errors = await asyncio.gather(*(probe(e) for e in engines))
        back: list[Engine] = []
        for engine, error in zip(engines, errors, strict=True):
            if error is None:
                engine.health_misses = 0
                if self.mark_up(engine):
                    back.append(engine)
                continue
            engine.health_misses += 1
            if engine.health_misses >= HEALTH_MISSES:
                self.mark_failed(engine, error)
        return back


async def health_loop(
    pool: EnginePool,
    session: aiohttp.ClientSession,
    period_s: float,
    timeout_s: float,
    on_round: Callable[[list[Engine]], None],
) -> None:
    """Check every engine every ``period_s`` until cancelled; ``on_round`` after each round
    with the engines that came back (their caches start empty: what the gateway remembers of
    them is stale)."""
    while True:
        on_round(await pool.check_health(session, timeout_s=timeout_s))
        await asyncio.sleep(period_s)
