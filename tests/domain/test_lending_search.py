"""The step-time searches, written out for speed, against the straightforward search they replace.

The agent sizes its chunk and prices its lease every period, and the simulator does so for every
agent tick, so :func:`fit_along` runs the secant search inline instead of through a memoised
callback. It must return exactly what the callback version returns (every simulated result
depends on it): the reference below is that version, kept as the specification."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from crossflow_ctl.domain.capacity import (
    MODEL_PRESETS,
    NODE_PRESETS,
    Roofline,
    roofline,
)
from crossflow_ctl.domain.lease_credits import LeaseSettings, _extra_batch, compute_capacity
from crossflow_ctl.domain.lending import best_chunk, fit_along, largest_chunk
from crossflow_ctl.domain.telemetry import EngineSnapshot


def _memo(
    roof: Roofline, batch: int, context: int, prefix: int, step: int
) -> tuple[Callable[[int], float], dict[int, float]]:
    seen: dict[int, float] = {}

    def t_of(n: int) -> float:
        t = seen.get(n)
        if t is None:
            t = seen[n] = roof.step_s(batch, context, n * step, prefix)
        return t

    return t_of, seen


def _reference_last_fitting(
    t_of: Callable[[int], float],
    budget: float,
    lo: int,
    t_lo: float,
    top: int,
    t_zero: float,
    scale: int = 1,
) -> tuple[int, float]:
    hi = top + 1
    a_n, a_t, b_n, b_t = 0, t_zero, lo, t_lo
    while hi - lo > 1:
        slope = (b_t - a_t) / (b_n - a_n)
        guess = hi - 1 if slope <= 0.0 else b_n + int((budget - b_t) / slope)
        n = min(hi - 1, max(lo + 1, guess))
        t_n = t_of(n)
        a_n, a_t, b_n, b_t = b_n, b_t, n, t_n
        if t_n <= budget:
            lo, t_lo = n, t_n
        else:
            hi = n
    return lo * scale, t_lo


def _reference_largest(
    t_of: Callable[[int], float], budget_s: float, step: int, top: int, base_s: float
) -> tuple[int, float]:
    if top < 1:
        return 0, 0.0
    t_one = t_of(1)
    if t_one > budget_s:
        return 0, 0.0
    return _reference_last_fitting(t_of, budget_s, 1, t_one, top, base_s, step)


def _reference_best_chunk(
    roof: Roofline,
    budget_s: float,
    batch: int,
    context: int,
    prefix: int,
    step: int,
    max_chunk: int,
) -> tuple[int, float]:
    base = roof.step_s(batch, context)
    t_of, seen = _memo(roof, batch, context, prefix, step)
    size, t = _reference_largest(t_of, budget_s, step, max_chunk // step, base)
    n = size // step
    if n <= 1:
        return size, t
    above = seen.get(n + 1)
    if above is not None and (above - t) * n <= t:
        return size, t
    if (n - 1) / t_of(n - 1) <= n / t:
        return size, t
    lo, hi = 1, n - 1
    while hi - lo > 2:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if m1 / t_of(m1) < m2 / t_of(m2):
            lo = m1 + 1
        else:
            hi = m2
    best = max(range(lo, hi + 1), key=lambda k: k / t_of(k))
    return best * step, t_of(best)


search_inputs = (
    st.sampled_from(sorted(MODEL_PRESETS)),
    st.sampled_from(sorted(NODE_PRESETS)),
    st.floats(0.001, 0.5),
    st.integers(0, 512),
    st.integers(0, 100_000),
    st.sampled_from([0, 128, 4_096, 40_960, 200_000]) | st.integers(0, 300_000),
    st.sampled_from([64, 256, 512, 1_000]),
    st.integers(0, 128),
)

batch_search_inputs = (
    st.sampled_from(sorted(MODEL_PRESETS)),
    st.sampled_from(sorted(NODE_PRESETS)),
    st.floats(0.001, 0.5),
    st.integers(0, 512),
    st.integers(0, 200_000),
    st.integers(1, 20_000),
    st.integers(1, 4_096),
)
"""The decode batch's room search: model, node, budget, batch, context, length, cap."""


