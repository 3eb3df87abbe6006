"""Windows from two scrapes' step counters: deltas, broken windows, steps estimated where the
engine counts none, and the step-size histogram read as a mix of decode and chunk steps."""

from __future__ import annotations

import pytest

from crossflow_ctl.domain.step_windows import StepTotals, step_window
from tests.domain.test_step_fit import BUCKETS


def totals(at_s: float, **values: object) -> StepTotals:
    return StepTotals.model_validate({"at_s": at_s, **values})


def test_a_window_is_the_difference_of_two_scrapes() -> None:
    before = totals(0.0, steps=100, decode_tokens=800, itl_sum_s=8.0, itl_count=790,
                    prefill_tokens=5000, cached_tokens=1000, prompts=10, running_requests=8,
                    context_tokens=20_000, kv_total_tokens=100_000)  # fmt: skip
    now = totals(5.0, steps=200, decode_tokens=1800, itl_sum_s=13.0, itl_count=1790,
                 prefill_tokens=9000, cached_tokens=3000, prompts=14, running_requests=12,
                 context_tokens=30_000, kv_total_tokens=100_000)  # fmt: skip
    w = step_window(before, now)
    assert w is not None
    assert (w.window_s, w.steps, w.decode_tokens, w.prefill_tokens) == (5.0, 100, 1000, 4000)
    assert w.batch == 10 and w.chunk == 40
    assert w.itl_s == pytest.approx(5.0 / 1000)
    assert w.context_tokens == 25_000
    assert w.prefix_tokens == 500  # 2000 cached tokens over 4 prompts
    # no histogram: steps with no prefill and steps with a 2048-token chunk, mean 40
    assert sum(s for s, _ in w.mix) == pytest.approx(1.0)
    assert sum(s * p for s, p in w.mix) == pytest.approx(40.0)


def test_a_counter_that_went_back_breaks_the_window() -> None:
    before = totals(0.0, steps=100, decode_tokens=800)
    assert step_window(before, totals(5.0, steps=10, decode_tokens=900)) is None
    assert step_window(before, totals(5.0, steps=110, decode_tokens=10)) is None
    assert step_window(before, totals(0.0, steps=110, decode_tokens=900)) is None


def test_without_a_step_counter_steps_are_output_tokens_over_the_batch() -> None:
    """SGLang: one token per running request per step."""
    w = step_window(
        totals(0.0, decode_tokens=0, running_requests=8, itl_count=0),
        totals(2.0, decode_tokens=1200, running_requests=12, itl_count=1200, itl_sum_s=30.0),
    )
    assert w is not None
    assert w.steps == pytest.approx(120.0)
    assert w.batch == pytest.approx(10.0)


def test_the_step_size_histogram_tells_decode_steps_from_chunk_steps() -> None:
    """90 decode steps of 13 tokens and 10 with a 1024-token chunk: the bucket (1024, 2048]
    holds the chunk steps; the mean alone (102 tokens a step) would touch every expert."""

    def hist(counts: dict[float, float]) -> tuple[tuple[float, float], ...]:
        cum, out = 0.0, []
        for le in BUCKETS:
            cum += counts.get(le, 0.0)
            out.append((float(le), cum))
        return tuple(out)

    before = totals(0.0, steps=0, step_tokens_sum=0, step_token_buckets=hist({}))
    now = totals(
        1.0, steps=100, decode_tokens=1300, prefill_tokens=10_240, itl_sum_s=1.0,
        itl_count=1300, step_tokens_sum=1300 + 10_240,
        step_token_buckets=hist({16: 90, 2048: 10}),
    )  # fmt: skip
    w = step_window(before, now)
    assert w is not None
    assert w.mix == ((0.9, 0.0), (0.1, 1024.0))
