"""Translate between the Redis store's stored forms and the domain models.

The formats are described where they are written: reservation records in ``lua/_lib.lua``,
notice stream entries in ``lua/_lib.lua`` (``cf_notice``), node events as ``at|kind|message``.
Responses may be ``bytes`` or ``str`` depending on the client's ``decode_responses``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from crossflow_ctl.domain.models import (
    Credits,
    NodeInfo,
    NodeRole,
    NodeState,
    Notice,
    NoticeKind,
    Reservation,
    ReservationState,
    StoredLease,
    StoredPoolLoad,
)
from crossflow_ctl.store.base import NodeEvent

Raw = bytes | str
VIEW_INFO_FIELDS = ("role", "pool", "labels", "cordoned", "cordon_reason", "seq")
"""The info fields ``node_view.lua`` returns, in order."""


def text(value: Raw | int) -> str:
    if isinstance(value, bytes):
        return value.decode()
    return str(value)


def text_map(raw: Mapping[Raw, Raw]) -> dict[str, str]:
    return {text(k): text(v) for k, v in raw.items()}


def info_from(node_id: str, fields: Mapping[str, str]) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        role=NodeRole(fields.get("role") or NodeRole.DECODE.value),
        pool=fields.get("pool") or "default",
        cordoned=fields.get("cordoned") == "1",
        cordon_reason=fields.get("cordon_reason") or "",
        labels=json.loads(fields.get("labels") or "{}"),
        notice_seq=int(fields.get("seq") or "0"),
    )


def reservation_from(reservation_id: str, node_id: str, record: Raw) -> Reservation:
    f = text(record).split("|", 12)
    return Reservation(
        reservation_id=reservation_id,
        node_id=node_id,
        state=ReservationState(f[0]),
        expires_at_ms=int(f[1]),
        release_seq=int(f[2]),
        debit=Credits.from_tuple([int(v) for v in f[3:8]]),
        created_at_ms=int(f[8]),
        grant_seq=int(f[9]),
        lease_epoch=int(f[10]),
        lease_version=int(f[11]),
        request_id=f[12],
    )


def node_state_from_view(node_id: str, raw: Sequence[Any]) -> NodeState | None:
    """A ``node_view.lua`` reply as a NodeState; None for an unknown node (empty reply)."""
    if not raw:
        return None
    lease_json = text(raw[1])
    return NodeState(
        info=info_from(node_id, dict(zip(VIEW_INFO_FIELDS, map(text, raw[0]), strict=True))),
        lease=StoredLease.model_validate_json(lease_json) if lease_json else None,
        open_debits=Credits.from_tuple([int(text(v)) for v in raw[2:7]]),
        open_reservations=int(text(raw[7])),
    )


def notice_from(node_id: str, entry_id: Raw, fields: Mapping[Raw, Raw]) -> Notice:
    f = text_map(fields)
    return Notice(
        node_id=node_id,
        seq=int(text(entry_id).split("-", 1)[0]),
        kind=NoticeKind(f["k"]),
        reservation_id=f.get("r", ""),
        debit=Credits.from_tuple([int(v) for v in f.get("d", "0,0,0,0,0").split(",")]),
        at_ms=int(f.get("t", "0")),
    )


def event_from(raw: Raw) -> NodeEvent:
    at_ms, kind, message = text(raw).split("|", 2)
    return NodeEvent(at_ms=int(at_ms), kind=kind, message=message)


def live_pool_loads(raw: Mapping[Raw, Raw], now_ms: int) -> list[StoredPoolLoad]:
    """The unexpired reports of one pool hash, sorted by reporting node."""
    stored = [StoredPoolLoad.model_validate_json(v) for v in raw.values()]
    return sorted((s for s in stored if s.expires_at_ms > now_ms), key=lambda s: s.load.node_id)


def flat_pairs(values: Sequence[Raw]) -> dict[str, str]:
    """A flat ``[k1, v1, k2, v2, ...]`` reply (HGETALL inside Lua) as a dict."""
    return {text(values[i]): text(values[i + 1]) for i in range(0, len(values) - 1, 2)}
