"""R = uncached input tokens / output tokens, per window of a trace (the planner's input).

Open-loop traces are binned by arrival time; closed-loop (session) traces have no absolute times
before they are simulated, so they give one R per session instead (as the trace README does).
Mooncake prompts go through a cluster-wide prefix cache model of ``cache_capacity_tokens``.
"""

from __future__ import annotations

from crossflow_ctl.sim.prefix_cache import CacheScope, PrefixCacheModel
from crossflow_ctl.sim.traces import Trace

UNBOUNDED_CACHE_TOKENS = 10**12


def trace_ratios(
    trace: Trace, window_s: float = 60.0, cache_capacity_tokens: int = UNBOUNDED_CACHE_TOKENS
) -> list[float]:
    """R per window (open loop) or per session (closed loop); windows with no output skipped."""
    cache = PrefixCacheModel(CacheScope.CLUSTER, cache_capacity_tokens, 1)
    bins: dict[str, list[int]] = {}
    closed = trace.closed_loop
    for r in trace.requests:
        cached = (
            cache.admit(r.hash_ids, r.input_tokens, None)
            if r.cached_tokens is None
            else r.cached_tokens
        )
        key = r.session.split(".")[0] if closed else str(int(r.arrival_s // window_s))
        acc = bins.setdefault(key, [0, 0])
        acc[0] += r.input_tokens - cached
        acc[1] += r.output_tokens
    return [u / o for u, o in bins.values() if o > 0]
