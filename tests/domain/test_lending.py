"""Borrowed-work cost and accounting: chunk search, per-prompt cost, open debits (issue #10)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossflow_ctl.domain.admission import AdmissionRequest, debit_for, pulled_tokens
from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS, roofline
from crossflow_ctl.domain.lease_credits import LeaseSettings, compute_capacity
from crossflow_ctl.domain.lending import (
    FAR_PREFIX_TOKENS,
    ChunkSizer,
    OpenDebits,
    best_chunk,
    compute_debit,
    largest_chunk,
    queue_wait_ms,
)
from crossflow_ctl.domain.models import MAX_MS, Credits, Lease, Notice, NoticeKind
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.domain.telemetry import EngineSnapshot

GPT_OSS = MODEL_PRESETS["gpt-oss-120b"]
H200, GB300 = NODE_PRESETS["h200"], NODE_PRESETS["gb300"]
models = st.sampled_from(sorted(MODEL_PRESETS))
nodes = st.sampled_from(sorted(NODE_PRESETS))

HORIZON_S = LeaseSettings().horizon_s
"""The default borrow horizon, over which the compute credit is sized."""


@settings(max_examples=80, deadline=None)
@given(
    models,
    nodes,
    st.floats(0.005, 0.5),
    st.integers(0, 256),
    st.integers(0, 4000),
    st.integers(0, 64_000),
    st.sampled_from([64, 256, 512]),
    st.integers(1, 64),
)
def test_chunk_searches_match_a_scan_of_the_grid(
    model, node, budget, batch, per_request, prefix, step, steps
) -> None:  # type: ignore[no-untyped-def]
    r = roofline(MODEL_PRESETS[model], NODE_PRESETS[node])
    context = batch * per_request
    grid = [k * step for k in range(1, steps + 1)]
    fits = [(p, r.step_s(batch, context, p, prefix)) for p in grid]
    fits = [(p, t) for p, t in fits if t <= budget]
    got = largest_chunk(r, budget, batch, context, prefix, step, steps * step)
    assert got == (fits[-1] if fits else (0, 0.0))
    best = best_chunk(r, budget, batch, context, prefix, step, steps * step)
    if not fits:
        assert best == (0, 0.0)
    else:
        top_rate = max(p / t for p, t in fits)
        assert best[0] / best[1] == pytest.approx(top_rate, rel=1e-9)


def test_a_longer_prefix_gets_a_smaller_chunk_within_the_same_budget() -> None:
    """The engine sizes each borrowed prompt's chunk for its prefix, so a 36k-token prefix keeps
    the step inside the ITL budget instead of overrunning it (the 8k-prefix sizing did)."""
    sizer = ChunkSizer(roofline(GPT_OSS, GB300), 0.045, 256, 16_384)
    r = sizer.roof
    short, long = sizer.chunk(16, 64_000, 8_192), sizer.chunk(16, 64_000, 36_000)
    assert 0 < long < short
    assert r.step_s(16, 64_000, long, 36_000) <= 0.045
    assert r.step_s(16, 64_000, short, 36_000) > 0.045  # the 8k-sized chunk overruns
    # a guess (the simulator passes the prompt's last chunk) changes nothing but the work
    for guess in (256, 512, long, long + 256, short, 16_384, 1 << 20):
        assert sizer.chunk(16, 64_000, 36_000, guess) == long
        assert sizer.chunk(16, 64_000, 8_192, guess) == short


def test_over_a_long_prefix_the_engine_runs_a_smaller_chunk_or_none_never_one_over_budget() -> None:
    """Issue 33: on h200 a 256-token chunk over an 85k-token prefix with four decode requests
    took 50.1 ms (every expert's padded tile), past the 50 ms SLO; the old rule ran it anyway
    ("at least one grid step"). Now the best chunk below the grid that fits runs, and with a
    batch so heavy that no piece fits, none: the step decodes only."""
    sizer = ChunkSizer(roofline(GPT_OSS, H200), 0.045, 256, 16_384)
    r = sizer.roof
    assert r.step_s(4, 107_701, 256, 85_184) > 0.050
    p = sizer.chunk(4, 107_701, 85_184)
    assert 0 < p < 256 and p % 16 == 0
    assert r.step_s(4, 107_701, p, 85_184) <= 0.045 < r.step_s(4, 107_701, p + 16, 85_184)
    heavy = 2_000_000  # a decode batch whose own step is near the budget
    assert r.step_s(32, heavy) <= 0.045 < r.step_s(32, heavy, 16, 85_184)
    assert sizer.chunk(32, heavy, 85_184) == 0
    assert sizer.chunk(0, 0, 900_000) > 0  # nothing decoding: no ITL to break, work progresses


@settings(max_examples=300, deadline=None)
@given(
    model=models,
    node=nodes,
    batch=st.integers(0, 256),
    context=st.integers(0, 4_000_000),
    prefix=st.integers(0, 400_000),
)
def test_a_sized_chunk_never_breaks_the_budget_while_requests_decode(  # type: ignore[no-untyped-def]
    model, node, batch, context, prefix
) -> None:
    context = context if batch else 0
    sizer = ChunkSizer(roofline(MODEL_PRESETS[model], NODE_PRESETS[node]), 0.045, 256, 16_384)
    p = sizer.chunk(batch, context, prefix)
    if batch:
        assert p == 0 or sizer.roof.step_s(batch, context, p, prefix) <= 0.045
    else:
        assert p > 0


def _capacity(node=GB300, ledger=None, **snap):  # type: ignore[no-untyped-def]
    base = {"taken_at_ms": 1, "running_requests": 16, "decode_context_tokens": 64_000,
            "kv_used_tokens": 64_000, "kv_total_tokens": 1_000_000}  # fmt: skip
    return compute_capacity(
        EngineSnapshot(**{**base, **snap}), GPT_OSS, node, LeaseSettings(), ledger
    )


@pytest.mark.parametrize("prefix", [0, 4_096, 18_000, 36_000, 64_000])
def test_the_leases_coefficients_price_a_prompt_close_to_its_real_prefill_time(prefix) -> None:  # type: ignore[no-untyped-def]
    """The lease's ``U * (a + b * (X + U/2))`` against the engine running that prompt in chunks
    sized for each step's prefix at the same load: within 20% from no prefix to 64k tokens."""
    cap = _capacity()
    a, b = cap.coefficients
    uncached = 8_000
    sizer = ChunkSizer(roofline(GPT_OSS, GB300), cap.budget_s, 256, 16_384)
    real, done = 0.0, 0
    while done < uncached:
        p = min(sizer.chunk(16, 64_000, prefix + done), uncached - done)
        real += sizer.roof.step_s(16, 64_000, p, prefix + done)
        assert real > 0 and sizer.roof.step_s(16, 64_000, p, prefix + done) <= cap.budget_s
        done += p
    predicted = cap.coefficients.cost_s(uncached, prefix)
    print(f"prefix {prefix}: predicted {predicted * 1e3:.1f} ms, engine {real * 1e3:.1f} ms")
    assert predicted == pytest.approx(real, rel=0.2)
    assert a > 0 and b > 0


def test_debit_prices_each_prompt_by_its_prefix_in_reference_tokens() -> None:
    cap = _capacity()
    a, b = cap.coefficients
    rate = cap.borrowed_prefill_rate_tps
    ref = LeaseSettings().borrowed_prefix_tokens
    # a prompt over the reference prefix debits its own uncached tokens ...
    at_ref = compute_debit(1_000, ref - 500, a, b, rate).tokens
    assert at_ref == 1_000
    # ... a longer prefix costs more, no prefix less
    assert (
        compute_debit(1_000, 36_000, a, b, rate).tokens
        > at_ref
        > compute_debit(1_000, 0, a, b, rate).tokens
    )
    # a lease without coefficients debits the uncached tokens, as before
    assert compute_debit(1_000, 36_000, 0.0, 0.0, rate).tokens == 1_000


def test_open_debits_follow_grants_releases_and_expiries_once() -> None:
    def n(seq: int, kind: NoticeKind, rid: str, kv: int = 0, output: int = 0) -> Notice:
        debit = Credits(compute_tokens=kv, kv_tokens=kv, output_tokens=output)
        return Notice(node_id="d", seq=seq, kind=kind, reservation_id=rid, debit=debit)

    ledger = OpenDebits()
    ledger.apply([n(1, NoticeKind.GRANT, "r1", 1_000, 100), n(2, NoticeKind.GRANT, "r2", 500, 50)])
    ledger.apply([n(3, NoticeKind.COMMIT, "r1"), n(4, NoticeKind.GRANT, "r1", 1_000, 100)])
    assert (ledger.kv, ledger.output, ledger.uncached_tokens(1)) == (1_500, 150, 1_350)
    ledger.apply([n(5, NoticeKind.RELEASE, "r1"), n(6, NoticeKind.EXPIRE, "r2")])
    ledger.apply([n(7, NoticeKind.RELEASE, "r1")])  # already closed: nothing to undo
    assert (ledger.kv, ledger.output) == (0, 0) and not ledger.debits


def _unknown_s(cap) -> float:  # type: ignore[no-untyped-def]
    """Node seconds per raw token of borrowed work the broker does not count."""
    return cap.coefficients.a_s + cap.coefficients.b_s * FAR_PREFIX_TOKENS


def test_borrowed_work_is_counted_once_by_the_broker_not_again_by_the_lease() -> None:
    """A borrowed prompt of 5,000 uncached tokens was granted (debit D) and reached the engine:
    telemetry shows it outstanding and holding KV. The broker subtracts D from the lease; the
    lease must not subtract the same work again (it did before: credit - telemetry - D)."""
    pulled = 14_950 * GPT_OSS.kv_bytes_per_token  # its prefix, pulled in from another node
    debit = Credits(
        compute_tokens=5_000, kv_tokens=20_000, kv_transfer_bytes=pulled, output_tokens=50, slots=1
    )
    idle = _capacity().credits
    ledger = OpenDebits(kv=20_000, output=50, transfer_bytes=pulled)
    # the engine shows the borrowed request: 5,000 tokens queued, 20,000 KV slots reserved
    seen = {"outstanding_uncached_tokens": 5_000, "borrowed_kv_tokens": 20_000,
            "kv_used_tokens": 84_000}  # fmt: skip
    counted_once = _capacity(ledger=ledger, **seen)
    counted_twice = _capacity(**seen)
    available_once = counted_once.credits.minus(debit)
    assert available_once.compute_tokens == idle.compute_tokens - debit.compute_tokens
    assert available_once.kv_tokens == idle.kv_tokens - debit.kv_tokens
    # without the ledger the queued work is the lease's to count, costed on the safe side
    rate = counted_twice.borrowed_prefill_rate_tps
    twice_s = 5_000 * _unknown_s(counted_twice)
    assert counted_twice.credits.compute_tokens == int(rate * (HORIZON_S - twice_s))
    assert counted_twice.credits.compute_tokens < idle.compute_tokens - 5_000
    # the wait is split the same way: the lease's part is the work the broker does not count,
    # and the broker adds the wait of its open debits (queue_wait_ms below), so it counts once
    assert counted_once.queue_wait_ms == 0.0
    assert counted_twice.queue_wait_ms == pytest.approx(twice_s * 1000.0)
    lease = Lease(
        node_id="d",
        epoch=1,
        version=1,
        ttl_ms=1000,
        queue_wait_ms=counted_once.queue_wait_ms,
        borrowed_prefill_rate_tps=counted_once.borrowed_prefill_rate_tps,
    )
    assert 0.0 < queue_wait_ms(lease, debit.compute_tokens) < counted_twice.queue_wait_ms
    # work the broker no longer counts (expired reservation still running) is subtracted
    partly = _capacity(ledger=OpenDebits(kv=2_050, output=50), **seen)
    assert partly.covered_tokens == 2_000
    assert partly.credits.compute_tokens == int(rate * (HORIZON_S - 3_000 * _unknown_s(partly)))


def _granted(
    uncached: int,
    cached: int,
    cap,
    remote: bool = False,
    kv_bytes_per_token: int = GPT_OSS.kv_bytes_per_token,
) -> Notice:  # type: ignore[no-untyped-def]
    """The GRANT notice of a prompt borrowed on node "d" against the lease of ``cap``."""
    lease = Lease(
        node_id="d", epoch=1, version=1, ttl_ms=1000,
        borrowed_prefill_rate_tps=cap.borrowed_prefill_rate_tps,
        prefill_s_per_token=cap.coefficients.a_s,
        prefill_s_per_token_context=cap.coefficients.b_s,
    )  # fmt: skip
    request = AdmissionRequest(
        uncached_prompt_tokens=uncached,
        cached_prefix_tokens=cached,
        cached_prefix_node_id="elsewhere" if remote else "d",
        expected_output_tokens=200,
    )
    settings = PolicySettings(kv_bytes_per_token=kv_bytes_per_token)
    debit = debit_for(request, "d", settings, lease).credits
    return Notice(node_id="d", seq=1, kind=NoticeKind.GRANT, reservation_id="r", debit=debit)


@pytest.mark.parametrize("remote", [False, True])
def test_open_debits_cover_their_own_uncached_tokens_in_telemetrys_unit(remote: bool) -> None:
    """Telemetry counts queued borrowed work in raw uncached tokens; a compute debit is priced at
    its prompt's prefix (tokens at the lease's rate). Covering raw tokens with debits mixed the
    two: a short-prefix prompt (debit below its tokens) was counted again by the lease, and a
    long-prefix one (debit above its tokens) excused work no one else counted."""
    idle = _capacity()
    short = _granted(5_000, 0, idle, remote)
    assert short.debit.compute_tokens < 5_000
    ledger = OpenDebits()
    ledger.apply([short])
    queued = _capacity(ledger=ledger, outstanding_uncached_tokens=5_000)
    assert queued.covered_tokens == 5_000 and queued.queue_wait_ms == 0.0
    assert queued.credits.minus(short.debit).compute_tokens == (
        idle.credits.compute_tokens - short.debit.compute_tokens
    )
    long = _granted(1_000, 36_000, idle, remote)
    assert long.debit.compute_tokens > 1_500
    ledger = OpenDebits()
    ledger.apply([long])
    # its 1,000 tokens are queued with 4,000 of a reservation that expired while running
    mixed = _capacity(ledger=ledger, outstanding_uncached_tokens=5_000)
    assert mixed.covered_tokens == 1_000
    rate = mixed.borrowed_prefill_rate_tps
    assert mixed.credits.compute_tokens == int(rate * (HORIZON_S - 4_000 * _unknown_s(mixed)))


def test_a_pulled_prefix_is_counted_in_the_brokers_bytes_per_token_not_the_models() -> None:
    """The broker prices a remote prefix's transfer with its policy's KV bytes per token, set
    apart from the agent's model. Divided by the model's larger figure, a 100k-token prefix
    read as a few thousand tokens and the rest as uncached work its grant covered: the lease
    excused queued work no reservation counts (a larger credit, a shorter wait)."""
    idle = _capacity()
    policy_bytes = GPT_OSS.kv_bytes_per_token // 3  # a policy left at a smaller model's figure
    grant = _granted(2_000, 100_000, idle, remote=True, kv_bytes_per_token=policy_bytes)
    told = OpenDebits(kv_bytes_per_token=policy_bytes)  # from the broker's Welcome
    told.apply([grant])
    # 2,000 of this grant's tokens are queued, with 6,000 no reservation counts
    queued = _capacity(ledger=told, outstanding_uncached_tokens=8_000)
    assert told.uncached_tokens(GPT_OSS.kv_bytes_per_token) == 2_000
    assert queued.covered_tokens == 2_000 and queued.queue_wait_ms > 0.0
    untold = OpenDebits()
    untold.apply([grant])
    assert untold.uncached_tokens(GPT_OSS.kv_bytes_per_token) > 2_000  # the unit it replaced


def test_an_open_grant_keeps_the_unit_it_was_granted_in() -> None:
    """The broker's KV bytes per token can change mid-session (a new policy, a reconnect to a
    replica with another): a grant's pulled-in prefix stays read in the unit of its GRANT, not
    re-read in the new one (which turned 100k tokens of prefix into uncached work, or the
    reverse), while a grant made after the change is read in the new unit."""
    idle = _capacity()
    before_bytes = GPT_OSS.kv_bytes_per_token // 3
    ledger = OpenDebits(kv_bytes_per_token=before_bytes)
    ledger.apply([_granted(2_000, 100_000, idle, remote=True, kv_bytes_per_token=before_bytes)])
    ledger.kv_bytes_per_token = GPT_OSS.kv_bytes_per_token  # the broker's SessionSettings
    assert ledger.uncached_tokens(GPT_OSS.kv_bytes_per_token) == 2_000
    later = _granted(
        3_000, 50_000, idle, remote=True, kv_bytes_per_token=GPT_OSS.kv_bytes_per_token
    )
    ledger.apply([later.model_copy(update={"reservation_id": "r2"})])
    assert ledger.uncached_tokens(GPT_OSS.kv_bytes_per_token) == 5_000
    assert ledger.totals().uncached_tokens(GPT_OSS.kv_bytes_per_token) == 5_000
    released = Notice(node_id="d", seq=3, kind=NoticeKind.RELEASE, reservation_id="r")
    ledger.apply([released])
    assert ledger.uncached_tokens(GPT_OSS.kv_bytes_per_token) == 3_000


def test_a_grant_that_says_its_pulled_tokens_is_read_in_its_own_unit() -> None:
    """The broker's unit the agent holds is only the latest it was told: a grant priced by a
    replica still on the previous policy (up to its refresh behind), or whose notice lands
    after the SessionSettings push, was read in the other one, so 100k tokens of pulled prefix
    turned into uncached work or back. A GRANT that carries its pulled tokens is read as it
    says, whatever unit the agent holds; one that does not (an older broker) as before."""
    idle = _capacity()
    priced_bytes = GPT_OSS.kv_bytes_per_token // 3
    request = AdmissionRequest(
        uncached_prompt_tokens=2_000,
        cached_prefix_tokens=100_000,
        cached_prefix_node_id="elsewhere",
        expected_output_tokens=200,
    )
    grant = _granted(2_000, 100_000, idle, remote=True, kv_bytes_per_token=priced_bytes)
    told = grant.model_copy(update={"pulled_tokens": pulled_tokens(request, "d")})
    assert told.pulled_tokens == 100_000 == told.debit.kv_transfer_bytes // priced_bytes
    for held in (GPT_OSS.kv_bytes_per_token, priced_bytes // 2, 0):  # pushed, other, none yet
        ledger = OpenDebits(kv_bytes_per_token=held)
        ledger.apply([told])
        assert ledger.uncached_tokens(GPT_OSS.kv_bytes_per_token) == 2_000
        assert ledger.totals().uncached_tokens(GPT_OSS.kv_bytes_per_token) == 2_000
        ledger.apply([Notice(node_id="d", seq=2, kind=NoticeKind.RELEASE, reservation_id="r")])
        assert (ledger.kv, ledger.pulled_tokens, ledger.transfer_bytes) == (0, 0, 0)
    stale = OpenDebits(kv_bytes_per_token=GPT_OSS.kv_bytes_per_token)
    stale.apply([grant])  # an older broker's grant: its bytes in the unit the agent holds
    assert stale.uncached_tokens(GPT_OSS.kv_bytes_per_token) > 2_000


def test_slots_are_the_decode_batch_room_not_a_fixed_eight() -> None:
    light = _capacity(node=H200, running_requests=4, decode_context_tokens=16_000)
    heavy = _capacity(node=H200, running_requests=120, decode_context_tokens=480_000)
    assert light.credits.slots > 8  # the old cap of 8 (x share 0.5 = 4) bound for no reason
    assert 0 < heavy.credits.slots < light.credits.slots  # room shrinks as the batch grows
    r = roofline(GPT_OSS, H200)
    length = LeaseSettings().borrowed_context_tokens
    b = heavy.credits.slots
    assert r.step_s(120 + b, 480_000 + b * length) <= heavy.budget_s
    assert r.step_s(120 + b + 1, 480_000 + (b + 1) * length) > heavy.budget_s


def _lease(queue_ms: float = 0.0, rate: float = 2_000.0) -> Lease:
    return Lease(
        node_id="d",
        epoch=1,
        version=1,
        ttl_ms=1000,
        queue_wait_ms=queue_ms,
        borrowed_prefill_rate_tps=rate,
    )


def test_queue_wait_adds_the_broker_open_debits_at_the_lease_rate() -> None:
    """Grants made since the lease queue ahead of the next borrowed prompt: 3,000 tokens of
    open debits at 2,000 tokens/s add 1.5 s to the lease's own 100 ms."""
    assert queue_wait_ms(_lease(100.0), 0) == 100.0
    assert queue_wait_ms(_lease(100.0), 3_000) == pytest.approx(1_600.0)
    assert queue_wait_ms(_lease(100.0), -5) == 100.0  # debits above a shrunk lease: never below
    # no rate: open work has no known end
    assert queue_wait_ms(_lease(0.0, rate=0.0), 1) == MAX_MS
    assert queue_wait_ms(_lease(0.0, rate=0.0), 0) == 0.0


@given(st.floats(0.0, 1e6), st.floats(1.0, 1e6), st.integers(0, 10**9), st.integers(0, 10**9))
def test_queue_wait_never_falls_as_debits_grow(q: float, rate: float, a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    lease = _lease(q, rate)
    assert queue_wait_ms(lease, lo) <= queue_wait_ms(lease, hi) <= MAX_MS