@settings(max_examples=400, deadline=None)
@given(*search_inputs)
def test_the_inline_chunk_searches_return_what_the_callback_search_returns(
    model: str,
    node: str,
    budget: float,
    batch: int,
    per_request: int,
    prefix: int,
    step: int,
    steps: int,
) -> None:
    roof = roofline(MODEL_PRESETS[model], NODE_PRESETS[node])
    context = batch * per_request
    max_chunk = max(1, steps * step)
    t_of, _ = _memo(roof, batch, context, prefix, step)
    base = roof.step_s(batch, context)
    expected = _reference_largest(t_of, budget, step, max_chunk // step, base)
    assert largest_chunk(roof, budget, batch, context, prefix, step, max_chunk) == expected
    assert best_chunk(roof, budget, batch, context, prefix, step, max_chunk) == (
        _reference_best_chunk(roof, budget, batch, context, prefix, step, max_chunk)
    )


@settings(max_examples=200, deadline=None)
@given(*batch_search_inputs)
def test_the_decode_batch_search_matches_the_reference_search(
    model: str, node: str, budget: float, batch: int, context: int, length: int, cap: int
) -> None:
    """The decode batch's room (the slots credit) walks the batch, not the chunk."""
    roof = roofline(MODEL_PRESETS[model], NODE_PRESETS[node])

    def t_of(b: int) -> float:
        return roof.step_s(batch + b, context + b * length)

    base = roof.step_s(batch, context)
    t_one = t_of(1)
    expected = (
        (0, 0.0) if t_one > budget else _reference_last_fitting(t_of, budget, 1, t_one, cap, base)
    )
    n, seen = fit_along(roof, budget, batch, context, 0, 1, length, 0, cap, base)
    assert ((n, seen[n]) if n else (0, 0.0)) == expected


@settings(max_examples=400, deadline=None)
@given(*search_inputs, st.integers(0, 20_000))
def test_a_guess_changes_no_answer_of_the_searches(
    model: str,
    node: str,
    budget: float,
    batch: int,
    per_request: int,
    prefix: int,
    step: int,
    steps: int,
    guess: int,
) -> None:
    """A seeded search (the agent seeds each period's with the last answer) returns what an
    unseeded one does, whatever the seed: the answer, its step time and the next one's. Seeds
    at and next to the answer take best_chunk's shortcut for a seed that still holds."""
    roof = roofline(MODEL_PRESETS[model], NODE_PRESETS[node])
    context = batch * per_request
    max_chunk = max(1, steps * step)
    base = roof.step_s(batch, context)
    top = max_chunk // step
    args = (roof, budget, batch, context, prefix, 0, 0, step, top, base)
    n, seen = fit_along(*args)
    best = best_chunk(roof, budget, batch, context, prefix, step, max_chunk, base)[0] // step
    for hint in (guess % (top + 2), guess, n, n - 1, n + 1, best):
        m, seeded = fit_along(*args, hint)
        assert m == n
        assert [seeded.get(k) for k in (n, n + 1) if k in seen] == [
            seen[k] for k in (n, n + 1) if k in seen
        ]
        assert best_chunk(
            roof, budget, batch, context, prefix, step, max_chunk, base, hint * step
        ) == (best_chunk(roof, budget, batch, context, prefix, step, max_chunk, base))


@settings(max_examples=200, deadline=None)
@given(*batch_search_inputs, st.integers(0, 5_000))
def test_a_guess_changes_no_answer_of_the_decode_batch_search(
    model: str,
    node: str,
    budget: float,
    batch: int,
    context: int,
    length: int,
    cap: int,
    guess: int,
) -> None:
    """The decode batch's room, seeded with a period ago's (as compute_capacity seeds it),
    returns what the unseeded search does, whatever the seed."""
    roof = roofline(MODEL_PRESETS[model], NODE_PRESETS[node])
    base = roof.step_s(batch, context)
    args = (roof, budget, batch, context, length, cap, base)
    n = _extra_batch(*args)[0]
    for hint in (guess % (cap + 2), guess, n, n - 1, n + 1):
        assert _extra_batch(*args, hint) == _extra_batch(*args)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(sorted(MODEL_PRESETS)),
    st.sampled_from(sorted(NODE_PRESETS)),
    st.integers(0, 256),
    st.integers(0, 60_000),
    st.integers(0, 4_096),
    st.integers(0, 64),
    st.integers(0, 4_096),
)
def test_a_previous_breakdown_changes_no_capacity(
    model: str,
    node: str,
    batch: int,
    per_request: int,
    chunk_guess: int,
    extra_guess: int,
    far_guess: int,
) -> None:
    """compute_capacity seeds its searches from the last period's breakdown: any breakdown
    gives the same capacity as none (its own included, the usual case a period later)."""
    spec, profile, lease = MODEL_PRESETS[model], NODE_PRESETS[node], LeaseSettings()
    snap = EngineSnapshot(
        taken_at_ms=0,
        running_requests=batch,
        kv_used_tokens=100_000,
        kv_total_tokens=400_000,
        decode_context_tokens=batch * per_request,
    )
    fresh = compute_capacity(snap, spec, profile, lease)
    seed = fresh._replace(
        chunk_tokens=chunk_guess, extra_batch=extra_guess, far_chunk_tokens=far_guess
    )
    assert compute_capacity(snap, spec, profile, lease, previous=seed) == fresh
    assert compute_capacity(snap, spec, profile, lease, previous=fresh) == fresh
