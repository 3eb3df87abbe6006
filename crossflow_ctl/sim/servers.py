"""Prefill and decode servers whose step times come from the roofline model (capacity.py).

Approximations (stated, not hidden):

* **Prefill servers** run one request at a time, FIFO, in chunks of ``chunk`` uncached tokens;
  each chunk's step time is ``step_time_s(prefill_tokens=chunk, prefix_tokens=cached + done)``.
  A chunk never mixes the tail of one prompt with the head of the next, so a request's prefill
  time is known when it starts and is one event.
* **Decode servers** run continuous batching. Every step decodes one token for each running
  request; a step that carries a borrowed prefill chunk P (with prefix X) takes
  ``step_time_s(B, C, P, X)`` and every running request waits for it. While the batch does not
  change, up to ``max_macro_steps`` plain steps are advanced as one event, timed at the batch's
  mid-point context (context grows by B per step); an arrival cuts the macro step at the end of
  the step in progress, so new work joins at a step boundary as in a real engine.
* **KV**: a request reserves prompt + output tokens on its decode server (no preemption). Both
  kinds of arrival, a transferred request (normal path) and a borrowed prompt, wait in one
  queue in arrival order and take KV from its head only; a head that does not fit blocks the
  queue. That is an engine's one scheduler over one waiting queue: vLLM v1's ``Scheduler``
  walks ``waiting`` first come first served and stops at the first request
  ``allocate_slots`` cannot place, whether it awaits remote KV or prefills locally, so neither
  path jumps the other. A transferred request joins the batch once admitted; a borrowed one
  joins the queue of borrowed prefills (one at a time, in order) holding its KV, counts
  against the batch bound as a scheduled prefill does, and stays on the node to decode.
* The first token is counted when the request joins a decode batch (normal path: after prefill,
  KV transfer and any wait for KV room; borrowed: at the end of its last prefill chunk).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

from crossflow_ctl.domain.capacity import ModelSpec, NodeProfile, prefill_time_s, roofline
from crossflow_ctl.domain.lending import ChunkSizer
from crossflow_ctl.domain.step_windows import STEP_TOKEN_BUCKETS, StepTotals


@dataclass(slots=True)
class Req:
    """One request in flight (sim-internal, mutable)."""

    rid: int
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    release_s: float
    measured: bool
    borrowed: bool = False
    reservation_id: str = ""
    node_id: str = ""
    """The decode node it borrowed on (leases policy)."""
    prefilled: int = 0
    first_token_s: float = -1.0
    finish_s: float = -1.0
    join_step: int = 0
    queue_seq: int = 0
    """Its place in its decode node's KV queue (arrival order there)."""
    dispatch_s: float = -1.0
    """When the router sent it on (to the prefill pool or to its decode node)."""
    start_s: float = -1.0
    """When its prefill started (on a prefill server, or its first chunk on a decode node)."""
    prefilled_s: float = -1.0
    """When its prefill ended on a prefill server (normal path)."""
    arrive_s: float = -1.0
    """When it reached its decode node (its KV, or itself to prefill there)."""

    @property
    def uncached_tokens(self) -> int:
        return self.input_tokens - self.cached_tokens

    @property
    def kv_need(self) -> int:
        return self.input_tokens + self.output_tokens


class StepModel:
    """``step_time_s`` for one model on one server (the same function the agent uses)."""

    def __init__(self, model: ModelSpec, node: NodeProfile) -> None:
        self.model = model
        self.node = node
        self.roof = roofline(model, node)
        self.step_s = self.roof.step_s
        """``step_s(batch, context, prefill=0, prefix=0)``: the roofline's own (no wrapper
        call per planned step)."""

    def prefill_s(self, uncached: int, cached: int, chunk: int) -> float:
        return prefill_time_s(self.roof, uncached, cached, chunk)

    def transfer_s(self, tokens: int) -> float:
        return tokens * self.model.kv_bytes_per_token / self.node.network_bytes_per_s


