"""A scripted engine: a decode/prefill server simulated with the roofline step-time model.

Its state evolves with (monotonic) time and with the requests added to it. Each engine step
decodes one token for every running request and prefills up to ``chunk_tokens`` uncached prompt
tokens of the admitted requests, FIFO; the step lasts ``step_time_s`` of the capacity model
times ``slowdown`` (a knob to push ITL past an SLO on purpose). A decode engine that lends
(``itl_budget_ms`` set) sizes its prefill chunks as the lease model assumes: one prompt a step,
the chunk that keeps the step within the ITL budget at the current batch and the prompt's prefix
(:class:`~crossflow_ctl.domain.lending.ChunkSizer`, as the simulator's decode servers).
Admission reserves a request's prompt + output tokens of KV, so used never exceeds total.
Optional background arrivals at a fixed rate give a steady load.

It serves as a source in-process (:class:`SyntheticSource`) and renders itself as SGLang-format
Prometheus text (:meth:`SyntheticEngine.render`), which ``crossflow-agent fake-engine`` serves
over HTTP for the demo and the end-to-end tests, scraped by the real SGLang reader.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from pydantic import Field, model_validator

from crossflow_agent.sources.http import read_text
from crossflow_agent.sources.prom import Window
from crossflow_agent.sources.sglang import SGLangReader
from crossflow_ctl.domain.capacity import (
    ModelSpec,
    NodeProfile,
    StepShape,
    roofline,
    step_time_s,
)
from crossflow_ctl.domain.clock import Clock, SystemClock
from crossflow_ctl.domain.lease_credits import LeaseSettings
from crossflow_ctl.domain.lending import ChunkSizer
from crossflow_ctl.domain.models import Frozen
from crossflow_ctl.domain.telemetry import EngineSnapshot

ITL_BUCKETS_S = (  # SGLang's default --bucket-inter-token-latency
    0.002,
    0.004,
    0.006,
    0.008,
    0.010,
    0.015,
    0.020,
    0.025,
    0.030,
    0.035,
    0.040,
    0.060,
    0.080,
    0.100,
    0.200,
    0.400,
    0.600,
    0.800,
    1.0,
    2.0,
    5.0,
)
MAX_STEPS_PER_ADVANCE = 20_000
MAX_QUEUE = 100_000


class EngineRequest(Frozen):
    """A request added to the synthetic engine."""

    prompt_tokens: Annotated[int, Field(ge=1, le=1_000_000)]
    output_tokens: Annotated[int, Field(ge=1, le=1_000_000)]
    cached_tokens: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    """Prefix tokens already in cache: they cost no prefill."""
    borrowed: bool = False
    """Prompt work borrowed from the prefill pool (counted apart in the JSON state)."""

    @model_validator(mode="after")
    def _cached_within_prompt(self) -> EngineRequest:
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("cached_tokens must not exceed prompt_tokens")
        return self


class EngineScript(Frozen):
    """The engine's fixed shape and its background load."""

    kv_total_tokens: Annotated[int, Field(gt=0, le=100_000_000)] = 400_000
    max_running: Annotated[int, Field(gt=0, le=10_000)] = 256
    chunk_tokens: Annotated[int, Field(gt=0, le=1_000_000)] = 2048
    background_rps: Annotated[float, Field(ge=0.0, le=10_000.0)] = 0.0
    background: EngineRequest = EngineRequest(prompt_tokens=2000, output_tokens=300)
    kv_transfer_gb_s: Annotated[float, Field(ge=0.0, le=10_000.0)] = 0.0
    itl_buckets_s: tuple[float, ...] = ITL_BUCKETS_S
    """Upper bounds of the ITL histogram (SGLang's ``--bucket-inter-token-latency``; its
    default). An agent reads the window's p99 by interpolating inside a bucket, so a step that
    falls in a bucket holding the SLO reads as up to that bucket's upper bound: with SGLang's
    bounds a 45 ms step reads as up to 60 ms against a 50 ms SLO. Give a bound at the SLO."""
    itl_budget_ms: Annotated[float, Field(gt=0.0, le=10_000.0)] | None = None
    """A decode engine that lends: each step prefills one prompt, in the best chunk (grid of
    ``LeaseSettings.chunk_step_tokens`` up to ``max_chunk_tokens``) whose step stays within this
    budget at the current batch and the prompt's prefix, what the agent's lease prices borrowed
    prefill at (its ``itl_slo_ms x slo_margin``, 45 ms by default). None: ``chunk_tokens`` a
    step, FIFO across prompts (a prefill server). With a fixed 2048-token chunk every step that
    carried borrowed prefill took 51-104 ms on gpt-oss-120b/h200, over a 50 ms SLO, and the
    demo's decode leases flapped: zeroed for ITL, cleared, zeroed again, about once a second."""

    @model_validator(mode="after")
    def _buckets_increase(self) -> EngineScript:
        b = self.itl_buckets_s
        if not 0 < len(b) <= 64 or b[0] <= 0 or any(x >= y for x, y in itertools.pairwise(b)):
            raise ValueError("itl_buckets_s: 1 to 64 increasing bounds above 0 seconds")
        if not all(math.isfinite(x) for x in b):
            raise ValueError("itl_buckets_s: bounds must be finite (+Inf is implied)")
        return self


