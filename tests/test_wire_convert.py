"""The proto <-> domain bridge: every crossflow.v1 message has a mirror or is declared wire-only,
and every mirrored value survives a round trip."""

from __future__ import annotations

import math

import pytest

from crossflow_ctl.api.v1 import admin_pb2, admission_pb2, common_pb2, lease_pb2
from crossflow_ctl.domain.admission import (
    Admission,
    AdmissionRequest,
    Decision,
    Reason,
    check_demand,
    plan_admission,
)
from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.models import (
    Credits,
    Lease,
    NodeInfo,
    NodeRole,
    NodeState,
    Notice,
    NoticeKind,
    PoolLoad,
    PoolSnapshot,
    Reservation,
    ReservationState,
    StoredLease,
    ZeroReason,
)
from crossflow_ctl.domain.online_calibration import StepModelReport, Using
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.domain.room import (
    NodeRoom,
    RoomStatus,
    RoomUpdate,
    RoomView,
    RoomWatchRequest,
    unknown_room,
)
from crossflow_ctl.domain.session import SessionSettings
from crossflow_ctl.domain.step_fit import FitStatus
from crossflow_ctl.wire import convert as c
from crossflow_ctl.wire import convert_admission as ca
from crossflow_ctl.wire import convert_room as cr

NOW = 1_700_000_000_000
CREDITS = Credits(compute_tokens=1, kv_tokens=2, kv_transfer_bytes=3, output_tokens=4, slots=5)
LEASE = Lease(
    node_id="d1",
    epoch=3,
    version=9,
    ttl_ms=1500,
    credits=CREDITS,
    queue_wait_ms=1.5,
    borrowed_prefill_rate_tps=9000.0,
    prefill_s_per_token=2.5e-5,
    prefill_s_per_token_context=3e-10,
    itl_ms=20.0,
    itl_slo_ms=40.0,
    last_notice_seq=7,
    snapshot_unix_ms=NOW,
    horizon_ms=6_000,
)
ZERO = Lease(
    node_id="d1",
    epoch=3,
    version=10,
    ttl_ms=1500,
    zero_reason=ZeroReason.CORDONED,
    zero_detail="ops",
)
LOAD = PoolLoad(
    pool="p",
    node_id="p1",
    outstanding_uncached_tokens=50_000,
    processing_rate_tps=10_000.0,
    prefill_rate_tps=5_000.0,
    ttl_ms=2_000,
    queued_requests=3,
)
TIMED = LOAD.model_copy(update={"queue_wait_ms": 2_500.5})


def test_every_message_has_a_mirror_or_is_wire_only() -> None:
    names = {
        d.full_name
        for module in (common_pb2, lease_pb2, admin_pb2, admission_pb2)
        for d in module.DESCRIPTOR.message_types_by_name.values()
    }
    missing = names - set(ca.MIRRORS) - set(ca.WIRE_ONLY)
    assert not missing, f"messages without a mirror: {sorted(missing)}"
    assert not (set(ca.MIRRORS) & set(ca.WIRE_ONLY))
    assert not (set(ca.MIRRORS) | set(ca.WIRE_ONLY)) - names, "stale entries"


def test_every_enum_value_maps_both_ways() -> None:
    pairs = [
        (common_pb2.ZeroReason, "ZERO_REASON_", ZeroReason),
        (common_pb2.NodeRole, "NODE_ROLE_", NodeRole),
        (lease_pb2.NoticeKind, "NOTICE_KIND_", NoticeKind),
        (admin_pb2.ReservationState, "RESERVATION_STATE_", ReservationState),
        (admission_pb2.Reason, "REASON_", Reason),
        (admission_pb2.Decision, "DECISION_", Decision),
        (admission_pb2.RoomStatus, "ROOM_STATUS_", RoomStatus),
    ]
    for wrapper, prefix, cls in pairs:
        wire = {n[len(prefix) :] for n in wrapper.keys()} - {"UNSPECIFIED"}  # noqa: SIM118
        assert wire == {m.name for m in cls}, cls
        for member in cls:
            number = c.enum_to_proto(member, wrapper, prefix)
            assert c.enum_from_proto(number, wrapper, prefix, cls, "f") is member


