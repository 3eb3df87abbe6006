"""End to end over real HTTP: a fake vLLM engine whose true step model is not the agent's prior,
driven by requests on its ``/requests`` route, and an agent calibrating online from the engine's
own ``/metrics``. The fitted constants move from the wrong prior toward the engine's truth, and
the lease's predicted step times come closer to the engine's.

Counts calibration periods, never wall-clock time; the bounds are generous (the engine runs in
real time on a loaded machine, and a window's counters are what the engine did in it, however
long it took)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator

import httpx
import pytest

from crossflow_agent.agent import Agent
from crossflow_agent.fake_engine import FakeEngineServer
from crossflow_agent.settings import AgentSettings
from crossflow_agent.sources.http import PrometheusSource
from crossflow_agent.sources.synthetic import EngineScript, SyntheticEngine
from crossflow_agent.sources.vllm import VLLMReader
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS, NodeProfile, roofline
from crossflow_ctl.domain.online_calibration import Using
from crossflow_ctl.domain.step_fit import FitStatus, predicted_step_s

MODEL = MODEL_PRESETS["gpt-oss-120b"]
PRIOR = NODE_PRESETS["h200"]
TRUTH = PRIOR.model_copy(
    update={
        "name": "truth",
        "flops_per_s": 2.5e14,
        "hbm_bytes_per_s": 1.6e12,
        "host_step_s": 0.004,
        "step_overhead_s": 0.001,
    }
)
"""The engine's true step model: 2.8x slower compute, 2.6x slower memory and 3x lighter host work
than the agent's prior (the h200 preset)."""
PERIODS = 14


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngineServer]:
    script = EngineScript(chunk_tokens=1024, max_running=64)
    server = FakeEngineServer(SyntheticEngine(MODEL, TRUTH, script), protocol="vllm")
    await server.start()
    try:
        yield server
    finally:
        await server.close()


async def drive(http: httpx.AsyncClient, url: str, stop: asyncio.Event) -> None:
    """Requests of varied prompts and outputs, in phases of light, heavy and middling load, so
    the windows see different batches and shares of chunked steps (seeded)."""
    rng = random.Random(31)
    k = 0
    while not stop.is_set():
        rate = (1.0, 4.0, 2.0)[(k // 40) % 3]  # requests a second, by phase of 40 ticks
        if rng.random() < rate * 0.1:
            body = {
                "prompt_tokens": rng.choice([100, 500, 1000, 2000]),
                "output_tokens": rng.choice([50, 150, 400]),
            }
            await http.post(f"{url}/requests", json=body)
        k += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


def log_distance(node: NodeProfile, name: str) -> float:
    return abs(math.log(getattr(node, name) / getattr(TRUTH, name)))


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_agent_calibrates_toward_the_engines_truth(engine: FakeEngineServer) -> None:
    settings = AgentSettings(
        node_id="calibrating-1",
        source="vllm",
        metrics_url=f"{engine.url}/metrics",
        period_ms=100,
        calibration={"window_s": 1.0},
        lease={"itl_slo_ms": 500.0},
    )
    stop = asyncio.Event()
    async with httpx.AsyncClient(trust_env=False, timeout=5.0) as http:
        source = PrometheusSource(settings.metrics_url, VLLMReader(), client=http)
        agent = Agent(settings, source, MODEL, PRIOR)
        cal = agent.calibration
        assert cal is not None and agent.profile is PRIOR
        load = asyncio.create_task(drive(http, engine.url, stop))
        try:
            while cal.periods < PERIODS:
                lease = await agent.tick()
                assert lease is not None
                await asyncio.sleep(settings.period_ms / 1000)
        finally:
            stop.set()
            await load
    state = cal.state()
    fit = state.fit
    assert fit is not None and fit.status is FitStatus.FITTED, fit
    assert state.using in (Using.FITTED, Using.MOVING)
    assert state.windows >= 8  # busy windows: the load kept the engine stepping
    # the windows say the prior is far off, and the fit explains them several times better
    assert fit.prior_error > 0.25
    assert fit.error < fit.prior_error / 2
    # both rates carry most of the step time: each has moved from the prior toward the truth
    for name in ("flops_per_s", "hbm_bytes_per_s"):
        assert log_distance(agent.profile, name) < 0.6 * log_distance(PRIOR, name), name
    # the measured mean step (the engine's ITL) of the last windows, as each profile predicts it
    for _, win in list(cal.windows)[-4:]:
        measured = win.itl_s
        prior_miss = abs(predicted_step_s(MODEL, PRIOR, win) - measured)
        fitted_miss = abs(predicted_step_s(MODEL, agent.profile, win) - measured)
        assert fitted_miss < prior_miss
    # the last lease's chunk at the engine's batch and context: its predicted step time against
    # the engine's (the truth's step model is what the engine's steps take)
    capacity = agent._capacity
    assert capacity is not None
    shape = (capacity.batch, capacity.context_tokens, 1024)
    truth_s = roofline(MODEL, TRUTH).step_s(*shape)
    assert abs(roofline(MODEL, agent.profile).step_s(*shape) - truth_s) < abs(
        roofline(MODEL, PRIOR).step_s(*shape) - truth_s
    )
