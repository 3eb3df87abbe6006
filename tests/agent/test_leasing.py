"""The capacity model and zero-lease rules: monotonicity, the SLO edge, hysteresis, reasons."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossflow_ctl.domain.capacity import (
    MODEL_PRESETS,
    NODE_PRESETS,
    StepShape,
    prefill_rate_tps,
    prefill_time_s,
    roofline,
    step_time_s,
)
from crossflow_ctl.domain.lease_credits import LeaseSettings, compute_capacity, lease_terms
from crossflow_ctl.domain.leasing import (
    ItlGuard,
    decide,
    implausibility,
    modelled_queue_wait_ms,
    pool_load,
)
from crossflow_ctl.domain.lending import FAR_PREFIX_TOKENS, OpenDebits, fine_chunk
from crossflow_ctl.domain.models import ZeroReason
from crossflow_ctl.domain.telemetry import EngineSnapshot

MODEL = MODEL_PRESETS["gpt-oss-120b"]
NODE = NODE_PRESETS["h200"]
NOW = 1_700_000_000_000
LS = LeaseSettings(itl_slo_ms=50.0)


def snap(
    running: int = 16, context: int = 16 * 4000, used: int | None = None, **kw
) -> EngineSnapshot:
    base = {
        "taken_at_ms": NOW,
        "running_requests": running,
        "decode_context_tokens": context,
        "kv_used_tokens": context if used is None else used,
        "kv_total_tokens": 1_000_000,
        "itl_p50_ms": 20.0,
        "itl_p99_ms": 25.0,
    }
    base.update(kw)
    return EngineSnapshot(**base)


def test_a_quiet_node_offers_every_credit() -> None:
    cap = compute_capacity(snap(), MODEL, NODE, LS)
    c = cap.credits
    assert c.compute_tokens > 0 and c.kv_tokens > 0 and c.slots > 0 and c.output_tokens > 0
    assert c.kv_transfer_bytes > 0
    # the chosen chunk respects the budget; the rate is the cost line's at the reference prefix
    assert 0 < cap.chunk_step_s <= LS.budget_s
    a, b = cap.coefficients
    assert a == pytest.approx(cap.chunk_step_s / cap.chunk_tokens) and b > 0
    assert cap.borrowed_prefill_rate_tps == pytest.approx(1 / (a + b * LS.borrowed_prefix_tokens))
    assert c.compute_tokens == int(cap.borrowed_prefill_rate_tps * LS.horizon_s)
    # the line's far point: the chunk the breakdown reports, in the budget over the far prefix
    far = cap.far_chunk_tokens
    t_far = roofline(MODEL, NODE).step_s(16, 16 * 4000, far, FAR_PREFIX_TOKENS)
    assert far > 0 and t_far <= LS.budget_s
    assert b == max(0.0, (t_far / far - a) / FAR_PREFIX_TOKENS)
    # kv = free - (5% of total + 256 per running request)
    assert c.kv_tokens == (1_000_000 - 64_000) - (50_000 + 256 * 16)

    # transfer: 25 GB/s x the horizon, capped by the kv credit in bytes (binding at 8 s) ...
    assert c.kv_transfer_bytes == min(
        int(25e9 * LS.horizon_s), c.kv_tokens * MODEL.kv_bytes_per_token
    )
    # ... and the network's share when that is the lower (2 s)
    short = compute_capacity(snap(), MODEL, NODE, LS.model_copy(update={"horizon_ms": 2_000}))
    assert short.credits.kv_transfer_bytes == int(25e9 * 2.0)


def test_no_far_chunk_when_none_fits_over_the_far_prefix() -> None:
    """A load where a chunk fits with no prefix but no grid chunk over the far prefix: the
    line's far point is the chunk the engine runs there instead, the best below one grid step
    (issue 33: one grid step broke the budget), and the breakdown says no grid chunk fits
    (review rT)."""
    tight = compute_capacity(snap(running=32, context=32 * 4000), MODEL, NODE, LS)
    assert tight.chunk_tokens > 0 and tight.far_chunk_tokens == 0
    step = LS.chunk_step_tokens
    roof = roofline(MODEL, NODE)
    assert roof.step_s(32, 32 * 4000, step, FAR_PREFIX_TOKENS) > LS.budget_s
    fine, t_fine = fine_chunk(roof, LS.budget_s, 32, 32 * 4000, FAR_PREFIX_TOKENS, step)
    assert 0 < fine < step and t_fine <= LS.budget_s
    a, b = tight.coefficients
    assert b == max(0.0, (t_fine / fine - a) / FAR_PREFIX_TOKENS)


def test_lease_terms_follow_each_settings_object() -> None:
    # worked out once per (model, node, settings) and looked up by identity: a copy with other
    # figures gets its own terms, never the first one's
    terms = lease_terms(MODEL, NODE, LS)
    assert lease_terms(MODEL, NODE, LS) is terms
    assert terms.roof is roofline(MODEL, NODE)
    assert (terms.budget_s, terms.horizon_s) == (LS.budget_s, LS.horizon_s)
    tight = LS.model_copy(update={"itl_slo_ms": 20.0, "horizon_ms": 2_000})
    other = lease_terms(MODEL, NODE, tight)
    assert (other.budget_s, other.horizon_s) == (tight.budget_s, 2.0)
    assert other.transfer_bytes == NODE.network_bytes_per_s * 2.0
    assert lease_terms(MODEL, NODE, LS) is terms


def test_outstanding_borrowed_work_lowers_compute_and_sets_queue_wait() -> None:
    idle = compute_capacity(snap(), MODEL, NODE, LS)
    busy = compute_capacity(snap(outstanding_uncached_tokens=5000), MODEL, NODE, LS)
    # work no reservation accounts for is costed at the far prefix (its prefixes are unknown)
    a, b = busy.coefficients
    per_token_s = a + b * FAR_PREFIX_TOKENS
    rate = busy.borrowed_prefill_rate_tps
    assert busy.credits.compute_tokens == int(rate * (LS.horizon_s - 5000 * per_token_s))
    assert busy.credits.compute_tokens < idle.credits.compute_tokens - 5000
    assert busy.queue_wait_ms == pytest.approx(5000 * per_token_s * 1000)
    # the part the broker's open debits count is its to add (lending.queue_wait_ms): here a
    # reservation of 2,000 uncached tokens (kv debit = uncached + output)
    ledger = OpenDebits(kv=2100, output=100)
    seen = compute_capacity(snap(outstanding_uncached_tokens=5000), MODEL, NODE, LS, ledger)
    assert seen.queue_wait_ms == pytest.approx(3000 * per_token_s * 1000)


def test_kv_promised_to_the_waiting_queue_is_not_offered() -> None:
    idle = compute_capacity(snap(), MODEL, NODE, LS)
    # the engine tells the waiting requests' KV: taken off as told (one of 30,000 tokens)
    told = compute_capacity(snap(kv_waiting_requests=1, kv_waiting_tokens=30_000), MODEL, NODE, LS)
    assert told.kv_promised_tokens == 30_000
    assert told.credits.kv_tokens == idle.credits.kv_tokens - 30_000
    # only how many wait: each at the settings' estimate
    counted = compute_capacity(snap(kv_waiting_requests=3), MODEL, NODE, LS)
    assert counted.kv_promised_tokens == 3 * LS.waiting_request_kv_tokens
    assert counted.credits.kv_tokens == idle.credits.kv_tokens - 3 * LS.waiting_request_kv_tokens
    # no more than the room there is, and the other credits are left alone
    full = compute_capacity(snap(kv_waiting_tokens=10**6), MODEL, NODE, LS)
    assert full.credits.kv_tokens == 0 and full.credits.kv_transfer_bytes == 0
    assert full.credits.compute_tokens == idle.credits.compute_tokens
    assert full.credits.slots == idle.credits.slots
    assert "promised to the waiting queue 1000000" in "\n".join(full.explain(LS))


def test_zero_compute_when_the_decode_step_alone_reaches_the_slo_budget() -> None:
    # find a context that makes the bare decode step exceed the budget
    context = 16 * 4000
    while step_time_s(MODEL, NODE, StepShape(batch=16, context_tokens=context)) <= LS.budget_s:
        context *= 2
    cap = compute_capacity(snap(context=context, used=0), MODEL, NODE, LS)
    assert cap.credits.compute_tokens == 0 and cap.credits.slots == 0
    d = decide(
        snap(context=context, used=0),
        now_ms=NOW,
        model=MODEL,
        node=NODE,
        settings=LS,
        guard=ItlGuard(),
    )
    assert d.zero_reason is ZeroReason.NO_CAPACITY and d.credits.is_zero()


def test_observed_itl_at_the_slo_gives_a_zero_lease() -> None:
    d = decide(
        snap(itl_p99_ms=50.0), now_ms=NOW, model=MODEL, node=NODE, settings=LS, guard=ItlGuard()
    )
    assert d.zero_reason is ZeroReason.ITL_OVER_SLO
    lease = d.to_lease(node_id="n1", epoch=1, version=1, ttl_ms=600, last_notice_seq=0)
    assert lease.credits.is_zero() and lease.itl_ms == 50.0 and lease.itl_slo_ms == 50.0


def test_itl_hysteresis_does_not_flap() -> None:
    s = LeaseSettings(itl_slo_ms=50.0, itl_clear_ratio=0.8, itl_clear_after=3)
    g = ItlGuard().observe(55.0, s)
    assert g.tripped
    # just under the SLO but above 40 ms: stays tripped, streak stays 0
    g = g.observe(45.0, s)
    assert g.tripped and g.good_streak == 0
    g = g.observe(30.0, s).observe(30.0, s)
    assert g.tripped and g.good_streak == 2
    g2 = g.observe(45.0, s)  # a bad-ish sample resets the streak
    assert g2.tripped and g2.good_streak == 0
    assert g.observe(None, s) == g  # no samples while requests run: no information
    g = g.observe(None, s, idle=True)  # nothing running counts as below
    assert not g.tripped
    assert not ItlGuard().observe(49.9, s).tripped


def test_a_window_without_samples_reports_the_last_measured_itl() -> None:
    busy = snap(itl_p50_ms=None, itl_p99_ms=None)
    g = ItlGuard().observe(30.0, LS)
    d = decide(busy, now_ms=NOW, model=MODEL, node=NODE, settings=LS, guard=g)
    assert d.itl_ms == 30.0 and d.guard.last_itl_ms == 30.0
    idle = snap(running=0, context=0, used=0, itl_p50_ms=None, itl_p99_ms=None)
    d = decide(idle, now_ms=NOW, model=MODEL, node=NODE, settings=LS, guard=g)
    assert d.itl_ms == 0.0


def test_rule_order_and_reasons() -> None:
    assert (
        decide(
            None,
            failure="connect refused",
            now_ms=NOW,
            model=MODEL,
            node=NODE,
            settings=LS,
            guard=ItlGuard(),
        ).zero_reason
        is ZeroReason.TELEMETRY_MISSING
    )
    old = snap(taken_at_ms=NOW - 5000)
    d = decide(old, now_ms=NOW, model=MODEL, node=NODE, settings=LS, guard=ItlGuard())
    assert d.zero_reason is ZeroReason.TELEMETRY_STALE and "5000 ms" in d.zero_detail
    bad = snap(used=2_000_000)
    d = decide(bad, now_ms=NOW, model=MODEL, node=NODE, settings=LS, guard=ItlGuard())
    assert d.zero_reason is ZeroReason.TELEMETRY_IMPLAUSIBLE and "kv_used_tokens" in d.zero_detail
    assert (
        decide(
            snap(), cordoned=True, now_ms=NOW, model=MODEL, node=NODE, settings=LS, guard=ItlGuard()
        ).zero_reason
        is ZeroReason.CORDONED
    )
    good = decide(snap(), now_ms=NOW, model=MODEL, node=NODE, settings=LS, guard=ItlGuard())
    assert good.zero_reason is None and not good.credits.is_zero()
    lease = good.to_lease(node_id="n1", epoch=7, version=3, ttl_ms=600, last_notice_seq=9)
    assert lease.credits == good.credits and lease.last_notice_seq == 9
    assert lease.snapshot_unix_ms == NOW
    assert lease.horizon_ms == LS.horizon_ms  # what the broker scales output and transfer by


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("running_requests", -1, "negative"),
        ("generation_rate_tps", math.nan, "nan"),
        ("itl_p99_ms", math.inf, "inf"),
        ("kv_total_tokens", 0, "kv_total_tokens is 0"),
        ("decode_context_tokens", 10**12, "absurd"),
    ],
)
def test_implausible_snapshots_are_named(field: str, value: float, needle: str) -> None:
    s = snap().model_copy(update={field: value})
    assert needle in implausibility(s)


def test_decode_throughput_is_sublinear_in_batch() -> None:
    prev_per_request = math.inf
    prev_tps = 0.0
    for batch in (1, 2, 4, 8, 16, 32, 64, 128):
        cap = compute_capacity(snap(running=batch, context=batch * 4000, used=0), MODEL, NODE, LS)
        tps = cap.decode_throughput_tps
        assert tps > prev_tps  # batching still helps ...
        assert tps / batch < prev_per_request  # ... but each request gets less
        prev_tps, prev_per_request = tps, tps / batch


def test_prefill_pool_load_from_snapshot() -> None:
    s = snap(
        running=4,
        outstanding_uncached_tokens=12_000,
        prefill_processing_rate_tps=8000.0,
        queued_requests=3,
    )
    load = pool_load(s, now_ms=NOW, node_id="p1", pool="default", ttl_ms=600, settings=LS)
    assert load is not None
    assert load.outstanding_uncached_tokens == 12_000 and load.processing_rate_tps == 8000.0
    assert load.prefill_rate_tps == 2000.0 and load.queued_requests == 3
    assert pool_load(None, now_ms=NOW, node_id="p1", pool="d", ttl_ms=600, settings=LS) is None
    stale = snap(taken_at_ms=NOW - 10_000)
    assert pool_load(stale, now_ms=NOW, node_id="p1", pool="d", ttl_ms=600, settings=LS) is None


def test_a_prefill_server_reports_its_wait_in_time_priced_on_its_roofline() -> None:
    """3 queued prompts of 4,000 uncached tokens after a 500,000-token cached prefix: the wait
    is three such prefills on the roofline (the prefix's attention cost is most of it), not
    12,000 tokens at the server's rate. A source's own figure wins; without a cached-prefix
    mean there is none."""
    roof, chunk = roofline(MODEL, NODE), LS.prefill_chunk_tokens
    queued = snap(
        running=1,
        outstanding_uncached_tokens=12_000,
        queued_requests=3,
        prefill_processing_rate_tps=8000.0,
        prefill_mean_cached_tokens=500_000.0,
    )
    one = prefill_time_s(roof, 4_000, 500_000, chunk)
    assert one > 3 * prefill_time_s(roof, 4_000, 0, chunk)
    wait = modelled_queue_wait_ms(queued, roof, chunk)
    assert wait is not None and wait == pytest.approx(3 * one * 1000.0, rel=0.05)
    kw = {"now_ms": NOW, "node_id": "p1", "pool": "d", "ttl_ms": 600, "settings": LS}
    load = pool_load(queued, roof=roof, **kw)  # type: ignore[arg-type]
    assert load is not None and load.queue_wait_ms == pytest.approx(wait)
    assert load.queue_wait_ms > 1.5 * 12_000 / 8000.0 * 1000.0  # tokens over rate: 1.5 s
    told = queued.model_copy(update={"prefill_queue_wait_ms": 1234.0})
    told_load = pool_load(told, roof=roof, **kw)  # type: ignore[arg-type]
    assert told_load is not None and told_load.queue_wait_ms == 1234.0
    unknown = queued.model_copy(update={"prefill_mean_cached_tokens": None})
    assert modelled_queue_wait_ms(unknown, roof, chunk) is None
    unknown_load = pool_load(unknown, roof=roof, **kw)  # type: ignore[arg-type]
    assert unknown_load is not None and unknown_load.queue_wait_ms is None
    idle = queued.model_copy(update={"queued_requests": 0, "outstanding_uncached_tokens": 0})
    assert modelled_queue_wait_ms(idle, roof, chunk) == 0.0


def test_short_queued_prompts_are_priced_batched_as_engines_run_them() -> None:
    """20 queued prompts of 200 uncached tokens after a 2,000-token prefix: the engine runs them
    as one chunk-sized step, not 20 steps each with its own fixed cost (which read ~9x long and
    held Demand on a pool that was not behind)."""
    roof, chunk = roofline(MODEL, NODE), LS.prefill_chunk_tokens
    queued = snap(
        running=0,
        outstanding_uncached_tokens=4_000,
        queued_requests=20,
        prefill_processing_rate_tps=8000.0,
        prefill_mean_cached_tokens=2_000.0,
    )
    wait = modelled_queue_wait_ms(queued, roof, chunk)
    batched = roof.step_s(0, 0, 4_000, 2_000) * 1000.0
    assert wait == pytest.approx(batched)
    assert wait < 20 * prefill_time_s(roof, 200, 2_000, chunk) * 1000.0 / 3
    # more than a chunk's worth: full steps and a last partial one
    many = queued.model_copy(update={"queued_requests": 100, "outstanding_uncached_tokens": 20_000})
    per_step = chunk // 200
    full, last = divmod(100, per_step)
    expected = full * roof.step_s(0, 0, per_step * 200, 2_000)
    expected += roof.step_s(0, 0, last * 200, 2_000) if last else 0.0
    assert modelled_queue_wait_ms(many, roof, chunk) == pytest.approx(expected * 1000.0)


def test_a_wait_no_source_could_mean_is_not_reported() -> None:
    """A source's wait that cannot be one makes the snapshot implausible: no report (the pool's
    load then expires: fail-closed), not an error. Chunks too small to price give no wait."""
    kw = {"now_ms": NOW, "node_id": "p1", "pool": "d", "ttl_ms": 600, "settings": LS}
    for bad in (-1.0, float("nan"), float("inf")):
        told = snap(queued_requests=1, outstanding_uncached_tokens=10, prefill_queue_wait_ms=bad)
        assert pool_load(told, **kw) is None  # type: ignore[arg-type]
    tiny_chunks = snap(
        queued_requests=1, outstanding_uncached_tokens=1_000_000, prefill_mean_cached_tokens=0.0
    )
    assert modelled_queue_wait_ms(tiny_chunks, roofline(MODEL, NODE), 1) is None


def test_a_prefill_server_that_idled_reports_its_modelled_rate_not_its_throughput() -> None:
    """A burst after a lull: 16,000 tokens queued, 1,000 tok/s processed over a mostly idle
    window. The wait is what the server drains, not 16 s at the window's throughput."""
    model_rate = prefill_rate_tps(MODEL, NODE, LS.prefill_chunk_tokens)
    assert model_rate == pytest.approx(8192 / roofline(MODEL, NODE).step_s(0, 0, 8192))
    burst = snap(running=1, outstanding_uncached_tokens=16_000, prefill_processing_rate_tps=1000.0)
    load = pool_load(
        burst, now_ms=NOW, node_id="p1", pool="d", ttl_ms=600, settings=LS,
        modelled_rate_tps=model_rate,
    )  # fmt: skip
    assert load is not None
    assert load.processing_rate_tps == pytest.approx(model_rate)
    assert load.prefill_rate_tps == pytest.approx(model_rate)
    # a fully idle window (no rate at all) no longer reads as an endless wait
    idle = snap(
        running=0, context=0, outstanding_uncached_tokens=16_000, prefill_processing_rate_tps=0.0
    )
    load = pool_load(
        idle, now_ms=NOW, node_id="p1", pool="d", ttl_ms=600, settings=LS,
        modelled_rate_tps=model_rate,
    )  # fmt: skip
    assert load is not None and load.processing_rate_tps == pytest.approx(model_rate)
    assert load.prefill_rate_tps == pytest.approx(model_rate)
    # an observed rate above the model's is the truth, and is kept
    fast = snap(running=2, outstanding_uncached_tokens=16_000, prefill_processing_rate_tps=2e6)
    load = pool_load(
        fast, now_ms=NOW, node_id="p1", pool="d", ttl_ms=600, settings=LS,
        modelled_rate_tps=model_rate,
    )  # fmt: skip
    assert load is not None and load.processing_rate_tps == 2e6
    assert load.prefill_rate_tps == 1e6


