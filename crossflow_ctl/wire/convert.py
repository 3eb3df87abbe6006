"""Proto <-> domain conversion for every ``crossflow.v1`` message (the one bridge).

Inbound converters validate through the domain models and raise
:class:`~crossflow_ctl.domain.errors.InvalidArgument` naming the field as the wire spells it
(``lease.credits.compute_tokens``). ``MIRRORS`` lists each message with a domain mirror and
``WIRE_ONLY`` each request/response wrapper; tests/broker/test_convert.py fails when a message
is in neither, so a new message cannot ship without a bridge.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from enum import Enum
from typing import Any, TypeVar

from crossflow_ctl.api.v1 import admin_pb2, common_pb2, lease_pb2
from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.models import (
    CREDIT_NAMES,
    ComputeTime,
    Credits,
    Lease,
    NodeInfo,
    NodeRole,
    NodeState,
    Notice,
    NoticeKind,
    NoticeRow,
    PoolLoad,
    PoolSnapshot,
    Reservation,
    ReservationState,
    Share,
    StoredLease,
    ZeroReason,
    validated_from,
)
from crossflow_ctl.domain.online_calibration import StepModelReport
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.domain.session import SessionSettings

E = TypeVar("E", bound=Enum)

STORE_UNAVAILABLE_PREFIX = "store unavailable: "
"""Starts the message of every UNAVAILABLE the broker itself answers, so a client tells "the
broker's store is down" from "the broker cannot be reached" (gRPC's own UNAVAILABLE)."""

NO_POOL_WAIT_MS = -1.0
"""``DemandCheck.pool_wait_ms`` on the wire when no pool reports (proto3 has no null double)."""


# -- enums: the proto value name is PREFIX + the domain member name -------------------------
_ENUM_NUMBERS: dict[tuple[type, Enum | None, str, str], int] = {}
"""(class, member, proto enum, prefix) -> number: every Admit answer converts two or three
enums. The class is part of the key because StrEnum members compare equal to their value."""


def enum_to_proto(value: Enum | None, wrapper: Any, prefix: str) -> int:
    key = (type(value), value, wrapper.DESCRIPTOR.full_name, prefix)
    number = _ENUM_NUMBERS.get(key)
    if number is None:
        name = f"{prefix}UNSPECIFIED" if value is None else prefix + value.name
        number = _ENUM_NUMBERS[key] = int(wrapper.Value(name))
    return number


def enum_from_proto(number: int, wrapper: Any, prefix: str, cls: type[E], field: str) -> E | None:
    try:
        name = wrapper.Name(number)
    except ValueError:
        raise InvalidArgument(f"unknown enum value {number}", field=field) from None
    if name == f"{prefix}UNSPECIFIED":
        return None
    return cls[name[len(prefix) :]]


def _validated(cls: type[Any], field: str, **data: Any) -> Any:
    return _validated_from(cls, field, data)


def _validated_from(cls: type[Any], field: str, data: dict[str, Any]) -> Any:
    try:
        return validated_from(cls, data)
    except InvalidArgument as exc:
        inner = exc.field or ""
        named = ".".join(part for part in (field, inner) if part) or None
        raise InvalidArgument(exc.message, field=named) from None


# -- common ---------------------------------------------------------------------------------
def credits_fields(c: Credits | common_pb2.Credits) -> dict[str, int]:
    """The five amounts of ``c`` (the domain model or the message) by field name: the fields
    of a message built with nested fields, or the data to validate one from."""
    return {
        "compute_tokens": c.compute_tokens,
        "kv_tokens": c.kv_tokens,
        "kv_transfer_bytes": c.kv_transfer_bytes,
        "output_tokens": c.output_tokens,
        "slots": c.slots,
    }


def credits_to_proto(c: Credits) -> common_pb2.Credits:
    return common_pb2.Credits(**credits_fields(c))


def credits_from_proto(msg: common_pb2.Credits, field: str = "credits") -> Credits:
    result: Credits = _validated(Credits, field, **credits_fields(msg))
    return result


def lease_to_proto(lease: Lease) -> common_pb2.Lease:
    return common_pb2.Lease(
        node_id=lease.node_id,
        epoch=lease.epoch,
        version=lease.version,
        ttl_ms=lease.ttl_ms,
        credits=credits_to_proto(lease.credits),
        zero_reason=enum_to_proto(lease.zero_reason, common_pb2.ZeroReason, "ZERO_REASON_"),  # type: ignore[arg-type]
        zero_detail=lease.zero_detail,
        queue_wait_ms=lease.queue_wait_ms,
        borrowed_prefill_rate_tps=lease.borrowed_prefill_rate_tps,
        prefill_s_per_token=lease.prefill_s_per_token,
        prefill_s_per_token_context=lease.prefill_s_per_token_context,
        itl_ms=lease.itl_ms,
        itl_slo_ms=lease.itl_slo_ms,
        last_notice_seq=lease.last_notice_seq,
        snapshot_unix_ms=lease.snapshot_unix_ms,
        horizon_ms=lease.horizon_ms,
    )


def lease_from_proto(msg: common_pb2.Lease, field: str = "lease") -> Lease:
    """One validation pass (credits inside) over one dict built here: a broker takes
    thousands a second."""
    return _lease_from_proto(msg, field, credits_fields(msg.credits))


def _lease_from_proto(
    msg: common_pb2.Lease, field: str, credits: Credits | dict[str, int]
) -> Lease:
    zero = None
    if msg.zero_reason:  # 0 is UNSPECIFIED: no reason
        zero = enum_from_proto(
            msg.zero_reason,
            common_pb2.ZeroReason,
            "ZERO_REASON_",
            ZeroReason,
            f"{field}.zero_reason",
        )
    data = {
        "node_id": msg.node_id,
        "epoch": msg.epoch,
        "version": msg.version,
        "ttl_ms": msg.ttl_ms,
        "credits": credits,
        "zero_reason": zero,
        "zero_detail": msg.zero_detail,
        "queue_wait_ms": msg.queue_wait_ms,
        "borrowed_prefill_rate_tps": msg.borrowed_prefill_rate_tps,
        "prefill_s_per_token": msg.prefill_s_per_token,
        "prefill_s_per_token_context": msg.prefill_s_per_token_context,
        "itl_ms": msg.itl_ms,
        "itl_slo_ms": msg.itl_slo_ms,
        "last_notice_seq": msg.last_notice_seq,
        "snapshot_unix_ms": msg.snapshot_unix_ms,
        "horizon_ms": msg.horizon_ms,
    }
    result: Lease = _validated_from(Lease, field, data)
    return result


def pool_load_to_proto(load: PoolLoad) -> common_pb2.PoolLoad:
    return common_pb2.PoolLoad(**load.model_dump())


def pool_load_from_proto(msg: common_pb2.PoolLoad, field: str = "pool_load") -> PoolLoad:
    result: PoolLoad = _validated(
        PoolLoad,
        field,
        pool=msg.pool or "default",
        node_id=msg.node_id,
        outstanding_uncached_tokens=msg.outstanding_uncached_tokens,
        processing_rate_tps=msg.processing_rate_tps,
        prefill_rate_tps=msg.prefill_rate_tps,
        ttl_ms=msg.ttl_ms,
        queued_requests=msg.queued_requests,
        queue_wait_ms=msg.queue_wait_ms if msg.HasField("queue_wait_ms") else None,
    )
    return result


def step_model_to_proto(report: StepModelReport) -> common_pb2.StepModel:
    data = report.model_dump(mode="json")
    data["fit_status"] = data["fit_status"] or ""
    return common_pb2.StepModel(**data)


def step_model_from_proto(msg: common_pb2.StepModel, field: str = "step_model") -> StepModelReport:
    """A StepModel as the domain report; InvalidArgument naming the field when it is not one
    (an unknown ``using``, ``fit_status`` or constant, a negative or non-finite value)."""
    result: StepModelReport = _validated(
        StepModelReport,
        field,
        using=msg.using,
        fit_status=msg.fit_status or None,
        fit_error=msg.fit_error,
        prior_error=msg.prior_error,
        windows=msg.windows,
        periods=msg.periods,
        prior_name=msg.prior_name,
        prior=dict(msg.prior),
        fitted=dict(msg.fitted),
        active=dict(msg.active),
        detail=msg.detail,
        at_unix_ms=msg.at_unix_ms,
    )
    return result


def role_to_proto(role: NodeRole) -> int:
    return enum_to_proto(role, common_pb2.NodeRole, "NODE_ROLE_")


def role_from_proto(number: int, field: str = "role") -> NodeRole | None:
    return enum_from_proto(number, common_pb2.NodeRole, "NODE_ROLE_", NodeRole, field)


# -- lease stream ---------------------------------------------------------------------------
def notice_to_proto(notice: Notice) -> lease_pb2.Notice:
    return lease_pb2.Notice(
        seq=notice.seq,
        kind=enum_to_proto(notice.kind, lease_pb2.NoticeKind, "NOTICE_KIND_"),  # type: ignore[arg-type]
        reservation_id=notice.reservation_id,
        debit=credits_to_proto(notice.debit),
        at_unix_ms=notice.at_ms,
        pulled_tokens=notice.pulled_tokens,
    )


_NOTICE_KINDS: dict[int, int] = {
    id(kind): enum_to_proto(kind, lease_pb2.NoticeKind, "NOTICE_KIND_") for kind in NoticeKind
}
"""Each kind's message number, by the member's ``id`` (members are singletons): an Enum's
``__hash__`` is a Python call, one per relayed notice."""
_DEBITS: dict[tuple[int, ...], common_pb2.Credits] = {}
"""Notice debits as messages, by amounts (never modified: copied into each notice); a node's
grants repeat a few debits. Starts over when full."""
_DEBITS_CAPACITY = 1 << 12


def notice_rows_to_proto(rows: Sequence[NoticeRow]) -> lease_pb2.NoticeBatch:
    """The message an agent stream relays for ``rows``, field for field and byte for byte what
    ``NoticeBatch(notices=[notice_to_proto(n) ...])`` makes of the same notices, without a model
    or a keyword-built message per notice: relaying every grant and expiry to its agent was a
    sixth of a busy broker's CPU (issue 13)."""
    batch = lease_pb2.NoticeBatch()
    add = batch.notices.add
    kinds = _NOTICE_KINDS
    for seq, kind, reservation_id, debit, at_ms, pulled in rows:
        notice = add(
            seq=seq,
            kind=kinds[id(kind)],
            reservation_id=reservation_id,
            at_unix_ms=at_ms,
            pulled_tokens=pulled,
        )
        if debit is None:
            notice.debit.SetInParent()  # present even when zero, as notice_to_proto sets it
            continue
        message = _DEBITS.get(debit)
        if message is None:
            if len(_DEBITS) >= _DEBITS_CAPACITY:
                _DEBITS.clear()
            message = _DEBITS[debit] = common_pb2.Credits(
                **dict(zip(CREDIT_NAMES, debit, strict=True))
            )
        notice.debit.CopyFrom(message)
    return batch