def test_common_and_admin_round_trips() -> None:
    assert c.credits_from_proto(c.credits_to_proto(CREDITS)) == CREDITS
    for lease in (LEASE, ZERO):
        assert c.lease_from_proto(c.lease_to_proto(lease)) == lease
    assert c.lease_to_proto(LEASE).horizon_ms == 6_000
    assert c.lease_from_proto(c.lease_to_proto(ZERO)).horizon_ms == 0  # not said: an older agent
    assert c.pool_load_from_proto(c.pool_load_to_proto(LOAD)) == LOAD
    assert not c.pool_load_to_proto(LOAD).HasField("queue_wait_ms")  # unset, not 0
    assert c.pool_load_from_proto(c.pool_load_to_proto(TIMED)) == TIMED
    notice = Notice(
        node_id="d1", seq=4, kind=NoticeKind.RELEASE, reservation_id="r", debit=CREDITS, at_ms=NOW
    )
    assert c.notice_from_proto(c.notice_to_proto(notice), "d1") == notice
    settings = SessionSettings(
        max_lease_ttl_ms=1, borrow_horizon_ms=2, kv_bytes_per_token=3, policy_version=4
    )
    assert c.session_settings_from_proto(c.session_settings_to_proto(settings)) == settings
    res = Reservation(
        reservation_id="r@d1",
        node_id="d1",
        state=ReservationState.RELEASED,
        debit=CREDITS,
        lease_epoch=3,
        lease_version=9,
        created_at_ms=NOW,
        expires_at_ms=NOW + 5,
        grant_seq=4,
        release_seq=6,
        request_id="q",
    )
    assert c.reservation_from_proto(c.reservation_to_proto(res)) == res
    state = NodeState(
        info=NodeInfo(
            node_id="d1",
            role=NodeRole.DECODE,
            pool="p",
            cordoned=True,
            cordon_reason="disk swap",  # was dropped on the wire: -o json said ""
            labels={"zone": "a"},
            notice_seq=6,
            registered_at_ms=NOW - 60_000,
        ),
        lease=StoredLease(lease=LEASE, received_at_ms=NOW, expires_at_ms=NOW + 1500),
        open_debits=CREDITS,
        open_reservations=2,
    )
    assert c.node_state_from_proto(c.node_status_to_proto(state, NOW, 1.0)) == state
    bare = NodeState(info=NodeInfo(node_id="d2"))
    assert c.node_state_from_proto(c.node_status_to_proto(bare, NOW, 1.0)) == bare
    pool = PoolSnapshot(pool="p", reports=(LOAD,))
    assert c.pool_from_proto(c.pool_to_proto(pool)) == pool
    policy = PolicySettings(borrow_share=0.3, borrow_kv_share=0.8, shadow_mode=True)
    assert c.policy_from_json(c.policy_to_json(policy)) == policy


def test_admission_round_trips() -> None:
    req = AdmissionRequest(
        request_id="q",
        uncached_prompt_tokens=100,
        cached_prefix_tokens=50,
        cached_prefix_node_id="d1",
        expected_output_tokens=10,
        candidate_node_ids=("d1", "d2"),
        dry_run=True,
        pool="p",
        held_ahead_tokens=300,
        prefill_node_id="p1",
    )
    assert ca.admit_request_from_proto(ca.admit_request_to_proto(req)) == req
    policy = PolicySettings(borrow_share=1.0)
    nodes = [
        NodeState(
            info=NodeInfo(node_id="d1"),
            lease=StoredLease(
                lease=LEASE.model_copy(
                    update={
                        "credits": Credits(
                            compute_tokens=10_000,
                            kv_tokens=10_000,
                            kv_transfer_bytes=10**9,
                            output_tokens=1_000,
                            slots=4,
                        )
                    }
                ),
                received_at_ms=NOW,
                expires_at_ms=NOW + 1500,
            ),
        ),
        NodeState(info=NodeInfo(node_id="d2")),
    ]
    pools = (PoolSnapshot(pool="p", reports=(LOAD,)), PoolSnapshot(pool="p", reports=(TIMED,)))
    for pool in (*pools, None):
        # With tokens sent since the reports, so each Demand field crosses the wire (the
        # timed pool's: the request's prefill server and that its wait is in time).
        plan = plan_admission(req, pool, nodes, policy, NOW, check_demand(pool, policy, 1234))
        assert plan.normal_path is not None and plan.normal_path.hold_ms > 0
        borrow = Admission(
            decision=Decision.BORROW,
            reason=Reason.BORROWED,
            message="m",
            node_id="d1",
            reservation_id="r@d1",
            lease_epoch=3,
            lease_version=9,
            expires_at_ms=NOW,
            predicted_ttft_ms=5.0,
            normal_ttft_ms=9.0,
            plan=plan,
            debit=Credits(
                compute_tokens=7, kv_tokens=8, kv_transfer_bytes=9, output_tokens=10, slots=1
            ),
        )
        normal = Admission.normal(plan.reason, plan.summary(), plan)
        shadow = Admission.normal(Reason.SHADOW_MODE, "s", plan).model_copy(
            update={"shadow_decision": Decision.BORROW}
        )
        failed = Admission.normal(Reason.STORE_UNAVAILABLE, "down")
        answers = [normal, shadow, failed]
        if pool is not None:
            assert plan.reason is Reason.BORROWED
            answers.append(borrow)
        unbounded = borrow.model_copy(update={"predicted_ttft_ms": math.inf, "plan": None})
        replayed = borrow.model_copy(update={"replayed": True, "plan": None})
        for adm in [*answers, unbounded, replayed]:
            back = ca.admission_from_proto(ca.admission_to_proto(adm))
            assert back == adm or adm is unbounded, adm.reason
            for explain in (True, False):  # AdmitStream's in-place form: the same message
                made = ca.admission_to_proto(adm, explain=explain)
                result = admission_pb2.AdmitStreamResult(id=7)
                ca.admission_into_proto(adm, result.decision, explain=explain)
                assert result.WhichOneof("result") == "decision"
                assert result.decision == made, adm.reason
                assert result.decision.SerializeToString(deterministic=True) == (
                    made.SerializeToString(deterministic=True)
                )


