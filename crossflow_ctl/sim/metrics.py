"""What one simulation run measured, and the summary figures the report shows.

Definitions (the report repeats them):

* **TTFT**: release of the request to its first token (it joins a decode batch).
* **ITL**: per token interval, i.e. decode step times weighted by the requests in the step
  (mean and p99 over every token produced after the warm-up); per request, the mean ITL is
  ``(finish - first token) / (output - 1)``.
* **Throughput**: input (or output) tokens of the measured requests over the span from the first
  measured release to the last measured finish (the drain of the queues included).
* **Steady-state throughput**: input (or output) tokens of the requests that finished between
  the end of the warm-up and the last release, over that window: the rate while the offered load
  is still arriving, so a saturated run is not judged by how long its backlog takes to drain.
* **SLO attainment**: share of measured requests with TTFT <= the TTFT SLO and mean ITL <= the
  ITL SLO.
* **Stranded capacity**: share of server-seconds (all servers, whole run) not spent stepping.
* **Over-commit**: granted debits after which a node's open debits exceeded its latest lease x
  borrow share on some credit, as read back from the store (DESIGN.md §5.3; must be 0).
* **Where TTFT goes** (:func:`ttft_phases`, which sum to the TTFT): *hold*, release to the
  router sending it on (late binding); *queue*, waiting for its prefill to start (the prefill
  pool's queue, or on its decode node behind other borrowed prompts and for KV room);
  *prefill*; *transfer*, its KV from prefill to decode (normal path) or its cached prefix to
  the decode node (borrowed); *KV wait*, on the decode node for KV room (normal path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from crossflow_ctl.domain.models import Frozen
from crossflow_ctl.domain.sizing import percentile
from crossflow_ctl.sim.servers import Req

PHASES = ("hold", "queue", "prefill", "transfer", "kv_wait")
"""The parts of a TTFT, in :func:`ttft_phases` order."""


def ttft_phases(req: Req) -> tuple[float, float, float, float, float]:
    """``req``'s TTFT split into PHASES (seconds; they sum to first token - release)."""
    hold = req.dispatch_s - req.release_s
    if req.borrowed:
        transfer = req.arrive_s - req.dispatch_s
        queue = req.start_s - req.arrive_s
        return hold, queue, req.first_token_s - req.start_s, transfer, 0.0
    queue = req.start_s - req.dispatch_s
    prefill = req.prefilled_s - req.start_s
    transfer = req.arrive_s - req.prefilled_s
    return hold, queue, prefill, transfer, req.first_token_s - req.arrive_s


@dataclass(slots=True)
class RunRecord:
    """Raw observations of one run (picklable, for sweeps over processes)."""

    label: str
    trace: str
    scale: float
    ttft_s: list[float] = field(default_factory=list)
    itl_req_s: list[float] = field(default_factory=list)
    itl_hist: dict[float, int] = field(default_factory=dict)
    input_tokens: int = 0
    output_tokens: int = 0
    measured: int = 0
    completed: int = 0
    dropped: int = 0
    borrowed: int = 0
    slo_ok: int = 0
    span_s: float = 0.0
    steady_s: float = 0.0
    """Length of the steady-state window (end of warm-up to last release), simulated seconds."""
    steady_input_tokens: int = 0
    steady_output_tokens: int = 0
    """Tokens the cluster worked through inside the steady-state window: input tokens of the
    prompts whose prefill ended in it, output tokens decoded in it (``cluster.work_inside``)."""
    busy_s: float = 0.0
    capacity_s: float = 0.0
    overcommits: int = 0
    borrow_kv_waits: int = 0
    release_failures: int = 0
    admit_reasons: dict[str, int] = field(default_factory=dict)
    short_credits: dict[str, int] = field(default_factory=dict)
    """On NO_ROOM answers: how often each credit was short, over the candidate nodes."""
    leases: int = 0
    """Leases the decode agents published (zero or not)."""
    zero_reasons: dict[str, int] = field(default_factory=dict)
    """Zero leases by reason, over every decode agent."""
    lease_credit_sums: dict[str, float] = field(default_factory=dict)
    """Sum of each credit over the non-zero leases (divide by the count for the mean)."""
    lease_chunk_sum: int = 0
    """Sum of the agents' sized borrowed chunk over the non-zero leases."""
    windows: list[tuple[float, float, float, float]] = field(default_factory=list)
    """Per window: (start, R = uncached in / out, borrowed share, mean TTFT s)."""
    held: int = 0
    """Prompts the router's queue held (late binding) before their outcome."""
    outcomes: dict[str, int] = field(default_factory=dict)
    """The router's queue: prompts by how they got their outcome (``client.holding.Dispatch``:
    borrowed, borrowed_late, not_held, prefill_room, deadline, no_demand, ...)."""
    reoffers: int = 0
    phase_sums: dict[str, list[float]] = field(default_factory=dict)
    """Per path ("normal", "borrowed"): [measured requests, then the sum of each of PHASES]."""
    sim_events: int = 0
    wall_s: float = 0.0

    def add_phases(self, borrowed: bool, phases: tuple[float, ...]) -> None:
        sums = self.phase_sums.setdefault("borrowed" if borrowed else "normal", [0.0] * 6)
        sums[0] += 1
        for i, value in enumerate(phases, 1):
            sums[i] += value


class Summary(Frozen):
    label: str
    trace: str
    scale: float
    requests: int
    completed: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_mean_ms: float
    itl_p99_ms: float
    input_tps: float
    output_tps: float
    steady_input_tps: float
    steady_output_tps: float
    slo_attainment: float
    stranded: float
    borrowed_share: float
    overcommits: int
    borrow_kv_waits: int
    dropped: int
    wall_s: float


def _hist_stats(hist: dict[float, int]) -> tuple[float, float]:
    total = sum(hist.values())
    if not total:
        return math.nan, math.nan
    mean = sum(k * w for k, w in hist.items()) / total
    acc, p99 = 0, max(hist)
    for k in sorted(hist):
        acc += hist[k]
        if acc >= 0.99 * total:
            p99 = k
            break
    return mean, p99


def summarize(rec: RunRecord) -> Summary:
    ttft = rec.ttft_s
    itl_mean, itl_p99 = _hist_stats(rec.itl_hist)
    span = rec.span_s if rec.span_s > 0 else math.nan
    steady = rec.steady_s if rec.steady_s > 0 else math.nan
    return Summary(
        label=rec.label,
        trace=rec.trace,
        scale=rec.scale,
        requests=rec.measured,
        completed=rec.completed,
        ttft_mean_ms=(sum(ttft) / len(ttft) * 1000.0) if ttft else math.nan,
        ttft_p50_ms=percentile(ttft, 50) * 1000.0 if ttft else math.nan,
        ttft_p99_ms=percentile(ttft, 99) * 1000.0 if ttft else math.nan,
        itl_mean_ms=itl_mean * 1000.0,
        itl_p99_ms=itl_p99 * 1000.0,
        input_tps=rec.input_tokens / span,
        output_tps=rec.output_tokens / span,
        steady_input_tps=rec.steady_input_tokens / steady,
        steady_output_tps=rec.steady_output_tokens / steady,
        slo_attainment=rec.slo_ok / rec.measured if rec.measured else math.nan,
        stranded=1.0 - rec.busy_s / rec.capacity_s if rec.capacity_s > 0 else math.nan,
        borrowed_share=rec.borrowed / rec.measured if rec.measured else 0.0,
        overcommits=rec.overcommits,
        borrow_kv_waits=rec.borrow_kv_waits,
        dropped=rec.dropped,
        wall_s=rec.wall_s,
    )