def notice_from_proto(msg: lease_pb2.Notice, node_id: str) -> Notice:
    kind = enum_from_proto(msg.kind, lease_pb2.NoticeKind, "NOTICE_KIND_", NoticeKind, "kind")
    if kind is None:
        raise InvalidArgument("notice kind is unspecified", field="kind")
    return Notice(
        node_id=node_id,
        seq=msg.seq,
        kind=kind,
        reservation_id=msg.reservation_id,
        debit=credits_from_proto(msg.debit, "debit"),
        at_ms=msg.at_unix_ms,
        pulled_tokens=msg.pulled_tokens if msg.HasField("pulled_tokens") else None,
    )


def session_settings_to_proto(settings: SessionSettings) -> lease_pb2.SessionSettings:
    return lease_pb2.SessionSettings(
        max_lease_ttl_ms=settings.max_lease_ttl_ms,
        borrow_horizon_ms=settings.borrow_horizon_ms,
        kv_bytes_per_token=settings.kv_bytes_per_token,
        policy_version=settings.policy_version,
    )


def session_settings_from_proto(msg: lease_pb2.SessionSettings) -> SessionSettings:
    return SessionSettings(
        max_lease_ttl_ms=msg.max_lease_ttl_ms,
        borrow_horizon_ms=msg.borrow_horizon_ms,
        kv_bytes_per_token=msg.kv_bytes_per_token,
        policy_version=msg.policy_version,
    )


