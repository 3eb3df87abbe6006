"""Synthetic agentic traffic: drifting Poisson sessions, tool-result bursts, growing prefixes.

Model (every draw from one seeded ``random.Random``, so the same seed gives the same trace):

* Sessions start as a Poisson process whose rate drifts: ``rate(t) = base * exp(w(t))`` with
  ``w`` a mean-reverting random walk updated each minute (sampled by thinning), so R and load
  swing at minute scale without a time-of-day pattern.
* A session is a chain of turns. Turn 0 carries a system prompt and task (uncached); each later
  turn's prompt is the previous prompt + previous output + a tool result, and its cached prefix
  is the previous prompt + output (prefix caching grows with the session).
* After a turn the agent thinks (lognormal, p50 ``think_p50_s``); with probability
  ``burst_p`` the tool result releases ``burst_size`` dependent requests at once (parallel
  sub-agent calls sharing the session prefix), which all wait on the same turn.
"""

from __future__ import annotations

import math
import random
from typing import Annotated

from pydantic import Field

from crossflow_ctl.domain.models import Frozen
from crossflow_ctl.sim.traces import Trace, TraceRequest


class AgenticSpec(Frozen):
    duration_s: Annotated[float, Field(gt=0, le=86_400)] = 3600.0
    sessions_per_min: Annotated[float, Field(gt=0, le=10_000)] = 6.0
    """Mean session starts per minute (6: a moderately loaded 2P4D H200 cluster at 1x)."""
    drift_sigma: Annotated[float, Field(ge=0, le=3)] = 0.35
    """Per-minute step of the log-rate random walk."""
    drift_revert: Annotated[float, Field(ge=0, le=1)] = 0.1
    turns_mean: Annotated[float, Field(ge=1, le=1000)] = 12.0
    system_prompt_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 6000
    task_tokens_p50: Annotated[int, Field(ge=1, le=1_000_000)] = 1500
    tool_result_tokens_p50: Annotated[int, Field(ge=1, le=1_000_000)] = 1200
    tool_result_sigma: Annotated[float, Field(ge=0, le=5)] = 1.2
    output_tokens_p50: Annotated[int, Field(ge=1, le=100_000)] = 250
    output_sigma: Annotated[float, Field(ge=0, le=5)] = 0.8
    think_p50_s: Annotated[float, Field(ge=0, le=3600)] = 6.0
    burst_p: Annotated[float, Field(ge=0, le=1)] = 0.15
    burst_size_max: Annotated[int, Field(ge=1, le=64)] = 6
    max_context_tokens: Annotated[int, Field(ge=1024, le=10_000_000)] = 128_000


def _lognormal(rng: random.Random, p50: float, sigma: float) -> float:
    return p50 * math.exp(rng.gauss(0.0, sigma))


def _session_starts(spec: AgenticSpec, rng: random.Random) -> list[float]:
    base = spec.sessions_per_min / 60.0
    minutes = math.ceil(spec.duration_s / 60.0)
    w, logrates = 0.0, []
    for _ in range(minutes):
        logrates.append(w)
        w += -spec.drift_revert * w + rng.gauss(0.0, spec.drift_sigma)
    peak = base * math.exp(max(logrates))
    starts: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= spec.duration_s:
            return starts
        rate = base * math.exp(logrates[min(int(t // 60), minutes - 1)])
        if rng.random() < rate / peak:
            starts.append(t)


def generate_agentic(spec: AgenticSpec | None = None, seed: int = 0) -> Trace:
    """A closed-loop agentic trace (see module docstring)."""
    spec = spec or AgenticSpec()
    rng = random.Random(seed)
    reqs: list[TraceRequest] = []
    for n, start in enumerate(_session_starts(spec, rng)):
        sid = f"syn{n:05d}"
        turns = max(1, round(rng.expovariate(1.0 / spec.turns_mean)))
        prompt = spec.system_prompt_tokens + int(_lognormal(rng, spec.task_tokens_p50, 0.7))
        cached = 0
        prev: int | None = None
        for _ in range(turns):
            out = max(1, int(_lognormal(rng, spec.output_tokens_p50, spec.output_sigma)))
            think = _lognormal(rng, spec.think_p50_s, 1.0)
            req = TraceRequest(
                input_tokens=prompt,
                output_tokens=out,
                cached_tokens=min(cached, prompt - 1),
                arrival_s=start if prev is None else 0.0,
                after_finish=prev,
                delay_s=0.0 if prev is None else think,
                session=sid,
            )
            idx = len(reqs)
            reqs.append(req)
            if prev is not None and rng.random() < spec.burst_p:
                # The tool result releases parallel calls sharing this turn's prefix.
                for _ in range(rng.randint(1, spec.burst_size_max)):
                    extra = int(_lognormal(rng, spec.tool_result_tokens_p50, 1.0))
                    reqs.append(
                        TraceRequest(
                            input_tokens=req.input_tokens + extra,
                            output_tokens=max(1, int(_lognormal(rng, spec.output_tokens_p50, 1))),
                            cached_tokens=req.cached_tokens,
                            after_finish=prev,
                            delay_s=think,
                            session=f"{sid}.b{idx}",
                        )
                    )
            tool = int(_lognormal(rng, spec.tool_result_tokens_p50, spec.tool_result_sigma))
            cached = prompt + out
            prompt = prompt + out + max(1, tool)
            prev = idx
            if prompt > spec.max_context_tokens:
                break
    return Trace(name=f"agentic-seed{seed}", requests=tuple(reqs))
