"""A scripted engine: a decode/prefill server simulated with the roofline step-time model.

Its state evolves with (monotonic) time and with the requests added to it. Each engine step
decodes one token for every running request and prefills up to ``chunk_tokens`` uncached prompt
tokens of the admitted requests, FIFO; the step lasts ``step_time_s`` of the capacity model
times ``slowdown`` (a knob to push ITL past an SLO on purpose). A decode engine that lends
(``itl_budget_ms`` set) sizes its prefill chunks as the lease model assumes: one prompt a step,
the chunk that keeps the step within the ITL budget at the current batch and the prompt's prefix
(:class:`~crossflow_ctl.domain.lending.ChunkSizer`, as the simulator's decode servers). A step's
batch is fixed when it
starts and its effects (tokens, prefilled chunks) land when it ends: :meth:`advance` applies
the steps that have ended by now, so a token is never seen before the step that makes it is
over. Admission reserves a request's prompt + output tokens of KV, so used never exceeds
total. Optional background arrivals at a fixed rate give a steady load.

Requests can be followed one by one (:meth:`SyntheticEngine.submit` returns the :class:`Job`
and calls its ``listener`` after every advance that changed it), aborted (KV freed), kept
after their last token with their KV held (``keep_kv``: a prefill engine exporting KV until
:meth:`SyntheticEngine.release`), or arrive with their prompt's KV transferred from elsewhere
(``kv_transferred``: no local prefill; the transfer lasts the KV bytes over
``kv_transfer_gb_s`` when that is set).

It serves as a source in-process (:class:`SyntheticSource`) and renders itself as SGLang- or
vLLM-format Prometheus text (:meth:`SyntheticEngine.render`), which ``crossflow-agent
fake-engine`` serves over HTTP for the demo and the end-to-end tests, scraped by the real
readers.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from crossflow_agent.sources.http import read_with_totals
from crossflow_agent.sources.prom import Window
from crossflow_agent.sources.sglang import SGLangReader
from crossflow_agent.sources.synthetic_metrics import (
    ITL_BUCKETS_S,
    PROMPT_TOKEN_BUCKETS,
    REQUEST_TIME_BUCKETS_S,
    STEP_TOKEN_BUCKETS,
    TTFT_BUCKETS_S,
    Histogram,
    render_sglang,
    render_vllm,
)
from crossflow_ctl.domain.capacity import ModelSpec, NodeProfile, StepShape, roofline, step_time_s
from crossflow_ctl.domain.clock import Clock, SystemClock
from crossflow_ctl.domain.lease_credits import LeaseSettings
from crossflow_ctl.domain.lending import ChunkSizer
from crossflow_ctl.domain.models import Frozen
from crossflow_ctl.domain.step_windows import StepTotals
from crossflow_ctl.domain.telemetry import EngineSnapshot

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


class JobState(enum.Enum):
    WAITING = "waiting"
    """Queued for admission (a slot and KV room)."""
    TRANSFERRING = "transferring"
    """Admitted; its prompt's KV is arriving from a prefill engine."""
    PREFILLING = "prefilling"
    RUNNING = "running"
    """Decoding (its prompt's KV is complete)."""
    HELD = "held"
    """Done generating; its KV is kept (exported) until released."""
    FINISHED = "finished"
    ABORTED = "aborted"
    REFUSED = "refused"
    """Could never fit the KV cache; dropped from the queue."""


ENDED = frozenset({JobState.FINISHED, JobState.ABORTED, JobState.REFUSED})


@dataclass(eq=False)
class Job:
    """One request inside the engine. Times are the engine's monotonic seconds."""

    spec: EngineRequest
    id: int = 0
    transferred: int = 0
    """Prompt tokens whose KV came from elsewhere (no local prefill)."""
    keep_kv: bool = False
    listener: Callable[[Job], None] | None = None
    state: JobState = JobState.WAITING
    prefilled: int = 0
    generated: int = 0
    arrived_s: float = 0.0
    admitted_s: float | None = None
    ready_s: float = 0.0
    """When a transferring job's KV has arrived."""
    prompt_done_s: float | None = None
    first_token_s: float | None = None
    ended_s: float | None = None

    @property
    def uncached_left(self) -> int:
        return self.spec.prompt_tokens - self.spec.cached_tokens - self.transferred - self.prefilled

    @property
    def kv_now(self) -> int:
        return self.spec.cached_tokens + self.transferred + self.prefilled + self.generated

    @property
    def kv_reserved(self) -> int:
        return self.spec.prompt_tokens + self.spec.output_tokens

    @property
    def ended(self) -> bool:
        return self.state in ENDED