@dataclass
class _Req:
    spec: EngineRequest
    prefilled: int = 0
    generated: int = 0

    @property
    def uncached_left(self) -> int:
        return self.spec.prompt_tokens - self.spec.cached_tokens - self.prefilled

    @property
    def kv_now(self) -> int:
        return self.spec.cached_tokens + self.prefilled + self.generated

    @property
    def kv_reserved(self) -> int:
        return self.spec.prompt_tokens + self.spec.output_tokens


class SyntheticEngine:
    def __init__(
        self,
        model: ModelSpec,
        node: NodeProfile,
        script: EngineScript | None = None,
        *,
        model_name: str = "synthetic",
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model, self.node = model, node
        self.script = script or EngineScript()
        self.model_name = model_name
        self.slowdown = 1.0
        self._monotonic = monotonic
        self._t = monotonic()
        self._next_background = self._t
        self.waiting: deque[_Req] = deque()
        self.prefilling: list[_Req] = []
        self.running: list[_Req] = []
        self.reserved_kv = 0
        self.counters = {
            "prompt": 0,
            "generation": 0,
            "prefill_compute": 0,
            "prefill_cache": 0,
            "decode": 0,
            "requests": 0,
            "steps": 0,
        }
        self.itl_counts = [0] * (len(self.script.itl_buckets_s) + 1)
        self.itl_sum_s = 0.0
        self._last_gen_tps = 0.0
        self._sizer: ChunkSizer | None = None
        self._sized = 0
        """The sizer's last chunk (seeds its next search; changes no answer)."""
        if self.script.itl_budget_ms is not None:
            grid = LeaseSettings()
            self._sizer = ChunkSizer(
                roofline(model, node),
                self.script.itl_budget_ms / 1000.0,
                grid.chunk_step_tokens,
                grid.max_chunk_tokens,
            )

    # -- input ---------------------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> None:
        """Queue a request (after bringing the state up to now)."""
        self.advance()
        if len(self.waiting) >= MAX_QUEUE:
            raise OverflowError(f"queue is full ({MAX_QUEUE} requests)")
        self.waiting.append(_Req(request))
        self._admit()

    # -- simulation ----------------------------------------------------------------------------

    def advance(self) -> None:
        """Run engine steps until simulated time reaches now."""
        now = self._monotonic()
        steps = 0
        while self._t < now and steps < MAX_STEPS_PER_ADVANCE:
            self._arrivals(self._t)
            dt = self._step()
            steps += 1
            if dt <= 0:  # idle: jump to the next arrival or to now
                nxt = self._next_background if self.script.background_rps > 0 else now
                self._t = max(self._t, min(now, nxt))
                if self._t >= now:
                    break
                continue
            self._t += dt
        if self._t < now:  # gave up catching up: drop the backlog of time
            self._t = now

    def _arrivals(self, at: float) -> None:
        rps = self.script.background_rps
        while rps > 0 and self._next_background <= at:
            if len(self.waiting) < MAX_QUEUE:
                self.waiting.append(_Req(self.script.background))
            self._next_background += 1.0 / rps
        self._admit()

    def _admit(self) -> None:
        total, cap = self.script.kv_total_tokens, self.script.max_running
        while self.waiting:
            head = self.waiting[0]
            busy = len(self.running) + len(self.prefilling)
            if busy >= cap or self.reserved_kv + head.kv_reserved > total:
                if busy == 0 and head.kv_reserved > total:
                    self.waiting.popleft()  # can never fit: refuse rather than block forever
                    continue
                return
            self.waiting.popleft()
            self.reserved_kv += head.kv_reserved
            self.counters["prompt"] += head.spec.prompt_tokens
            self.counters["prefill_cache"] += head.spec.cached_tokens
            if head.uncached_left > 0:
                self.prefilling.append(head)
            else:  # fully cached (or its KV arrived with it): straight to decode
                self.running.append(head)

    def _step(self) -> float:
        batch = len(self.running)
        context = sum(r.kv_now for r in self.running)
        budget, chunk, prefix = self.script.chunk_tokens, 0, 0
        plan: list[tuple[_Req, int]] = []
        if self._sizer is not None and self.prefilling:
            head = self.prefilling[0]
            prefix = head.spec.cached_tokens + head.prefilled
            self._sized = self._sizer.chunk(batch, context, prefix, self._sized)
            budget = 0  # one prompt a step, in its sized chunk
            chunk = min(self._sized, head.uncached_left)
            plan.append((head, chunk))
        for req in self.prefilling:
            if budget <= 0:
                break
            take = min(budget, req.uncached_left)
            plan.append((req, take))
            if not prefix:
                prefix = req.spec.cached_tokens + req.prefilled
            chunk += take
            budget -= take
        shape = StepShape(
            batch=batch, context_tokens=context, prefill_tokens=chunk, prefix_tokens=prefix
        )
        dt = step_time_s(self.model, self.node, shape) * self.slowdown
        if dt <= 0:
            return 0.0
        self.counters["steps"] += 1
        for req, take in plan:
            req.prefilled += take
        self.counters["prefill_compute"] += chunk
        if batch:
            self._observe_itl(dt, batch)
            self.counters["generation"] += batch
            self.counters["decode"] += batch
            for r in self.running:
                r.generated += 1
            done = [r for r in self.running if r.generated >= r.spec.output_tokens]
            if done:
                self.running = [r for r in self.running if r.generated < r.spec.output_tokens]
                for r in done:
                    self.reserved_kv -= r.kv_reserved
                self.counters["requests"] += len(done)
        finished_prefill = [r for r, _ in plan if r.uncached_left <= 0]
        if finished_prefill:
            self.prefilling = [r for r in self.prefilling if r.uncached_left > 0]
            self.running.extend(finished_prefill)
        self._last_gen_tps = batch / dt
        self._admit()
        return dt

    def _observe_itl(self, dt: float, count: int) -> None:
        for i, bound in enumerate(self.script.itl_buckets_s):
            if dt <= bound:
                self.itl_counts[i] += count
                break
        else:
            self.itl_counts[-1] += count
        self.itl_sum_s += dt * count

    # -- output --------------------------------------------------------------------------------

    @property
    def kv_used_tokens(self) -> int:
        return sum(r.kv_now for r in self.running) + sum(r.kv_now for r in self.prefilling)

    def state(self) -> dict[str, Any]:
        """The engine's state as JSON-ready values (after bringing it up to now)."""
        self.advance()
        every = [*self.waiting, *self.prefilling, *self.running]
        return {
            "running_requests": len(self.running),
            "prefilling_requests": len(self.prefilling),
            "queued_requests": len(self.waiting),
            "borrowed_requests": sum(1 for r in every if r.spec.borrowed),
            "kv_used_tokens": self.kv_used_tokens,
            "kv_reserved_tokens": self.reserved_kv,
            "kv_total_tokens": self.script.kv_total_tokens,
            "decode_context_tokens": sum(r.kv_now for r in self.running),
            "slowdown": self.slowdown,
            "counters": dict(self.counters),
        }

    def render(self) -> str:
        """The state as SGLang-format Prometheus exposition text."""
        self.advance()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_SGLangCollector(self))
        return generate_latest(registry).decode()