# -- admin ----------------------------------------------------------------------------------
def reservation_to_proto(r: Reservation) -> admin_pb2.Reservation:
    return admin_pb2.Reservation(
        reservation_id=r.reservation_id,
        node_id=r.node_id,
        state=enum_to_proto(r.state, admin_pb2.ReservationState, "RESERVATION_STATE_"),  # type: ignore[arg-type]
        debit=credits_to_proto(r.debit),
        lease_epoch=r.lease_epoch,
        lease_version=r.lease_version,
        created_unix_ms=r.created_at_ms,
        expires_unix_ms=r.expires_at_ms,
        grant_seq=r.grant_seq,
        release_seq=r.release_seq,
        request_id=r.request_id,
        owner=r.owner,
        compute_us=r.compute_us,
    )


def reservation_from_proto(msg: admin_pb2.Reservation) -> Reservation:
    state = enum_from_proto(
        msg.state, admin_pb2.ReservationState, "RESERVATION_STATE_", ReservationState, "state"
    )
    return Reservation(
        reservation_id=msg.reservation_id,
        node_id=msg.node_id,
        state=state or ReservationState.HELD,
        debit=credits_from_proto(msg.debit, "debit"),
        lease_epoch=msg.lease_epoch,
        lease_version=msg.lease_version,
        created_at_ms=msg.created_unix_ms,
        expires_at_ms=msg.expires_unix_ms,
        grant_seq=msg.grant_seq,
        release_seq=msg.release_seq,
        request_id=msg.request_id,
        owner=msg.owner,
        compute_us=msg.compute_us,
    )