def test_room_round_trips() -> None:
    req = RoomWatchRequest(
        pool="p", candidate_node_ids=("d1", "d2"), max_updates_per_s=2.5, heartbeat_ms=700
    )
    assert cr.watch_request_from_proto(cr.watch_request_to_proto(req)) == req
    assert cr.watch_request_from_proto(admission_pb2.WatchRoomRequest()) == RoomWatchRequest()
    room = NodeRoom(
        node_id="d1",
        compute_tokens=3,
        kv_tokens=4,
        slots=2,
        queue_wait_ms=1.5,
        lease_epoch=2,
        lease_version=9,
        borrowed_prefill_rate_tps=12_000.0,
        prefill_s_per_token=8e-5,
        prefill_s_per_token_context=2e-9,
    )
    views = [
        RoomView(
            pool="p",
            detail="d",
            nodes=(room,),
            pool_wait_ms=0.0,
            demand_threshold_ms=200.0,
            demand_holds=True,
        ),
        RoomView(pool="p", pool_wait_ms=None),
        unknown_room("p", "down"),
    ]
    for view in views:
        update = RoomUpdate(seq=5, at_ms=NOW, heartbeat=True, view=view)
        assert cr.room_update_from_proto(cr.room_update_to_proto(update)) == update
    unspecified = cr.room_update_from_proto(admission_pb2.WatchRoomResponse(seq=1))
    assert unspecified.view.status is RoomStatus.UNKNOWN and not unspecified.view.has_room


def test_a_step_model_round_trips_and_a_bad_one_is_refused() -> None:
    before = StepModelReport(using=Using.PRIOR, prior={"host_step_s": 0.002})
    report = StepModelReport(
        using=Using.FITTED, fit_status=FitStatus.FITTED, fit_error=0.02, prior_error=0.5,
        windows=9, periods=12, prior_name="h100", prior={"flops_per_s": 9.9e14},
        fitted={"flops_per_s": 3e11}, active={"flops_per_s": 3e11}, detail="", at_unix_ms=NOW,
    )  # fmt: skip
    for r in (before, report):
        assert c.step_model_from_proto(c.step_model_to_proto(r)) == r
    assert c.step_model_from_proto(c.step_model_to_proto(before)).fit_status is None
    for field, change in (
        ("step_model.using", {"using": "guessing"}),
        ("step_model.fit_status", {"fit_status": "great"}),
        ("step_model.fit_error", {"fit_error": float("nan")}),
        ("step_model.windows", {"windows": -1}),
    ):
        msg = c.step_model_to_proto(report)
        for name, value in change.items():
            setattr(msg, name, value)
        with pytest.raises(InvalidArgument) as refused:
            c.step_model_from_proto(msg)
        assert refused.value.field == field
    msg = c.step_model_to_proto(report)
    msg.active["flops_per_s"] = -1.0
    with pytest.raises(InvalidArgument, match="flops_per_s"):
        c.step_model_from_proto(msg)
