"""Proto <-> domain conversion for AdmissionService, and the table of mirrors.

``MIRRORS`` names, for every ``crossflow.v1`` message with a domain mirror, the pair of functions
that converts it; ``WIRE_ONLY`` names the request/response wrappers that carry no domain value of
their own. tests/broker/test_convert.py fails when a message is in neither.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from crossflow_ctl.api.v1 import admission_pb2
from crossflow_ctl.domain.admission import (
    MAX_ATTEMPT,
    MAX_CANDIDATES,
    MAX_REQUEST_ID_LEN,
    Admission,
    AdmissionRequest,
    Decision,
    DemandCheck,
    NodeCheck,
    NormalPath,
    Plan,
    Reason,
)
from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.models import (
    ID_PATTERN,
    MAX_ID_LEN,
    MAX_POOL_LEN,
    MAX_TOKENS,
    is_node_id,
)
from crossflow_ctl.wire import convert as c
from crossflow_ctl.wire import convert_room as cr

_REASON_NUMBERS = {r: c.enum_to_proto(r, admission_pb2.Reason, "REASON_") for r in Reason}
_DECISION_NUMBERS: dict[Decision | None, int] = {
    d: c.enum_to_proto(d, admission_pb2.Decision, "DECISION_") for d in (None, *Decision)
}
"""Every Admit answer converts three or four enums: looked up once, at import."""


def reason_to_proto(reason: Reason) -> int:
    return _REASON_NUMBERS[reason]


def reason_from_proto(number: int) -> Reason:
    return c.enum_from_proto(number, admission_pb2.Reason, "REASON_", Reason, "reason") or (
        Reason.STORE_UNAVAILABLE
    )


def release_outcome_from_proto(number: int) -> str:
    """``RELEASE_OUTCOME_FINISHED`` -> "finished"; unspecified -> ""; unknown numbers are
    InvalidArgument naming ``outcome``."""
    try:
        name = admission_pb2.ReleaseOutcome.Name(number)  # type: ignore[arg-type]
    except ValueError:
        raise InvalidArgument(f"unknown enum value {number}", field="outcome") from None
    outcome = name.removeprefix("RELEASE_OUTCOME_").lower()
    return "" if outcome == "unspecified" else outcome


def decision_to_proto(decision: Decision | None) -> int:
    return _DECISION_NUMBERS[decision]


def decision_from_proto(number: int) -> Decision | None:
    return c.enum_from_proto(number, admission_pb2.Decision, "DECISION_", Decision, "decision")


def admit_request_to_proto(req: AdmissionRequest) -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(
        request_id=req.request_id,
        uncached_prompt_tokens=req.uncached_prompt_tokens,
        cached_prefix_tokens=req.cached_prefix_tokens,
        cached_prefix_node_id=req.cached_prefix_node_id or "",
        expected_output_tokens=req.expected_output_tokens,
        candidate_node_ids=list(req.candidate_node_ids),
        dry_run=req.dry_run,
        pool=req.pool,
        attempt=req.attempt,
        held_ahead_tokens=req.held_ahead_tokens,
        prefill_node_id=req.prefill_node_id or "",
        explain=req.explain,
    )


def admit_request_from_proto(msg: admission_pb2.AdmitRequest) -> AdmissionRequest:
    """The request, or InvalidArgument naming the first field at fault. A message whose every
    field is plainly within the model's bounds (the checks below are the model's, each no
    wider) is built without pydantic's validation (``trusted``): every Admit and streamed item
    comes through here. Anything else, and every refusal, takes the validating path."""
    request_id, pool = msg.request_id, msg.pool
    cached_at, prefill = msg.cached_prefix_node_id, msg.prefill_node_id
    uncached, cached = msg.uncached_prompt_tokens, msg.cached_prefix_tokens
    output, held, attempt = msg.expected_output_tokens, msg.held_ahead_tokens, msg.attempt
    candidates = tuple(msg.candidate_node_ids)
    if (
        0 <= uncached <= MAX_TOKENS
        and 0 <= cached <= MAX_TOKENS
        and 0 <= output <= MAX_TOKENS
        and 0 <= held <= MAX_TOKENS
        and attempt <= MAX_ATTEMPT  # uint32: never negative
        and len(request_id) <= MAX_REQUEST_ID_LEN
        and (not pool or (len(pool) <= MAX_POOL_LEN and is_node_id(pool)))
        and (not cached_at or is_node_id(cached_at))
        and (not prefill or is_node_id(prefill))
        and len(candidates) <= MAX_CANDIDATES
        and (not candidates or _all_node_ids(candidates))
    ):
        # Every field, in order, each checked above as the model would: without validation.
        return AdmissionRequest.trusted(
            request_id=request_id,
            uncached_prompt_tokens=uncached,
            cached_prefix_tokens=cached,
            cached_prefix_node_id=cached_at or None,
            expected_output_tokens=output,
            candidate_node_ids=candidates,
            dry_run=msg.dry_run,
            pool=pool or "default",
            attempt=attempt,
            held_ahead_tokens=held,
            prefill_node_id=prefill or None,
            explain=msg.explain,
        )
    return admit_request_validated(msg)


def admit_request_validated(msg: admission_pb2.AdmitRequest) -> AdmissionRequest:
    """:func:`admit_request_from_proto` through pydantic's validation, whatever the message
    (the path of a refusal; the reference its fast path is tested against)."""
    result: AdmissionRequest = c._validated(
        AdmissionRequest,
        "",
        request_id=msg.request_id,
        uncached_prompt_tokens=msg.uncached_prompt_tokens,
        cached_prefix_tokens=msg.cached_prefix_tokens,
        cached_prefix_node_id=msg.cached_prefix_node_id or None,
        expected_output_tokens=msg.expected_output_tokens,
        candidate_node_ids=tuple(msg.candidate_node_ids),
        dry_run=msg.dry_run,
        pool=msg.pool or "default",
        attempt=msg.attempt,
        held_ahead_tokens=msg.held_ahead_tokens,
        prefill_node_id=msg.prefill_node_id or None,
        explain=msg.explain,
    )
    return result


_ID = ID_PATTERN.removeprefix("^").removesuffix("*$") + f"{{0,{MAX_ID_LEN - 1}}}"
"""The id pattern bounded to the id length: ``[first char][more chars]{0,MAX_ID_LEN - 1}``."""
_are_ids = re.compile(rf"{_ID}(?:,{_ID})*").fullmatch
"""Comma-joined ids, each of the id pattern and length (no id holds a comma): one regex call
for a whole candidate list, where one call per id cost more than pydantic's own check from
about 8 ids."""


def _all_node_ids(node_ids: tuple[str, ...]) -> bool:
    """Whether every one of ``node_ids`` (at least one) is a node id. An id holding a comma
    (never valid) would split in the joined string: the comma count tells."""
    joined = ",".join(node_ids)
    return joined.count(",") == len(node_ids) - 1 and _are_ids(joined) is not None


def _demand_fields(d: DemandCheck) -> dict[str, Any]:
    return {
        "holds": d.holds,
        "pool_wait_ms": c.NO_POOL_WAIT_MS if d.pool_wait_ms is None else d.pool_wait_ms,
        "threshold_ms": d.threshold_ms,
        "outstanding_uncached_tokens": d.outstanding_uncached_tokens,
        "processing_rate_tps": d.processing_rate_tps,
        "reporting_nodes": d.reporting_nodes,
        "pending_uncached_tokens": d.pending_uncached_tokens,
        "prefill_node_id": d.prefill_node_id or "",
        "timed": d.timed,
    }


def _demand_to_proto(d: DemandCheck) -> admission_pb2.DemandCheck:
    return admission_pb2.DemandCheck(**_demand_fields(d))


def _demand_from_proto(msg: admission_pb2.DemandCheck) -> DemandCheck:
    return DemandCheck(
        holds=msg.holds,
        pool_wait_ms=None if msg.pool_wait_ms < 0 else msg.pool_wait_ms,
        threshold_ms=msg.threshold_ms,
        outstanding_uncached_tokens=msg.outstanding_uncached_tokens,
        processing_rate_tps=msg.processing_rate_tps,
        reporting_nodes=msg.reporting_nodes,
        pending_uncached_tokens=msg.pending_uncached_tokens,
        prefill_node_id=msg.prefill_node_id or None,
        timed=msg.timed,
    )


def _node_check_fields(n: NodeCheck, normal_ms: float) -> dict[str, Any]:
    return {
        "node_id": n.node_id,
        "verdict": _REASON_NUMBERS[n.verdict],
        "detail": n.text(normal_ms),
        "queue_wait_ms": n.queue_wait_ms,
        "service_ms": n.service_ms,
        "predicted_ttft_ms": n.predicted_ttft_ms,
        "benefit": n.benefit,
        "safe": n.safe,
        "available": c.credits_fields(n.available),
        "debit": c.credits_fields(n.debit),
        "debit_us": n.debit_us,
        "short_credits": n.short_credits,
        "lease_epoch": n.lease_epoch,
        "lease_version": n.lease_version,
    }


def _node_check_to_proto(n: NodeCheck, normal_ms: float = 0.0) -> admission_pb2.NodeCheck:
    return admission_pb2.NodeCheck(**_node_check_fields(n, normal_ms))


def _node_check_from_proto(msg: admission_pb2.NodeCheck, normal_ms: float = 0.0) -> NodeCheck:
    """The check; its ``detail`` left empty where the wire's text is what its numbers say
    (``NodeCheck.text`` against ``normal_ms``), as the policy leaves it."""
    check = _node_check_numbers(msg)
    if msg.detail and msg.detail != check.text(normal_ms):
        return check.replaced(detail=msg.detail)
    return check


def _node_check_numbers(msg: admission_pb2.NodeCheck) -> NodeCheck:
    return NodeCheck(
        node_id=msg.node_id,
        verdict=reason_from_proto(msg.verdict),
        queue_wait_ms=msg.queue_wait_ms,
        service_ms=msg.service_ms,
        benefit=msg.benefit,
        safe=msg.safe,
        available=c.credits_from_proto(msg.available, "available"),
        debit=c.credits_from_proto(msg.debit, "debit"),
        debit_us=msg.debit_us,
        short_credits=tuple(msg.short_credits),
        lease_epoch=msg.lease_epoch,
        lease_version=msg.lease_version,
    )


def _explanation_fields(plan: Plan) -> dict[str, Any]:
    """The explanation as nested fields, for a message built in one go (not part by part and
    copied in)."""
    normal_ms = plan.normal_ms
    fields: dict[str, Any] = {
        "demand": _demand_fields(plan.demand),
        "nodes": [_node_check_fields(n, normal_ms) for n in plan.nodes],
        "summary": plan.summary(),
    }
    if plan.normal_path is not None:
        p = plan.normal_path
        fields["normal_path"] = {
            "wait_ms": p.wait_ms,
            "prefill_ms": p.prefill_ms,
            "kv_transfer_ms": p.kv_transfer_ms,
            "total_ms": p.total_ms,
            "hold_ms": p.hold_ms,
        }
    return fields


def plan_to_proto(plan: Plan) -> admission_pb2.Explanation:
    return admission_pb2.Explanation(**_explanation_fields(plan))


def plan_from_proto(msg: admission_pb2.Explanation, plan_reason: Reason) -> Plan:
    """The plan behind an explanation; ``ranked`` is rebuilt from the BORROWED verdicts."""
    normal_ms = msg.normal_path.total_ms if msg.HasField("normal_path") else 0.0
    nodes = tuple(_node_check_from_proto(n, normal_ms) for n in msg.nodes)
    ranked = tuple(
        sorted(
            (n for n in nodes if n.verdict is Reason.BORROWED),
            key=lambda n: (n.predicted_ttft_ms, n.node_id),
        )
    )
    normal = None
    if msg.HasField("normal_path"):
        p = msg.normal_path
        normal = NormalPath(
            wait_ms=p.wait_ms,
            prefill_ms=p.prefill_ms,
            kv_transfer_ms=p.kv_transfer_ms,
            hold_ms=p.hold_ms,
        )
    return Plan(
        reason=plan_reason,
        demand=_demand_from_proto(msg.demand),
        normal_path=normal,
        nodes=nodes,
        ranked=ranked if plan_reason is Reason.BORROWED else (),
    )


def admission_to_proto(a: Admission, explain: bool = True) -> admission_pb2.AdmitResponse:
    """``explain=False`` leaves the explanation out: an Admit that did not ask for it
    (:func:`explains`) gets none, and none is built."""
    # Nested fields as a dict (the stubs know messages only): the message is built in one go.
    explanation: Any = _explanation_fields(a.plan) if a.plan is not None and explain else None
    return admission_pb2.AdmitResponse(
        decision=_DECISION_NUMBERS[a.decision],  # type: ignore[arg-type]
        reason=_REASON_NUMBERS[a.reason],  # type: ignore[arg-type]
        message=a.message,
        node_id=a.node_id,
        reservation_id=a.reservation_id,
        lease_epoch=a.lease_epoch,
        lease_version=a.lease_version,
        expires_unix_ms=a.expires_at_ms,
        predicted_ttft_ms=_finite(a.predicted_ttft_ms),
        normal_ttft_ms=_finite(a.normal_ttft_ms),
        shadow_decision=_DECISION_NUMBERS[a.shadow_decision],  # type: ignore[arg-type]
        replayed=a.replayed,
        explanation=explanation,
        debit=c.credits_to_proto(a.debit) if a.debit is not None else None,
    )


def explains(request: admission_pb2.AdmitRequest | AdmissionRequest) -> bool:
    """Whether the answer to ``request`` (on the wire or not) carries its explanation: asked
    for, or a dry run."""
    return request.explain or request.dry_run


def admission_into_proto(
    a: Admission, msg: admission_pb2.AdmitResponse, explain: bool = True
) -> None:
    """:func:`admission_to_proto` written into ``msg``, which must be EMPTY (a fresh message,
    or one just added to a repeated field: an AdmitStream result): field by field, no message
    built and then copied in. On a reused message an earlier explanation would survive."""
    msg.SetInParent()  # present even were every field its default (a oneof member)
    msg.decision = _DECISION_NUMBERS[a.decision]  # type: ignore[assignment]
    msg.reason = _REASON_NUMBERS[a.reason]  # type: ignore[assignment]
    msg.message = a.message
    # The empty message has every field at its default already: those that stay so are not
    # set (a NORMAL answer has no node, reservation or lease; most have no shadow or replay).
    if a.node_id:
        msg.node_id = a.node_id
    if a.reservation_id:
        msg.reservation_id = a.reservation_id
    if a.lease_epoch:
        msg.lease_epoch = a.lease_epoch
    if a.lease_version:
        msg.lease_version = a.lease_version
    if a.expires_at_ms:
        msg.expires_unix_ms = a.expires_at_ms
    msg.predicted_ttft_ms = _finite(a.predicted_ttft_ms)  # always: -0.0 is not the default
    msg.normal_ttft_ms = _finite(a.normal_ttft_ms)
    if a.shadow_decision is not None:
        msg.shadow_decision = _DECISION_NUMBERS[a.shadow_decision]  # type: ignore[assignment]
    if a.replayed:
        msg.replayed = True
    debit = a.debit
    if debit is not None:  # field by field, as the rest (a BORROW per decision on a stream)
        d = msg.debit
        d.SetInParent()
        d.compute_tokens = debit.compute_tokens
        d.kv_tokens = debit.kv_tokens
        d.kv_transfer_bytes = debit.kv_transfer_bytes
        d.output_tokens = debit.output_tokens
        d.slots = debit.slots
    if a.plan is not None and explain:
        explanation: Any = _explanation_fields(a.plan)
        msg.MergeFrom(admission_pb2.AdmitResponse(explanation=explanation))


def _plan_reason(a_reason: Reason, msg: admission_pb2.AdmitResponse) -> Reason:
    """The plan's own reason: the answer's, unless the answer was overridden after planning."""
    if a_reason not in (Reason.SHADOW_MODE, Reason.DRY_RUN):
        return a_reason
    demand = msg.explanation.demand
    if demand.pool_wait_ms < 0:
        return Reason.POOL_LOAD_MISSING
    if not demand.holds:
        return Reason.NO_DEMAND
    verdicts = {reason_from_proto(n.verdict) for n in msg.explanation.nodes}
    for reason in (Reason.BORROWED, Reason.NO_ROOM, Reason.NO_BENEFIT):
        if reason in verdicts:
            return reason
    return Reason.NO_LEASES


def admission_from_proto(msg: admission_pb2.AdmitResponse) -> Admission:
    reason = reason_from_proto(msg.reason)
    plan = (
        plan_from_proto(msg.explanation, _plan_reason(reason, msg))
        if msg.HasField("explanation")
        else None
    )
    decision = decision_from_proto(msg.decision)
    if decision is None:
        raise InvalidArgument("decision is unspecified", field="decision")
    return Admission(
        decision=decision,
        reason=reason,
        message=msg.message,
        node_id=msg.node_id,
        reservation_id=msg.reservation_id,
        lease_epoch=msg.lease_epoch,
        lease_version=msg.lease_version,
        expires_at_ms=msg.expires_unix_ms,
        predicted_ttft_ms=msg.predicted_ttft_ms,
        normal_ttft_ms=msg.normal_ttft_ms,
        plan=plan,
        shadow_decision=decision_from_proto(msg.shadow_decision),
        replayed=msg.replayed,
        debit=c.credits_from_proto(msg.debit, "debit") if msg.HasField("debit") else None,
    )


def _finite(value: float) -> float:
    return value if math.isfinite(value) else float(MAX_TOKENS)


Converter = Callable[..., Any]

MIRRORS: dict[str, tuple[Converter, Converter]] = {
    "crossflow.v1.Credits": (c.credits_to_proto, c.credits_from_proto),
    "crossflow.v1.Lease": (c.lease_to_proto, c.lease_from_proto),
    "crossflow.v1.PoolLoad": (c.pool_load_to_proto, c.pool_load_from_proto),
    "crossflow.v1.StepModel": (c.step_model_to_proto, c.step_model_from_proto),
    "crossflow.v1.Notice": (c.notice_to_proto, c.notice_from_proto),
    "crossflow.v1.SessionSettings": (c.session_settings_to_proto, c.session_settings_from_proto),
    "crossflow.v1.Reservation": (c.reservation_to_proto, c.reservation_from_proto),
    "crossflow.v1.NodeStatus": (c.node_status_to_proto, c.node_state_from_proto),
    "crossflow.v1.PoolStatus": (c.pool_to_proto, c.pool_from_proto),
    "crossflow.v1.AdmitRequest": (admit_request_to_proto, admit_request_from_proto),
    "crossflow.v1.AdmitResponse": (admission_to_proto, admission_from_proto),
    "crossflow.v1.Explanation": (plan_to_proto, plan_from_proto),
    "crossflow.v1.DemandCheck": (_demand_to_proto, _demand_from_proto),
    "crossflow.v1.NodeCheck": (_node_check_to_proto, _node_check_from_proto),
    "crossflow.v1.NormalPathEstimate": (plan_to_proto, plan_from_proto),
    "crossflow.v1.GetPolicyResponse": (c.policy_to_json, c.policy_from_json),
    "crossflow.v1.SetPolicyResponse": (c.policy_to_json, c.policy_from_json),
    "crossflow.v1.WatchRoomRequest": (cr.watch_request_to_proto, cr.watch_request_from_proto),
    "crossflow.v1.WatchRoomResponse": (cr.room_update_to_proto, cr.room_update_from_proto),
    "crossflow.v1.NodeRoom": (cr.node_room_to_proto, cr.node_room_from_proto),
}

WIRE_ONLY: dict[str, str] = {
    "crossflow.v1.Hello": "agent handshake; fields go to Store.register_node",
    "crossflow.v1.Heartbeat": "keep-alive, no state",
    "crossflow.v1.ConnectRequest": "oneof envelope",
    "crossflow.v1.ConnectResponse": "oneof envelope",
    "crossflow.v1.NoticeBatch": "repeated Notice (each converted by notice_to_proto)",
    "crossflow.v1.Welcome": "built from settings and NodeInfo",
    "crossflow.v1.LeaseAck": "built from LeaseOutcome / StaleLease / InvalidArgument",
    "crossflow.v1.AdmitStreamRequest": "repeated AdmitStreamItem",
    "crossflow.v1.AdmitStreamItem": "client id and an AdmitRequest",
    "crossflow.v1.AdmitStreamResponse": "repeated AdmitStreamResult",
    "crossflow.v1.AdmitStreamResult": "client id and an AdmitResponse or an AdmitStreamError",
    "crossflow.v1.AdmitStreamError": "status code and message of a refused item",
    "crossflow.v1.CommitRequest": "reservation id and request id",
    "crossflow.v1.CommitResponse": "reservation id and expiry",
    "crossflow.v1.ReleaseRequest": "reservation id, outcome and request id",
    "crossflow.v1.ReleaseResponse": "reservation id only",
    "crossflow.v1.ListNodesRequest": "filters",
    "crossflow.v1.ListNodesResponse": "repeated NodeStatus",
    "crossflow.v1.GetNodeRequest": "node id only",
    "crossflow.v1.GetNodeResponse": "NodeStatus, Reservation, Lease, LeaseEvent",
    "crossflow.v1.LeaseEvent": "store NodeEvent, built in the admin servicer",
    "crossflow.v1.ListReservationsRequest": "node id only",
    "crossflow.v1.ListReservationsResponse": "repeated Reservation",
    "crossflow.v1.ListPoolsRequest": "empty",
    "crossflow.v1.ListPoolsResponse": "repeated PoolStatus",
    "crossflow.v1.CordonRequest": "node id and reason",
    "crossflow.v1.CordonResponse": "NodeStatus",
    "crossflow.v1.UncordonRequest": "node id only",
    "crossflow.v1.DeleteNodeRequest": "node id and the force flag",
    "crossflow.v1.DeleteNodeResponse": "node id and a count",
    "crossflow.v1.UncordonResponse": "NodeStatus",
    "crossflow.v1.GetPolicyRequest": "empty",
    "crossflow.v1.SetPolicyRequest": "key -> text updates, see policy.parse_policy_updates",
}