def node_status_to_proto(node: NodeState, now_ms: int, share: Share) -> admin_pb2.NodeStatus:
    """``available`` is what admission could still lend: lease x ``share`` (per credit) - open
    debits."""
    msg = admin_pb2.NodeStatus(
        node_id=node.info.node_id,
        role=role_to_proto(node.info.role),  # type: ignore[arg-type]
        cordoned=node.info.cordoned,
        cordon_reason=node.info.cordon_reason,
        open_debits=credits_to_proto(node.open_debits),
        available=credits_to_proto(node.available(now_ms, share)),
        open_reservations=node.open_reservations,
        labels=dict(node.info.labels),
        notice_seq=node.info.notice_seq,
        pool=node.info.pool,
        open_compute_us=node.open_compute.us,
        open_timed_compute_tokens=node.open_compute.tokens,
        registered_unix_ms=node.info.registered_at_ms,
    )
    if node.lease is not None:
        msg.lease.CopyFrom(lease_to_proto(node.lease.lease))
        msg.lease_received_unix_ms = node.lease.received_at_ms
        msg.lease_expires_unix_ms = node.lease.expires_at_ms
        msg.lease_expired = node.lease.expired(now_ms)
    return msg


def node_state_from_proto(msg: admin_pb2.NodeStatus) -> NodeState:
    lease = None
    if msg.HasField("lease"):
        lease = StoredLease(
            lease=lease_from_proto(msg.lease),
            received_at_ms=msg.lease_received_unix_ms,
            expires_at_ms=msg.lease_expires_unix_ms,
        )
    info = NodeInfo(
        node_id=msg.node_id,
        role=role_from_proto(msg.role) or NodeRole.DECODE,
        pool=msg.pool or "default",
        cordoned=msg.cordoned,
        cordon_reason=msg.cordon_reason,
        labels=dict(msg.labels),
        notice_seq=msg.notice_seq,
        registered_at_ms=max(0, msg.registered_unix_ms),
    )
    return NodeState(
        info=info,
        lease=lease,
        open_debits=credits_from_proto(msg.open_debits, "open_debits"),
        open_reservations=msg.open_reservations,
        open_compute=ComputeTime(msg.open_compute_us, msg.open_timed_compute_tokens),
    )


def pool_to_proto(pool: PoolSnapshot) -> admin_pb2.PoolStatus:
    wait = pool.estimated_wait_ms()
    return admin_pb2.PoolStatus(
        pool=pool.pool,
        reports=[pool_load_to_proto(r) for r in pool.reports],
        outstanding_uncached_tokens=pool.outstanding_uncached_tokens,
        processing_rate_tps=pool.processing_rate_tps,
        estimated_wait_ms=NO_POOL_WAIT_MS if wait is None else wait,
    )


def pool_from_proto(msg: admin_pb2.PoolStatus) -> PoolSnapshot:
    return PoolSnapshot(
        pool=msg.pool, reports=tuple(pool_load_from_proto(r, "reports") for r in msg.reports)
    )


def policy_to_json(policy: PolicySettings) -> str:
    return policy.model_dump_json()


def policy_from_json(text: str) -> PolicySettings:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"not JSON: {exc}", field="policy_json") from None
    result: PolicySettings = _validated(PolicySettings, "policy", **data)
    return result