# -- properties ----------------------------------------------------------------------------------

models = st.sampled_from(sorted(MODEL_PRESETS))
nodes = st.sampled_from(sorted(NODE_PRESETS))
running = st.integers(min_value=0, max_value=256)
per_request_context = st.integers(min_value=1, max_value=32_000)
slos = st.floats(min_value=5.0, max_value=500.0)


def _credits(model: str, node: str, b: int, c: int, slo: float):
    s = LeaseSettings(itl_slo_ms=slo, max_chunk_tokens=8192)
    snapshot = snap(running=b, context=c if b else 0, used=0)
    return compute_capacity(
        snapshot, MODEL_PRESETS[model], NODE_PRESETS[node], s
    ).credits.as_tuple()


def _le(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return all(x <= y for x, y in zip(a, b, strict=True))


@settings(max_examples=60, deadline=None)
@given(models, nodes, running, st.integers(min_value=1, max_value=64), per_request_context, slos)
def test_more_running_requests_never_raise_a_credit(model, node, b, extra, ctx, slo) -> None:
    fewer = _credits(model, node, b, b * ctx, slo)
    more = _credits(model, node, b + extra, (b + extra) * ctx, slo)
    assert _le(more, fewer)


@settings(max_examples=60, deadline=None)
@given(
    models,
    nodes,
    st.integers(min_value=1, max_value=256),
    per_request_context,
    st.integers(min_value=1, max_value=10**6),
    slos,
)
def test_longer_contexts_never_raise_a_credit(model, node, b, ctx, longer, slo) -> None:
    short = _credits(model, node, b, b * ctx, slo)
    long = _credits(model, node, b, b * ctx + longer, slo)
    assert _le(long, short)


@settings(max_examples=60, deadline=None)
@given(
    models,
    nodes,
    running,
    per_request_context,
    st.integers(min_value=0, max_value=64),
    st.integers(min_value=1, max_value=64),
    st.one_of(st.none(), st.integers(min_value=0, max_value=2 * 10**6)),
    st.integers(min_value=1, max_value=10**6),
)
def test_more_kv_promised_to_waiting_requests_never_raises_a_credit(
    model, node, b, ctx, waiting, more, tokens, extra_tokens
) -> None:
    def credits(n: int, kv: int | None) -> tuple[int, ...]:
        snapshot = snap(
            running=b, context=b * ctx if b else 0, kv_waiting_requests=n, kv_waiting_tokens=kv
        )
        s = LeaseSettings(max_chunk_tokens=8192)
        return compute_capacity(
            snapshot, MODEL_PRESETS[model], NODE_PRESETS[node], s
        ).credits.as_tuple()

    # more requests waiting (their KV estimated), or more KV told for them
    assert _le(credits(waiting + more, None), credits(waiting, None))
    if tokens is not None:
        assert _le(credits(waiting, tokens + extra_tokens), credits(waiting, tokens))


@settings(max_examples=60, deadline=None)
@given(models, nodes, running, per_request_context, slos, st.floats(min_value=1.0, max_value=4.0))
def test_a_looser_slo_never_lowers_a_credit(model, node, b, ctx, slo, factor) -> None:
    tight = _credits(model, node, b, b * ctx, slo)
    loose = _credits(model, node, b, b * ctx, slo * factor)
    assert _le(tight, loose)
