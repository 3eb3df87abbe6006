"""Translate between the Redis store's stored forms and the domain models.

The formats are described where they are written: reservation records in ``lua/_lib.lua``,
notice stream entries in ``lua/_lib.lua`` (``cf_notice``), node events as ``at|kind|message``.
Responses may be ``bytes`` or ``str`` depending on the client's ``decode_responses``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Generic, TypeVar

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
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
VIEW_INFO_FIELDS = ("role", "pool", "labels", "cordoned", "cordon_reason", "seq")
"""The info fields ``node_view.lua`` returns, in order (``seq`` last)."""


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
    f = text(record).split("|", 13)
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
        owner=f[12],
        request_id=f[13],
    )


class Memo(Generic[K, V]):
    """A bounded map from a stored form to its parsed (frozen) value.

    A node's info and lease change once per agent period while admission reads them on every
    request; parsing and validating them again each time was most of a view's cost. Values are
    frozen models, so sharing one between callers is safe; when full the map starts over."""

    def __init__(self, build: Callable[[K], V], capacity: int = 4096) -> None:
        self._build = build
        self._capacity = capacity
        self._items: dict[K, V] = {}

    def __call__(self, key: K) -> V:
        value = self._items.get(key)
        if value is None:
            if len(self._items) >= self._capacity:
                self._items.clear()
            value = self._items[key] = self._build(key)
        return value


def _stored_lease(raw: Raw) -> StoredLease:
    return StoredLease.model_validate_json(raw)


def _view_info(key: tuple[Raw, ...]) -> NodeInfo:
    """A node's info from its id and view fields, less ``seq`` (which every notice moves)."""
    node_id, *fields = map(text, key)
    return info_from(node_id, dict(zip(VIEW_INFO_FIELDS[:-1], fields, strict=True)))


stored_lease_from_json: Memo[Raw, StoredLease] = Memo(_stored_lease)
"""A stored lease's JSON (as ``upsert_lease`` wrote it) parsed once per distinct lease."""
_view_info_memo: Memo[tuple[Raw, ...], NodeInfo] = Memo(_view_info)


def node_state_from_view(node_id: str, raw: Sequence[Any]) -> NodeState | None:
    """A ``node_view.lua`` reply as a NodeState; None for an unknown node (empty reply).

    Info and lease are parsed once per distinct stored form (:class:`Memo`); the open debits
    are counts the script computed from validated debits, so they are built without
    re-validation (``int`` reads the script's decimal replies, bytes or str, directly)."""
    if not raw:
        return None
    lease_json = raw[1]
    open_debits = Credits.model_construct(
        compute_tokens=max(0, int(raw[2])),
        kv_tokens=max(0, int(raw[3])),
        kv_transfer_bytes=max(0, int(raw[4])),
        output_tokens=max(0, int(raw[5])),
        slots=max(0, int(raw[6])),
    )
    return NodeState.model_construct(
        info=_view_info_memo((node_id, *raw[0][:-1])).model_copy(
            update={"notice_seq": int(raw[0][-1] or 0)}
        ),
        lease=stored_lease_from_json(lease_json) if lease_json else None,
        open_debits=open_debits,
        open_reservations=int(raw[7]),
    )


def notice_from(node_id: str, entry_id: Raw, fields: Mapping[Raw, Raw]) -> Notice:
    """A notice stream entry as ``cf_notice`` wrote it (every grant and expiry makes one, and
    each agent stream's relay reads it), built without re-validating what the scripts wrote:
    the kind is still checked by its enum and the numbers by ``int``; ``node_id`` is one the
    caller already checked (it named the stream's key)."""
    f = text_map(fields)
    c1, c2, c3, c4, c5 = (max(0, int(v)) for v in f.get("d", "0,0,0,0,0").split(","))
    debit = Credits.model_construct(
        compute_tokens=c1, kv_tokens=c2, kv_transfer_bytes=c3, output_tokens=c4, slots=c5
    )
    return Notice.model_construct(
        node_id=node_id,
        seq=int(text(entry_id).split("-", 1)[0]),
        kind=NoticeKind(f["k"]),
        reservation_id=f.get("r", ""),
        debit=debit,
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
