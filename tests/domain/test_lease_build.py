"""A decision's lease is built without validation: it must be the lease validation would build."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from crossflow_ctl.domain.capacity import MODEL_PRESETS, NODE_PRESETS
from crossflow_ctl.domain.lease_credits import LeaseSettings
from crossflow_ctl.domain.leasing import ItlGuard, LeaseDecision, decide
from crossflow_ctl.domain.models import Lease, ZeroReason
from crossflow_ctl.domain.telemetry import EngineSnapshot

NOW = 1_700_000_000_000


def _typed(lease: Lease) -> list[tuple[str, type, object]]:
    return [(k, type(v), v) for k, v in lease.__dict__.items()]


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(sorted(MODEL_PRESETS)),
    st.sampled_from(sorted(NODE_PRESETS)),
    st.integers(0, 256),
    st.integers(0, 8_000),
    st.integers(0, 1_000_000),
    st.none() | st.floats(0.0, 500.0) | st.integers(0, 500),
    st.integers(0, 200_000),
    st.integers(0, 5_000),
    st.booleans(),
    st.sampled_from(["", "x" * 600, "agent error"]),
    st.booleans(),
)
def test_the_lease_of_a_decision_is_what_validation_builds(
    model: str,
    node: str,
    running: int,
    per_request: int,
    used: int,
    itl: float | int | None,
    outstanding: int,
    age_ms: int,
    cordoned: bool,
    failure: str,
    clock_broken: bool,
) -> None:
    snapshot = EngineSnapshot(
        taken_at_ms=-age_ms if clock_broken else NOW - age_ms,
        running_requests=running,
        decode_context_tokens=running * per_request,
        kv_used_tokens=used,
        kv_total_tokens=1_000_000,
        itl_p99_ms=itl,
        outstanding_uncached_tokens=outstanding,
    )
    for decision in (
        decide(
            snapshot,
            now_ms=NOW,
            model=MODEL_PRESETS[model],
            node=NODE_PRESETS[node],
            settings=LeaseSettings(),
            guard=ItlGuard(),
            cordoned=cordoned,
        ),
        LeaseDecision(zero_reason=ZeroReason.TELEMETRY_MISSING, zero_detail=failure),
    ):
        lease = decision.to_lease(
            node_id="decode-0", epoch=7, version=3, ttl_ms=600, last_notice_seq=9
        )
        validated = Lease.model_validate(lease.model_dump())
        assert _typed(lease) == _typed(validated)
        assert lease.model_fields_set == validated.model_fields_set