@dataclass
class _Step:
    start_s: float
    dt: float
    batch: list[Job]
    plan: list[tuple[Job, int]]
    tokens: int = field(default=0)


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
        self._now = self._t
        self._next_background = self._t
        self._ids = itertools.count(1)
        self._step_now: _Step | None = None
        self._changed: dict[int, Job] = {}
        self.waiting: deque[Job] = deque()
        self.transferring: list[Job] = []
        self.prefilling: list[Job] = []
        self.running: list[Job] = []
        self.held: dict[int, Job] = {}
        self.reserved_kv = 0
        self.counters = {
            "prompt": 0,
            "generation": 0,
            "prefill_compute": 0,
            "prefill_cache": 0,
            "prefill_transfer": 0,
            "decode": 0,
            "requests": 0,
            "aborted": 0,
            "steps": 0,
        }
        self.itl = Histogram(self.script.itl_buckets_s)
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.prefill_time = Histogram(REQUEST_TIME_BUCKETS_S)
        self.step_tokens = Histogram(STEP_TOKEN_BUCKETS)
        self.request_prompt = Histogram(PROMPT_TOKEN_BUCKETS)
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

    def submit(
        self,
        request: EngineRequest,
        *,
        kv_transferred: bool = False,
        keep_kv: bool = False,
        listener: Callable[[Job], None] | None = None,
    ) -> Job:
        """Queue a request (after bringing the state up to now) and return it.

        ``kv_transferred``: the prompt's uncached tokens arrive as KV from a prefill engine.
        ``keep_kv``: after its last token the job is HELD with its KV until :meth:`release`.
        ``listener`` is called with the job after every change the engine makes to it."""
        self.advance()
        if len(self.waiting) >= MAX_QUEUE:
            raise OverflowError(f"queue is full ({MAX_QUEUE} requests)")
        transferred = request.prompt_tokens - request.cached_tokens if kv_transferred else 0
        job = Job(
            request,
            id=next(self._ids),
            transferred=transferred,
            keep_kv=keep_kv,
            listener=listener,
            arrived_s=self._now,
        )
        self.waiting.append(job)
        self._admit()
        self._kick()
        self._notify()
        return job

    def abort(self, job: Job) -> None:
        """End a job wherever it is; its KV (reserved, in use or held) is freed at once."""
        if job.ended:
            return
        self.advance()
        if job.state is JobState.WAITING:
            self.waiting.remove(job)
        else:
            for queue in (self.transferring, self.prefilling, self.running):
                if job in queue:
                    queue.remove(job)
            self.held.pop(job.id, None)
            self.reserved_kv -= job.kv_reserved
        self.counters["aborted"] += 1
        self._end(job, JobState.ABORTED)
        self._admit()
        self._kick()
        self._notify()

    def release(self, job: Job) -> None:
        """Free a HELD job's KV (the decode engine pulled it, or it expired)."""
        if job.state is not JobState.HELD:
            return
        self.advance()
        del self.held[job.id]
        self.reserved_kv -= job.kv_reserved
        self._end(job, JobState.FINISHED)
        self._admit()
        self._kick()
        self._notify()

    # -- simulation ----------------------------------------------------------------------------

    def advance(self) -> None:
        """Run the engine steps that end by now; tell the listeners of the jobs they changed."""
        now = self._now = self._monotonic()
        steps = 0
        while steps < MAX_STEPS_PER_ADVANCE:
            if self._step_now is None:
                self._arrivals(self._t)
                self._transfers_done()
                self._step_now = self._plan()
                if self._step_now is None:  # idle: jump to the next event or to now
                    self._t = max(self._t, min(now, self._next_event_s(now)))
                    if self._t >= now:
                        break
                    continue
            step = self._step_now
            if step.start_s + step.dt > now:
                break  # still running: it lands on a later advance
            self._apply(step)
            self._t = step.start_s + step.dt
            self._step_now = None
            steps += 1
        else:  # gave up catching up: drop the backlog of time
            self._t, self._step_now = now, None
        self._arrivals(now)
        self._notify()

    def now_s(self) -> float:
        """The engine's clock (monotonic seconds), the one its job times are in."""
        return self._monotonic()

    def _kick(self) -> None:
        """An idle engine starts a step at once on new work (advance has brought it to now)."""
        if self._step_now is None:
            self._transfers_done()
            self._step_now = self._plan()

    def next_due_s(self) -> float | None:
        """When (monotonic seconds) the state next changes on its own; None when idle."""
        due = [j.ready_s for j in self.transferring]
        if self._step_now is not None:
            due.append(self._step_now.start_s + self._step_now.dt)
        if self.script.background_rps > 0:
            due.append(self._next_background)
        return min(due) if due else None

    def _next_event_s(self, now: float) -> float:
        due = [now, *(j.ready_s for j in self.transferring)]
        if self.script.background_rps > 0:
            due.append(self._next_background)
        return min(due)

    def _arrivals(self, at: float) -> None:
        rps = self.script.background_rps
        while rps > 0 and self._next_background <= at:
            if len(self.waiting) < MAX_QUEUE:
                self.waiting.append(Job(self.script.background, id=next(self._ids), arrived_s=at))
            self._next_background += 1.0 / rps
        self._admit()

    def _admit(self) -> None:
        total, cap = self.script.kv_total_tokens, self.script.max_running
        while self.waiting:
            head = self.waiting[0]
            busy = len(self.running) + len(self.prefilling) + len(self.transferring)
            if busy >= cap or self.reserved_kv + head.kv_reserved > total:
                if busy == 0 and head.kv_reserved > total:
                    self.waiting.popleft()  # can never fit: refuse rather than block forever
                    self._end(head, JobState.REFUSED)
                    continue
                return
            self.waiting.popleft()
            self.reserved_kv += head.kv_reserved
            head.admitted_s = at = max(self._t, head.arrived_s)
            self.counters["prompt"] += head.spec.prompt_tokens
            self.counters["prefill_cache"] += head.spec.cached_tokens
            self.counters["prefill_transfer"] += head.transferred
            if head.transferred and self.script.kv_transfer_gb_s > 0:
                nbytes = head.transferred * self.model.kv_bytes_per_token
                head.ready_s = at + nbytes / (self.script.kv_transfer_gb_s * 1e9)
                self._move(head, JobState.TRANSFERRING, self.transferring)
            elif head.uncached_left > 0:
                self._move(head, JobState.PREFILLING, self.prefilling)
            else:  # fully cached (or its KV arrived with it): straight to decode
                self._prompt_done(head, at)

    def _transfers_done(self) -> None:
        ready = [j for j in self.transferring if j.ready_s <= self._t]
        for job in ready:
            self.transferring.remove(job)
            if job.uncached_left > 0:
                self._move(job, JobState.PREFILLING, self.prefilling)
            else:
                self._prompt_done(job, job.ready_s)

    def _plan(self) -> _Step | None:
        batch = list(self.running)
        context = sum(r.kv_now for r in batch)
        budget, chunk, prefix = self.script.chunk_tokens, 0, 0
        plan: list[tuple[Job, int]] = []
        if self._sizer is not None and self.prefilling:
            head = self.prefilling[0]
            prefix = head.spec.cached_tokens + head.transferred + head.prefilled
            self._sized = self._sizer.chunk(len(batch), context, prefix, self._sized)
            budget = 0  # one prompt a step, in its sized chunk
            chunk = min(self._sized, head.uncached_left)
            plan.append((head, chunk))
        for req in self.prefilling:
            if budget <= 0:
                break
            take = min(budget, req.uncached_left)
            plan.append((req, take))
            if not prefix:
                prefix = req.spec.cached_tokens + req.transferred + req.prefilled
            chunk += take
            budget -= take
        shape = StepShape(
            batch=len(batch), context_tokens=context, prefill_tokens=chunk, prefix_tokens=prefix
        )
        dt = step_time_s(self.model, self.node, shape) * self.slowdown
        if dt <= 0:
            return None
        return _Step(self._t, dt, batch, plan, tokens=len(batch) + chunk)

    def _apply(self, step: _Step) -> None:
        end = step.start_s + step.dt
        self.counters["steps"] += 1
        self.step_tokens.observe(step.tokens)
        batch = [r for r in step.batch if r.state is JobState.RUNNING]  # none aborted meanwhile
        for req, take in step.plan:
            if req.state is JobState.PREFILLING:
                req.prefilled += take
                self.counters["prefill_compute"] += take
                self._touch(req)
        if batch:
            self.itl.observe(step.dt, len(batch))
            self.counters["generation"] += len(batch)
            self.counters["decode"] += len(batch)
            for r in batch:
                r.generated += 1
                if r.generated == 1:
                    r.first_token_s = end
                    self.ttft.observe(end - r.arrived_s)
                    self.prefill_time.observe(end - (r.admitted_s or r.arrived_s))
                if r.listener is not None:
                    self._changed[r.id] = r
            done = [r for r in batch if r.generated >= r.spec.output_tokens]
            if done:
                self.running = [r for r in self.running if r.generated < r.spec.output_tokens]
                for r in done:
                    self._finish(r, end)
        finished_prefill = [r for r, _ in step.plan if r.state is JobState.PREFILLING]
        finished_prefill = [r for r in finished_prefill if r.uncached_left <= 0]
        if finished_prefill:
            self.prefilling = [r for r in self.prefilling if r.uncached_left > 0]
            for r in finished_prefill:
                self._prompt_done(r, end)
        self._last_gen_tps = len(batch) / step.dt
        self._admit()

    def _prompt_done(self, job: Job, at: float) -> None:
        job.prompt_done_s = at
        self._move(job, JobState.RUNNING, self.running)

    def _finish(self, job: Job, at: float) -> None:
        self.counters["requests"] += 1
        self.request_prompt.observe(job.spec.prompt_tokens)
        if job.keep_kv:
            job.state = JobState.HELD
            self.held[job.id] = job
            self._touch(job)
            return
        self.reserved_kv -= job.kv_reserved
        self._end(job, JobState.FINISHED, at)

    def _move(self, job: Job, state: JobState, queue: list[Job]) -> None:
        job.state = state
        queue.append(job)
        self._touch(job)

    def _end(self, job: Job, state: JobState, at: float | None = None) -> None:
        job.state = state
        job.ended_s = self._t if at is None else at
        self._touch(job)

    def _touch(self, job: Job) -> None:
        if job.listener is not None:
            self._changed[job.id] = job

    def _notify(self) -> None:
        while self._changed:
            changed, self._changed = self._changed, {}
            for job in changed.values():
                assert job.listener is not None
                job.listener(job)

    # -- output --------------------------------------------------------------------------------

    @property
    def kv_used_tokens(self) -> int:
        return (
            sum(r.kv_now for r in self.running)
            + sum(r.kv_now for r in self.prefilling)
            + sum(r.kv_now for r in self.held.values())
        )

    def state(self) -> dict[str, Any]:
        """The engine's state as JSON-ready values (after bringing it up to now)."""
        self.advance()
        every = [*self.waiting, *self.transferring, *self.prefilling, *self.running]
        return {
            "running_requests": len(self.running),
            "prefilling_requests": len(self.prefilling),
            "queued_requests": len(self.waiting),
            "transferring_requests": len(self.transferring),
            "held_requests": len(self.held),
            "borrowed_requests": sum(1 for r in every if r.spec.borrowed),
            "kv_used_tokens": self.kv_used_tokens,
            "kv_reserved_tokens": self.reserved_kv,
            "kv_total_tokens": self.script.kv_total_tokens,
            "decode_context_tokens": sum(r.kv_now for r in self.running),
            "slowdown": self.slowdown,
            "counters": dict(self.counters),
        }

    def render(self, fmt: Literal["sglang", "vllm"] = "sglang") -> str:
        """The state as SGLang- or vLLM-format Prometheus exposition text."""
        self.advance()
        return render_vllm(self) if fmt == "vllm" else render_sglang(self)


class SyntheticSource:
    """The synthetic engine as an in-process source, read through the real SGLang reader."""

    name = "synthetic"

    def __init__(self, engine: SyntheticEngine, clock: Clock | None = None) -> None:
        self.engine = engine
        self._clock = clock or SystemClock()
        self._window = Window()
        self._reader = SGLangReader()
        self._totals: StepTotals | None = None

    async def scrape(self) -> EngineSnapshot:
        text = self.engine.render()
        snap, self._totals = read_with_totals(
            self._reader, self._window, text, self._clock.now_ms(), self.engine._monotonic()
        )
        return snap.model_copy(update={"source": self.name})

    def step_totals(self) -> StepTotals | None:
        """The step counters of the last scrape (online calibration)."""
        return self._totals

    async def aclose(self) -> None:
        return None