class _SGLangCollector(Collector):
    def __init__(self, engine: SyntheticEngine) -> None:
        self.e = engine

    def collect(self) -> Any:
        e = self.e
        sched = {
            "model_name": e.model_name,
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
        }
        tok = {"model_name": e.model_name}
        total = e.script.kv_total_tokens
        used = e.kv_used_tokens
        prompt = e.counters["prompt"]
        gauges: list[tuple[str, str, float]] = [
            ("num_running_reqs", "The number of running requests.", len(e.running)),
            ("num_used_tokens", "The number of used tokens.", used),
            ("token_usage", "The token usage.", used / total),
            ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", total),
            (
                "decode_sum_seq_lens",
                "The sum of all sequence lengths in decode.",
                sum(r.kv_now for r in e.running),
            ),
            ("gen_throughput", "The generation throughput (token/s).", e._last_gen_tps),
            (
                "num_queue_reqs",
                "The number of requests in the waiting queue.",
                len(e.waiting) + len(e.prefilling),
            ),
            (
                "cache_hit_rate",
                "The prefix cache hit rate.",
                e.counters["prefill_cache"] / prompt if prompt else 0.0,
            ),
            (
                "kv_transfer_speed_gb_s",
                "The transfer speed of the KV cache in GB/s.",
                e.script.kv_transfer_gb_s,
            ),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(f"sglang:{name}", doc, labels=list(sched))
            g.add_metric(list(sched.values()), float(value))
            yield g
        rt = CounterMetricFamily(
            "sglang:realtime_tokens",
            "Total number of tokens processed.",
            labels=[*sched, "mode"],
        )
        for mode in ("prefill_compute", "prefill_cache", "decode"):
            rt.add_metric([*sched.values(), mode], float(e.counters[mode]))
        yield rt
        for name, doc, key in (
            ("prompt_tokens", "Number of prefill tokens processed.", "prompt"),
            ("generation_tokens", "Number of generation tokens processed.", "generation"),
            ("num_requests", "Number of requests processed.", "requests"),
        ):
            c = CounterMetricFamily(f"sglang:{name}", doc, labels=list(tok))
            c.add_metric(list(tok.values()), float(e.counters[key]))
            yield c
        h = HistogramMetricFamily(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels=list(tok),
        )
        cumulative, buckets = 0, []
        bounds = (*e.script.itl_buckets_s, float("inf"))
        for bound, count in zip(bounds, e.itl_counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(cumulative)))
        h.add_metric(list(tok.values()), buckets, e.itl_sum_s)
        yield h


class SyntheticSource:
    """The synthetic engine as an in-process source, read through the real SGLang reader."""

    name = "synthetic"

    def __init__(self, engine: SyntheticEngine, clock: Clock | None = None) -> None:
        self.engine = engine
        self._clock = clock or SystemClock()
        self._window = Window()
        self._reader = SGLangReader()

    async def scrape(self) -> EngineSnapshot:
        text = self.engine.render()
        snap = read_text(
            self._reader, self._window, text, self._clock.now_ms(), self.engine._monotonic()
        )
        return snap.model_copy(update={"source": self.name})

    async def aclose(self) -> None:
        return None
