"""The demo router's own model of the cluster: when each request gets its first token.

The fake engines show the broker and the agents a live load; this model gives the router the
times it reports (TTFT so far, request completion for closed-loop replay) and replays the same
trace on static P/D (nothing borrowed) for the final comparison. It is deliberately simple and
stated here in full:

* a prefill server runs one prompt at a time, FIFO: with ``roof`` (the fake engines' roofline)
  for the time the engines take, in chunks of ``prefill_chunk_tokens`` that attend to the
  prompt's cached prefix (:func:`~crossflow_ctl.domain.capacity.prefill_time_s`), times
  ``prefill_slowdown``; without it at ``prefill_rate_tps`` uncached tokens/s. The normal path
  then moves the whole prompt's KV to decode at ``kv_transfer_bytes_per_s``;
* a decode node runs borrowed prompts one at a time, FIFO, each for the service time the broker
  predicted (the plan's ``service_ms``: uncached tokens at the lease's borrowed-prefill rate);
* a request decodes ``output_tokens`` at ``itl_ms`` per token after its first token.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from crossflow_ctl.demo.trace import Session, Trace, Turn
from crossflow_ctl.domain.capacity import Roofline, prefill_time_s


@dataclass(frozen=True)
class ModelParams:
    prefill_servers: int = 2
    decode_servers: int = 4
    prefill_rate_tps: float = 12_000.0
    kv_bytes_per_token: int = 73_728
    kv_transfer_bytes_per_s: float = 25e9
    itl_ms: float = 12.0
    session_rate_per_s: float = 2.0
    """Start rate of top-level sessions that carry no start time (session traces)."""
    roof: Roofline | None = None
    """The prefill engines' roofline: a prompt's prefill time counts its cached prefix, as the
    engines (and the agents' reports the broker judges Demand and Benefit by) do. None: at
    ``prefill_rate_tps``, the prefix free."""
    prefill_chunk_tokens: int = 8192
    prefill_slowdown: float = 1.0

    def prefill_s(self, turn: Turn) -> float:
        """Seconds one prefill server takes for ``turn`` alone."""
        if self.roof is None:
            return turn.uncached_tokens / self.prefill_rate_tps
        return self.prefill_slowdown * prefill_time_s(
            self.roof, turn.uncached_tokens, turn.cached_tokens, self.prefill_chunk_tokens
        )


@dataclass
class ClusterModel:
    params: ModelParams
    prefill_free_s: list[float] = field(default_factory=list)
    borrow_free_s: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prefill_free_s:
            self.prefill_free_s = [0.0] * self.params.prefill_servers

    def normal(self, now_s: float, turn: Turn) -> tuple[int, float]:
        """Send ``turn`` to the prefill pool: (server index, TTFT seconds)."""
        p = self.params
        idx = min(range(len(self.prefill_free_s)), key=lambda i: self.prefill_free_s[i])
        start = max(now_s, self.prefill_free_s[idx])
        done = start + p.prefill_s(turn)
        self.prefill_free_s[idx] = done
        transfer = (
            (turn.uncached_tokens + turn.cached_tokens)
            * p.kv_bytes_per_token
            / p.kv_transfer_bytes_per_s
        )
        return idx, done + transfer - now_s

    def borrowed(
        self, now_s: float, node_id: str, service_s: float, queue_wait_s: float = 0.0
    ) -> float:
        """Run a prompt on decode node ``node_id`` after the node's own queue: TTFT seconds."""
        start = max(now_s + queue_wait_s, self.borrow_free_s.get(node_id, 0.0))
        done = start + service_s
        self.borrow_free_s[node_id] = done
        return done - now_s

    def decode_s(self, turn: Turn) -> float:
        return turn.output_tokens * self.params.itl_ms / 1000.0


@dataclass(frozen=True)
class Release:
    """A turn becoming ready at ``at_s`` (trace seconds)."""

    at_s: float
    session: Session
    index: int


def first_releases(trace: Trace, params: ModelParams, speed: float = 1.0) -> list[Release]:
    """Start times of sessions: their own, their parent's + offset, or a Poisson draw; all
    divided by ``speed`` (time compression: more load on the same servers)."""
    import random

    rng = random.Random(1)
    starts: dict[str, float] = {}
    t = 0.0
    out = []
    for s in trace.sessions:
        if s.start_s is not None:
            start = s.start_s
        elif s.parent_id is not None and s.parent_id in starts:
            start = starts[s.parent_id] + s.offset_s
        else:
            t += rng.expovariate(params.session_rate_per_s)
            start = t
        starts[s.session_id] = start
        out.append(Release(start, s, 0))
    base = min((r.at_s for r in out), default=0.0)
    return [Release((r.at_s - base) / speed, r.session, 0) for r in out]


@dataclass
class StaticResult:
    requests: int
    ttft_ms: list[float]
    makespan_s: float
    ttft_by_request: dict[tuple[str, int], float] = field(default_factory=dict)


def replay_static(
    trace: Trace, params: ModelParams, until_s: float | None = None, speed: float = 1.0
) -> StaticResult:
    """The same trace, closed loop, with every prompt on the prefill pool (static P/D)."""
    model = ClusterModel(params)
    heap: list[tuple[float, int, Release]] = []
    n = 0
    for r in first_releases(trace, params, speed):
        heapq.heappush(heap, (r.at_s, n, r))
        n += 1
    ttfts: list[float] = []
    by_request: dict[tuple[str, int], float] = {}
    end = 0.0
    while heap:
        at, _, rel = heapq.heappop(heap)
        if until_s is not None and at > until_s:
            break
        turn = rel.session.turns[rel.index]
        _, ttft = model.normal(at, turn)
        ttfts.append(ttft * 1000.0)
        by_request[(rel.session.session_id, rel.index)] = ttft * 1000.0
        finish = at + ttft + model.decode_s(turn)
        end = max(end, finish)
        if rel.index + 1 < len(rel.session.turns):
            nxt = rel.session.turns[rel.index + 1]
            nxt_at = finish + nxt.think_s / speed
            heapq.heappush(heap, (nxt_at, n, Release(0, rel.session, rel.index + 1)))
            n += 1
    return StaticResult(
        requests=len(ttfts), ttft_ms=ttfts, makespan_s=end, ttft_by_request=by_request
    )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[k]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
