"""The gateway end to end on real vLLM CPU engines: one prefill and two decode engines joined by
NixlConnector, an in-process broker whose decode nodes lease under the gateway's decode node ids,
and the real ``openai`` SDK sending a prefill-heavy burst through the gateway.

What is proven: every answer is complete; the borrowed prompts were prefilled on the decode
engines (their own ``vllm:prompt_tokens_by_source_total{source="local_compute"}``), the normal
ones on the prefill engine with their KV moved to a decode engine over NIXL
(``external_kv_transfer``); no reservation is left open at the broker; no request failed.

The broker runs on a frozen ManualClock with leases ingested directly (as tests/gateway does), so
which path a prompt takes depends only on the leases' room, never on the machine's speed. No
wall-clock duration is asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import pytest
from openai import AsyncOpenAI

from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.domain.clock import ManualClock, SystemClock
from crossflow_ctl.domain.models import NodeRole, ReservationState
from crossflow_ctl.gateway.app import GatewayServer
from crossflow_ctl.gateway.settings import EngineEndpoint, GatewaySettings
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.memory import MemoryStore
from tests.gateway.conftest import POLICY, behind, eventually, lend, metric
from tests.realengine.harness import (
    EngineFactory,
    VLLMEngine,
    counter_delta,
    distinct_free_ports,
    nixl_spec,
    warm_up_pd,
    words_prompt,
)

pytestmark = [pytest.mark.realengine, pytest.mark.slow, pytest.mark.timeout(1200)]

SLOTS = 2
"""Borrow slots each decode node's lease has."""
BURST = 12
MAX_TOKENS = 8
PROMPT_WORDS = 300


@dataclass
class RealCluster:
    prefill: VLLMEngine
    decode: list[VLLMEngine]
    broker: BrokerServer
    gateway: GatewayServer

    async def open_reservations(self) -> int:
        listed = await self.broker.broker.list_reservations()
        return sum(r.state is not ReservationState.RELEASED for r in listed)


@pytest.fixture(scope="module")
def gateway_engines(vllm_engine_factory: EngineFactory) -> list[VLLMEngine]:
    """This module's own engines (not the shared ones): a prefill and two decode engines, started
    together, each prefill -> decode pair warmed up (the first NIXL handshake may time out)."""
    ports = distinct_free_ports(3)
    engines = vllm_engine_factory.start_many(
        [
            nixl_spec("gw-prefill-1", ports[0]),
            nixl_spec("gw-decode-1", ports[1]),
            nixl_spec("gw-decode-2", ports[2]),
        ]
    )
    prefill, *decode = engines
    for engine in decode:
        warm_up_pd(prefill, engine)
    return engines


@pytest.fixture
async def real_cluster(gateway_engines: list[VLLMEngine]) -> AsyncIterator[RealCluster]:
    prefill, *decode = gateway_engines
    decode_ids = [f"decode-{i}" for i in range(1, len(decode) + 1)]
    settings_b = BrokerSettings(listen="127.0.0.1:0", policy=POLICY, stream_grace_s=1.0)
    broker = BrokerServer(settings_b, MemoryStore(seed=7), ManualClock(SystemClock().now_ms()))
    await broker.start()
    gateway: GatewayServer | None = None
    try:
        for node_id in decode_ids:
            await broker.broker.register(node_id, NodeRole.DECODE, "default", {})
            await lend(broker, node_id, SLOTS)
        await broker.broker.register("prefill-1", NodeRole.PREFILL, "default", {})
        await behind(broker, "prefill-1", 10**7)  # far behind: Admit borrows while there's room
        settings = GatewaySettings(
            listen="127.0.0.1:0",
            broker=f"127.0.0.1:{broker.port}",
            protocol="vllm",
            model=prefill.model,
            prefill=[EngineEndpoint(node_id="prefill-1", url=prefill.url)],
            decode=[
                EngineEndpoint(node_id=node_id, url=engine.url)
                for node_id, engine in zip(decode_ids, decode, strict=True)
            ],
            max_hold_ms=0,
            admit_timeout_ms=10_000,
            health_period_s=1.0,
        )
        gateway = GatewayServer(settings)
        await gateway.start()
        yield RealCluster(prefill, decode, broker, gateway)
    finally:
        if gateway is not None:
            with contextlib.suppress(Exception):
                await gateway.close()
        await broker.stop(grace_s=0.5)