class EventQueue:
    """A time-ordered heap; ties break by insertion order, so runs are deterministic."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, int, object]] = []
        self._seq = 0

    def push(self, t: float, kind: int, target: int, payload: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, target, payload))

    def pop(self) -> tuple[float, int, int, object]:
        t, _, kind, target, payload = heapq.heappop(self._heap)
        return t, kind, target, payload

    def __len__(self) -> int:
        return len(self._heap)


EV_PREFILL_DONE = 2
EV_DECODE_STEP = 3


@dataclass(slots=True)
class PrefillServer:
    idx: int
    steps: StepModel
    chunk: int
    events: EventQueue
    queue: deque[Req] = field(default_factory=deque)
    queued_tokens: int = 0
    queued_s: float = 0.0
    """Prefill time of the queued prompts (each at its own cached prefix)."""
    current: Req | None = None
    start_s: float = 0.0
    end_s: float = 0.0
    done_tokens: int = 0
    busy_s: float = 0.0

    def enqueue(self, req: Req, t: float) -> None:
        self.queue.append(req)
        self.queued_tokens += req.uncached_tokens
        self.queued_s += self._prefill_s(req)
        if self.current is None:
            self._start(t)

    def _start(self, t: float) -> None:
        req = self.queue.popleft()
        self.queued_tokens -= req.uncached_tokens
        own = self._prefill_s(req)
        self.queued_s = self.queued_s - own if self.queue else 0.0  # no drift once empty
        self.current = req
        req.start_s = self.start_s = t
        self.end_s = t + own
        self.events.push(self.end_s, EV_PREFILL_DONE, self.idx)

    def _prefill_s(self, req: Req) -> float:
        return self.steps.prefill_s(req.uncached_tokens, req.cached_tokens, self.chunk)

    def wait_s(self, t: float) -> float:
        """Time to clear what it holds: the rest of the running prompt, then the queue (what
        a prompt sent now waits before its own prefill starts)."""
        rest = max(0.0, self.end_s - t) if self.current is not None else 0.0
        return rest + max(0.0, self.queued_s)

    def finish(self, t: float) -> Req:
        req = self.current
        assert req is not None
        req.prefilled_s = t
        self.done_tokens += req.uncached_tokens
        self.busy_s += self.end_s - self.start_s
        self.current = None
        if self.queue:
            self._start(t)
        return req

    def _current_done(self, t: float) -> float:
        if self.current is None or self.end_s <= self.start_s:
            return 0.0
        share = min(1.0, max(0.0, (t - self.start_s) / (self.end_s - self.start_s)))
        return self.current.uncached_tokens * share

    def outstanding_tokens(self, t: float) -> int:
        cur = self.current.uncached_tokens if self.current else 0
        return int(self.queued_tokens + cur - self._current_done(t))

    def processed_tokens(self, t: float) -> float:
        return self.done_tokens + self._current_done(t)

    def busy_until(self, t: float) -> float:
        return self.busy_s + (t - self.start_s if self.current is not None else 0.0)


@dataclass(slots=True)
class DecodeServer:
    idx: int
    steps: StepModel
    events: EventQueue
    kv_capacity: int
    max_batch: int
    max_macro: int
    borrow_chunk: int
    sizer: ChunkSizer | None = None
    """Leases policy: each borrowed prompt's chunk is sized for its prefix (else borrow_chunk)."""
    sized: int = 0
    """The last chunk the sizer gave (it seeds the next search; no result depends on it)."""
    running: dict[int, Req] = field(default_factory=dict)
    finish_heap: list[tuple[int, int]] = field(default_factory=list)
    steps_done: int = 0
    ctx_base: int = 0
    """Sum over running requests of (context at join - steps_done at join)."""
    kv_used: int = 0
    waiting: deque[Req] = field(default_factory=deque)
    """Arrivals of both paths waiting for KV room, in arrival order (see the module doc)."""
    borrow_q: deque[Req] = field(default_factory=deque)
    """Borrowed requests holding KV, prefilled one at a time from the head."""
    arrivals: int = 0
    blocked_seq: int = 0
    """``queue_seq`` of the last arrival that was queued when the head last found no room."""
    promised_requests: int = 0
    promised_kv: int = 0
    """Transferred requests waiting in ``waiting`` and the KV they need (what the agent's
    telemetry reports as promised: the engine's prealloc queue)."""
    borrowed_outstanding: int = 0
    borrowed_kv: int = 0
    """KV reserved by borrowed requests still in prefill (what the agent's telemetry reports)."""
    busy: bool = False
    t0: float = 0.0
    dt: float = 0.0
    k: int = 0
    chunk_now: int = 0
    gen: int = 0
    busy_s: float = 0.0
    tokens_out: int = 0
    itl_log: deque[tuple[float, int, float]] = field(default_factory=deque)
    """(step time, token intervals, step end) of recent steps, for the agent's ITL quantiles
    (in that order, so the log sorts by step time as it is)."""
    itl_hist: dict[float, int] = field(default_factory=dict)
    """Rounded step time (0.1 ms) -> token intervals, for the metrics (measured window only)."""
    measure_from_s: float = 0.0
    borrow_kv_waits: int = 0
    finished: list[Req] = field(default_factory=list)
    borrow_done: list[Req] = field(default_factory=list)
    itl_sum_s: float = 0.0
    prefill_tokens: int = 0
    """Borrowed prefill tokens computed so far (the engine's uncached prompt counter)."""
    step_tokens_sum: int = 0
    step_tokens: list[int] = field(default_factory=lambda: [0] * len(STEP_TOKEN_BUCKETS))
    """Steps by tokens in the step, non-cumulative, per bucket of ``STEP_TOKEN_BUCKETS`` (the
    counters an engine exports, for the agents' online calibration)."""

    @property
    def batch(self) -> int:
        return len(self.running)

    def context_tokens(self, t: float) -> int:
        partial = 0
        if self.busy and self.chunk_now == 0 and self.dt > 0:
            partial = min(self.k, int((t - self.t0) / self.dt))
        return self.ctx_base + self.batch * (self.steps_done + partial)

    # -- arrivals ---------------------------------------------------------------------------
    def arrive_normal(self, req: Req, t: float) -> None:
        self._enqueue(req, t)
        self.promised_requests += 1
        self.promised_kv += req.kv_need
        self._poke(t)

    def arrive_borrowed(self, req: Req, t: float) -> None:
        self._enqueue(req, t)
        self.borrowed_outstanding += req.uncached_tokens - req.prefilled
        self._poke(t)

    def _enqueue(self, req: Req, t: float) -> None:
        req.arrive_s = t
        self.arrivals += 1
        req.queue_seq = self.arrivals
        self.waiting.append(req)

    def _poke(self, t: float) -> None:
        if not self.busy:
            self._admit(t)
            self._plan(t)
        elif self.chunk_now == 0 and self.dt > 0:
            n = int((t - self.t0) / self.dt)
            if n + 1 < self.k:
                self.k = n + 1
                self.gen += 1
                self.events.push(self.t0 + self.k * self.dt, EV_DECODE_STEP, self.idx, self.gen)

    # -- stepping ---------------------------------------------------------------------------
    def step_end(self, t: float, gen: int) -> None:
        if gen != self.gen or not self.busy:
            return
        b, k, dt = self.batch, self.k, self.dt
        self.steps_done += k
        self.busy_s += k * dt
        tokens = b + self.chunk_now
        self.step_tokens_sum += k * tokens
        self.step_tokens[bisect_left(STEP_TOKEN_BUCKETS, tokens)] += k
        self.prefill_tokens += self.chunk_now
        if b:
            self.tokens_out += b * k
            self.itl_sum_s += dt * b * k
            self.itl_log.append((dt, b * k, t))
            if t >= self.measure_from_s:
                key = round(dt, 4)
                self.itl_hist[key] = self.itl_hist.get(key, 0) + b * k
        heap = self.finish_heap
        while heap and heap[0][0] <= self.steps_done:
            _, rid = heapq.heappop(heap)
            self._finish(self.running.pop(rid), t)
        if self.chunk_now:
            head = self.borrow_q[0]
            head.prefilled += self.chunk_now
            self.borrowed_outstanding -= self.chunk_now
            if head.prefilled >= head.uncached_tokens:
                self.borrow_q.popleft()
                self.borrowed_kv -= head.kv_need
                self.borrow_done.append(head)
                self._join(head, t)
        self.busy = False
        self._admit(t)
        self._plan(t)

    def _finish(self, req: Req, t: float) -> None:
        req.finish_s = t
        self.kv_used -= req.kv_need
        self.ctx_base -= req.input_tokens + 1 - req.join_step
        self.finished.append(req)

    def _join(self, req: Req, t: float) -> None:
        req.first_token_s = t
        remaining = req.output_tokens - 1
        if remaining <= 0:
            req.finish_s = t
            self.kv_used -= req.kv_need
            self.finished.append(req)
            return
        self.running[req.rid] = req
        req.join_step = self.steps_done
        heapq.heappush(self.finish_heap, (self.steps_done + remaining, req.rid))
        self.ctx_base += req.input_tokens + 1 - self.steps_done

    def _fits(self, req: Req) -> bool:
        scheduled = self.batch + len(self.borrow_q)
        return scheduled < self.max_batch and self.kv_used + req.kv_need <= self.kv_capacity

    def _admit(self, t: float) -> None:
        """Give KV to the queue's head while it fits, in arrival order (see the module doc)."""
        waiting = self.waiting
        while waiting and self._fits(waiting[0]):
            req = waiting.popleft()
            self.kv_used += req.kv_need
            if not req.borrowed:
                self.promised_requests -= 1
                self.promised_kv -= req.kv_need
                self._join(req, t)
                continue
            self.borrowed_kv += req.kv_need
            self.borrow_q.append(req)
            if req.queue_seq <= self.blocked_seq:
                self.borrow_kv_waits += 1
        if waiting:
            self.blocked_seq = self.arrivals

    def _plan(self, t: float) -> None:
        head = self.borrow_q[0] if self.borrow_q else None
        b = self.batch
        ctx = self.ctx_base + b * self.steps_done
        p = 0
        if head is not None:
            prefix = head.cached_tokens + head.prefilled
            size = self.borrow_chunk
            if self.sizer is not None:  # 0: no chunk fits the budget; decode, and try again
                size = self.sizer.chunk(b, ctx, prefix, self.sized)
                self.sized = size or self.sized
            p = min(size, head.uncached_tokens - head.prefilled)
        if p > 0:
            assert head is not None
            if head.start_s < 0.0:
                head.start_s = t
            self.chunk_now, self.k = p, 1
            self.dt = self.steps.step_s(b, ctx, p, head.cached_tokens + head.prefilled)
        elif b:
            self.chunk_now = 0
            self.k = min(self.max_macro, self.finish_heap[0][0] - self.steps_done)
            self.dt = self.steps.step_s(b, ctx + b * (self.k - 1) // 2)
        else:
            self.busy = False
            return
        self.busy = True
        self.t0 = t
        self.gen += 1
        self.events.push(t + self.k * self.dt, EV_DECODE_STEP, self.idx, self.gen)

    # -- telemetry --------------------------------------------------------------------------
    def recent_itl(self, t: float, window_s: float) -> tuple[float | None, float | None, int]:
        """(p50 ms, p99 ms, output tokens) over steps that ended in the last ``window_s``: the
        least step time with at least half (99%) of the token intervals at or below it."""
        log = self.itl_log
        cutoff = t - window_s
        while log and log[0][2] < cutoff:
            log.popleft()
        if not log:
            return None, None, 0
        if len(log) == 1:  # one step in the window (common): both quantiles are its time
            dt, total, _ = log[0]
            return dt * 1000.0, dt * 1000.0, total
        items = sorted(log)  # by step time (ties: by weight, then end; same quantiles)
        total = 0
        for _, w, _ in items:
            total += w
        half, most = 0.5 * total, 0.99 * total
        p50 = -1.0  # not reached yet (step times are positive)
        acc = 0
        for dt, w, _ in items:
            acc += w
            if p50 < 0.0 and acc >= half:
                p50 = dt
            if acc >= most:
                return p50 * 1000.0, dt * 1000.0, total
        last = items[-1][0]  # not reached: the integer sum is at least 0.99 of itself
        return (last if p50 < 0.0 else p50) * 1000.0, last * 1000.0, total

    def busy_until(self, t: float) -> float:
        return self.busy_s + (min(t - self.t0, self.k * self.dt) if self.busy else 0.0)

    def step_totals(self, t: float) -> StepTotals:
        """The engine's step counters at ``t`` as its ``/metrics`` would tell them (steps that
        ended; the running batch and its context now). Borrowed prompts are the only prefill a
        simulated decode server runs; their prefixes are not counted (no prompt counter)."""
        cumulative, acc = [], 0
        for bound, n in zip(STEP_TOKEN_BUCKETS, self.step_tokens, strict=True):
            acc += n
            cumulative.append((bound, float(acc)))
        return StepTotals.trusted(
            at_s=t,
            steps=float(self.steps_done),
            step_tokens_sum=float(self.step_tokens_sum),
            step_token_buckets=tuple(cumulative),
            decode_tokens=float(self.tokens_out),
            itl_sum_s=self.itl_sum_s,
            itl_count=float(self.tokens_out),
            prefill_tokens=float(self.prefill_tokens),
            cached_tokens=0.0,
            prompts=0.0,
            running_requests=float(self.batch),
            context_tokens=float(self.context_tokens(t)),
            kv_total_tokens=float(self.kv_capacity),
            engine_flops=None,
            engine_bytes=None,
        )
