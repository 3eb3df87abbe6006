"""A decode server's ITL quantiles over the agent's window, against a plain reference."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from crossflow_ctl.sim.config import SimConfig
from crossflow_ctl.sim.servers import DecodeServer, EventQueue, StepModel

CFG = SimConfig()


def _reference(
    steps: list[tuple[float, float, int]], t: float, window_s: float
) -> tuple[float | None, float | None, int]:
    """Weighted quantiles of (end, step time, token intervals) ended in the window: the least
    step time with at least q of the token intervals at or below it."""
    kept = sorted((dt, w) for end, dt, w in steps if end >= t - window_s)
    if not kept:
        return None, None, 0
    total = sum(w for _, w in kept)

    def quantile(q: float) -> float:
        acc = 0
        for dt, w in kept:
            acc += w
            if acc >= q * total:
                return dt
        return kept[-1][0]

    return quantile(0.5) * 1000.0, quantile(0.99) * 1000.0, total


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, 40),  # end, in ms
            st.sampled_from([0.010, 0.0125, 0.015, 0.02, 0.031]),
            st.integers(1, 300),
        ),
        max_size=30,
    ),
    reads=st.lists(st.integers(0, 60), min_size=1, max_size=5),
    window_ms=st.integers(1, 30),
)
def test_recent_itl_is_the_weighted_quantiles_of_the_steps_in_the_window(
    steps: list[tuple[int, float, int]], reads: list[int], window_ms: int
) -> None:
    server = DecodeServer(
        0,
        StepModel(CFG.model_spec, CFG.node_profile),
        EventQueue(),
        kv_capacity=100_000,
        max_batch=CFG.max_batch,
        max_macro=CFG.max_macro_steps,
        borrow_chunk=CFG.borrow_chunk_tokens,
    )
    logged = sorted((end / 1000.0, dt, w) for end, dt, w in steps)  # steps end in time order
    for end, dt, w in logged:
        server.itl_log.append((dt, w, end))
    window_s = window_ms / 1000.0
    for read in sorted(reads):  # the agent reads forward in time
        t = read / 1000.0
        assert server.recent_itl(t, window_s) == _reference(logged, t, window_s)