def _prompt_tokens(engine: VLLMEngine, prompt: str) -> int:
    response = httpx.post(
        f"{engine.url}/tokenize", json={"model": engine.model, "prompt": prompt}, timeout=60
    )
    response.raise_for_status()
    return int(response.json()["count"])


async def _complete(client: AsyncOpenAI, model: str, prompt: str, stream: bool) -> dict[str, Any]:
    """One completion through the gateway: its text, finish reason and completion tokens."""
    if not stream:
        done = await client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
        )
        assert done.usage is not None
        return {
            "text": done.choices[0].text,
            "finish_reason": done.choices[0].finish_reason,
            "completion_tokens": done.usage.completion_tokens,
        }
    chunks = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    async for chunk in chunks:
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None, "the streamed answer carried no usage chunk"
    return {"text": text, "finish_reason": finish, "completion_tokens": usage.completion_tokens}


async def test_a_burst_through_the_gateway_borrows_and_moves_kv(real_cluster: RealCluster) -> None:
    cluster = real_cluster
    prefill, decode = cluster.prefill, cluster.decode
    prompts = [words_prompt(PROMPT_WORDS, seed=20 + i) for i in range(BURST)]
    assert len(set(prompts)) == BURST
    smallest = min(_prompt_tokens(prefill, p) for p in prompts)
    assert smallest > 256

    prefill_before = prefill.prompt_tokens_by_source()
    decode_before = [d.prompt_tokens_by_source() for d in decode]

    most_open = 0
    stop = asyncio.Event()

    async def watch_open() -> None:
        nonlocal most_open
        while not stop.is_set():
            most_open = max(most_open, await cluster.open_reservations())
            await asyncio.sleep(0.05)

    client = AsyncOpenAI(
        base_url=f"{cluster.gateway.url}/v1", api_key="none", max_retries=0, timeout=600.0
    )
    watcher = asyncio.create_task(watch_open())
    try:
        answers = await asyncio.gather(
            *(_complete(client, prefill.model, p, stream=i % 2 == 1) for i, p in enumerate(prompts))
        )
    finally:
        stop.set()
        await watcher
        await client.close()

    for i, answer in enumerate(answers):
        assert answer["text"], f"request {i}: empty answer {answer}"
        assert answer["finish_reason"] in ("length", "stop"), f"request {i}: {answer}"
        assert answer["completion_tokens"] == MAX_TOKENS or answer["finish_reason"] == "stop", (
            f"request {i}: {answer}"
        )

    url = cluster.gateway.url
    async with aiohttp.ClientSession() as s:
        name = "crossflow_gateway_requests_total"
        borrowed = await metric(s, url, name, path="borrowed")
        normal = await metric(s, url, name, path="normal")
        fallback = await metric(s, url, name, path="fallback")
        errors = await metric(s, url, name, path="error")
    assert errors == 0
    assert fallback == 0
    assert borrowed + normal == BURST
    assert borrowed >= 1 and normal >= 1, f"borrowed {borrowed}, normal {normal}"

    prefill_delta = counter_delta(prefill.prompt_tokens_by_source(), prefill_before)
    decode_delta = [
        counter_delta(d.prompt_tokens_by_source(), before)
        for d, before in zip(decode, decode_before, strict=True)
    ]
    decode_local = sum(d.get("local_compute", 0.0) for d in decode_delta)
    decode_external = sum(d.get("external_kv_transfer", 0.0) for d in decode_delta)
    print(
        f"paths: borrowed {borrowed:g}, normal {normal:g}; smallest prompt {smallest} tokens; "
        f"prefill sources {prefill_delta}; decode sources {decode_delta}; "
        f"most reservations open at once {most_open}"
    )
    # Borrowed prompts were prefilled by the decode engines themselves ...
    assert decode_local >= borrowed * smallest
    # ... normal ones on the prefill engine, their KV pulled over NIXL by a decode engine.
    assert prefill_delta.get("local_compute", 0.0) >= normal * smallest
    assert decode_external >= normal * smallest

    assert most_open <= SLOTS * len(decode)
    await eventually(lambda: _none_open(cluster), "every reservation released", limit_s=60.0)


async def _none_open(cluster: RealCluster) -> bool:
    return await cluster.open_reservations() == 0
