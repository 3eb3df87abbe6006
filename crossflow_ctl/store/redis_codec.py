"""Translate between the Redis store's stored forms and the domain models.

The formats are described where they are written: reservation records in ``lua/_lib.lua``,
notice stream entries in ``lua/_lib.lua`` (``cf_notice``), node events as ``at|kind|message``,
the current lease as the fields of its hash (:data:`LEASE_FIELDS`, below).
Responses may be ``bytes`` or ``str`` depending on the client's ``decode_responses``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Mapping, Sequence
from math import copysign
from typing import Any, Generic, TypeVar

from pydantic import ValidationError

from crossflow_ctl.domain.errors import StoreUnavailable
from crossflow_ctl.domain.models import (
    CREDIT_NAMES,
    MAX_TOKENS,
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
    Reservation,
    ReservationState,
    StoredLease,
    StoredPoolLoad,
    known_fields,
)
from crossflow_ctl.store.base import NodeEvent

Raw = bytes | str
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
VIEW_INFO_FIELDS = ("role", "pool", "labels", "cordoned", "cordon_reason", "registered", "seq")
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
        registered_at_ms=int(fields.get("registered") or "0"),
    )


def reservation_from(reservation_id: str, node_id: str, record: Raw) -> Reservation:
    """A reservation record (``_lib.lua``): its compute field is ``<tokens>:<us>`` when timed."""
    f = text(record).split("|", 13)
    compute, _, us = f[3].partition(":")
    return Reservation(
        reservation_id=reservation_id,
        node_id=node_id,
        state=ReservationState(f[0]),
        expires_at_ms=int(f[1]),
        release_seq=int(f[2]),
        debit=Credits.from_tuple([int(compute), *(int(v) for v in f[4:8])]),
        compute_us=int(us or 0),
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


LEASE_FIELDS: dict[str, str] = {
    "ev": "<epoch:020d><version:020d>: 40 digits, compared as text by the scripts (63-bit exact)",
    "epoch": "lease.epoch",
    "version": "lease.version",
    "exp": "expires_at_ms (broker clock)",
    "zero": "'' when the lease lends; its zero_reason, or 'no_capacity' for all-zero credits",
    "c1": "credits.compute_tokens",
    "c2": "credits.kv_tokens",
    "c3": "credits.kv_transfer_bytes",
    "c4": "credits.output_tokens",
    "c5": "credits.slots",
    "node": "lease.node_id",
    "ttl": "lease.ttl_ms",
    "reason": "lease.zero_reason ('' for None)",
    "qwait": "lease.queue_wait_ms",
    "rate": "lease.borrowed_prefill_rate_tps",
    "a": "lease.prefill_s_per_token",
    "b": "lease.prefill_s_per_token_context",
    "itl": "lease.itl_ms",
    "itl_slo": "lease.itl_slo_ms",
    "nseq": "lease.last_notice_seq",
    "snap": "lease.snapshot_unix_ms",
    "horizon": "lease.horizon_ms",
    "recv": "received_at_ms (broker clock)",
    "detail": "lease.zero_detail (last: the one free-text field, see PACKED_SEPARATOR)",
}
"""The lease HASH: the one stored form of a node's current lease, one field each (decimal text;
floats as ``repr``, which reads back exactly). ``upsert_leases.lua`` writes them all at once;
``try_debit.lua``, ``set_cordon.lua`` and ``node_view.lua`` read them. The first ten and
``rate`` (Safety counts the open compute debits in the lease's unit) are what the scripts
themselves use."""
ADDED_LEASE_FIELDS: dict[str, str] = {"horizon": "0"}
"""Fields added since the format was first written, each with what a hash or history entry an
earlier broker wrote (without it) reads as."""
ZERO_FIELD = list(LEASE_FIELDS).index("zero")
"""Where ``zero`` is among :func:`lease_hash_values`."""
LEASE_FIELD_NAMES = "|".join(LEASE_FIELDS)
"""The names as ``upsert_leases.lua`` takes them (one argument per call)."""
PACKED_SEPARATOR = "\x1f"
"""Joins a lease's values into one script argument (:func:`packed_lease_values`): no value but
the last (``detail``, free text) can hold it (ids, enum values and numbers do not)."""


def zero_marker(lease: Lease) -> str:
    """The ``zero`` field: why admission may not debit the lease ('' when it lends)."""
    if lease.zero_reason is not None:
        return lease.zero_reason.value
    return "no_capacity" if lease.credits.is_zero() else ""


def order_marker(lease: Lease) -> str:
    """The ``ev`` field: epoch and version as one string that sorts as the pair does (each
    zero-padded to 20 digits: ``zfill`` pads as ``f"{n:020d}"`` does, in half the time)."""
    return str(lease.epoch).zfill(20) + str(lease.version).zfill(20)


_FLOAT_TEXT: dict[float, str] = {}
FLOAT_TEXT_CAPACITY = 4096


def float_text(value: float) -> str:
    """``repr(value)`` (reads back exactly), remembered for nonzero values: a node's model
    constants (rate, prefill costs, ITL SLO) repeat in every lease it sends, and formatting a
    float cost more than looking it up. Zero is not remembered (0.0 and -0.0 are one key but
    two texts: answered by their sign instead), nor is anything but a float (1, 1.0 and True
    are one key but three texts). The map starts over when full."""
    if type(value) is not float:
        return repr(value)
    if not value:  # 0.0 or -0.0 (nan is true): no dict miss and no repr, unset fields are zero
        return "0.0" if copysign(1.0, value) > 0 else "-0.0"
    text = _FLOAT_TEXT.get(value)
    if text is None:
        text = repr(value)
        if value != 0.0:
            if len(_FLOAT_TEXT) >= FLOAT_TEXT_CAPACITY:
                _FLOAT_TEXT.clear()
            _FLOAT_TEXT[value] = text
    return text


def lease_hash_values(lease: Lease, received_at_ms: int, expires_at_ms: int) -> tuple[str, ...]:
    """The lease hash's values (:data:`LEASE_FIELDS`, in that order) for ``lease`` received at
    ``received_at_ms`` and expiring at ``expires_at_ms`` (broker clock)."""
    c = lease.credits
    reason = lease.zero_reason
    return (
        order_marker(lease),
        str(lease.epoch),
        str(lease.version),
        str(expires_at_ms),
        zero_marker(lease),
        str(c.compute_tokens),
        str(c.kv_tokens),
        str(c.kv_transfer_bytes),
        str(c.output_tokens),
        str(c.slots),
        lease.node_id,
        str(lease.ttl_ms),
        "" if reason is None else reason.value,
        float_text(lease.queue_wait_ms),
        float_text(lease.borrowed_prefill_rate_tps),
        float_text(lease.prefill_s_per_token),
        float_text(lease.prefill_s_per_token_context),
        float_text(lease.itl_ms),
        float_text(lease.itl_slo_ms),
        str(lease.last_notice_seq),
        str(lease.snapshot_unix_ms),
        str(lease.horizon_ms),
        str(received_at_ms),
        lease.zero_detail,
    )


def packed_lease_values(values: tuple[str, ...]) -> str:
    """:func:`lease_hash_values` as ONE script argument (``upsert_leases.lua`` splits it, and
    pushes it whole as the lease's history entry: :func:`stored_lease_from_packed`)."""
    return PACKED_SEPARATOR.join(values)


def stored_lease_from_packed(raw: Raw) -> StoredLease:
    """A history entry (:func:`packed_lease_values`) as :func:`stored_lease_from_fields` reads
    a lease hash: the same checks, the same StoreUnavailable naming a corrupt field.

    An entry that earlier brokers wrote (a StoredLease JSON object, while a packed entry
    opens with the 40 digits of ``ev``) is still read, so a rolling upgrade does not make the
    node's history unreadable until 32 newer leases have pushed the old entries out; so is a
    packed entry written before :data:`ADDED_LEASE_FIELDS` (fewer values), unless its free-text
    ``detail`` holds the separator itself, which makes it look newer than it is."""
    entry = text(raw)
    if entry.startswith("{"):
        try:
            return StoredLease.model_validate_json(entry)
        except ValueError as exc:
            raise StoreUnavailable(f"stored lease history entry is corrupt: {exc}") from None
    values = entry.split(PACKED_SEPARATOR, len(LEASE_FIELDS) - 1)
    names = _EARLIER_LEASE_FIELDS if len(values) < len(LEASE_FIELDS) else tuple(LEASE_FIELDS)
    return stored_lease_from_fields(dict(zip(names, values, strict=False)))


_EARLIER_LEASE_FIELDS = tuple(name for name in LEASE_FIELDS if name not in ADDED_LEASE_FIELDS)


_INT_FIELDS = (
    "epoch",
    "version",
    "ttl",
    "c1",
    "c2",
    "c3",
    "c4",
    "c5",
    "nseq",
    "snap",
    "horizon",
    "recv",
    "exp",
)
_CREDIT_FIELDS = ("c1", "c2", "c3", "c4", "c5")
_FLOAT_FIELDS = ("qwait", "rate", "a", "b", "itl", "itl_slo")


def stored_lease_from_fields(raw: Mapping[Any, Raw]) -> StoredLease:
    """A lease hash (as :func:`lease_hash_values` wrote it) validated through the domain model;
    a missing, malformed or inconsistent field raises StoreUnavailable naming it."""
    f = {**ADDED_LEASE_FIELDS, **text_map(raw)}
    field = next((name for name in LEASE_FIELDS if name not in f), "")
    try:
        if field:
            raise ValueError("missing")
        n: dict[str, int | float] = {}
        for field in _INT_FIELDS:
            n[field] = int(f[field])
        for field in _FLOAT_FIELDS:
            n[field] = float(f[field])
        field = ""
        lease = Lease.model_validate(
            {
                "node_id": f["node"],
                "epoch": n["epoch"],
                "version": n["version"],
                "ttl_ms": n["ttl"],
                "credits": dict(zip(CREDIT_NAMES, (n[c] for c in _CREDIT_FIELDS), strict=True)),
                "zero_reason": f["reason"] or None,
                "zero_detail": f["detail"],
                "queue_wait_ms": n["qwait"],
                "borrowed_prefill_rate_tps": n["rate"],
                "prefill_s_per_token": n["a"],
                "prefill_s_per_token_context": n["b"],
                "itl_ms": n["itl"],
                "itl_slo_ms": n["itl_slo"],
                "last_notice_seq": n["nseq"],
                "snapshot_unix_ms": n["snap"],
                "horizon_ms": n["horizon"],
            }
        )
        stored = StoredLease(lease=lease, received_at_ms=n["recv"], expires_at_ms=n["exp"])
        # The scripts decide on ``ev`` and ``zero``: they must agree with the lease they index.
        expected = {"ev": order_marker(lease), "zero": zero_marker(lease)}
        field = next((name for name in ("ev", "zero") if f[name] != expected[name]), "")
        if field:
            raise ValueError(f"{f[field]!r} does not match the lease ({expected[field]!r})")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise StoreUnavailable(f"stored lease is corrupt (lease.{where}): {first['msg']}") from None
    except ValueError as exc:
        where = f" (field {field!r})" if field else ""
        raise StoreUnavailable(f"stored lease is corrupt{where}: {exc}") from None
    return stored


def _view_info(node_id: str, fields: Sequence[Raw]) -> NodeInfo:
    return info_from(node_id, dict(zip(VIEW_INFO_FIELDS, map(text, fields), strict=True)))


def _view_totals(raw: Sequence[Any]) -> Credits:
    return Credits.saturated(list(raw[2:7]))  # decimal replies, bytes or str: int() reads both


def _view_time(raw: Sequence[Any]) -> ComputeTime:
    return ComputeTime(int(raw[8]), int(raw[9]))


class NodeViews:
    """The last ``node_view.lua`` reply read for each node, with the NodeState built from it.

    Admission re-reads its working set of lenders every half cache age (25 ms by default) while
    most of them have not changed: an unchanged reply (compared whole: info fields and notice
    sequence, every lease field, the open debits) returns the state built before, a changed one
    rebuilds only the parts (info, lease, open debits) whose fields differ. The state is a pure
    function of the node id and the reply, so reuse can never show anything but what was just
    read: freshness stays the caller's (:mod:`.redis_cache`). One per store; bounded: one entry
    per node, and the map starts over when ``capacity`` nodes are held."""

    def __init__(self, capacity: int = 8192) -> None:
        self._capacity = capacity
        self._items: dict[str, tuple[Sequence[Any], NodeState]] = {}

    def state(self, node_id: str, raw: Sequence[Any]) -> NodeState | None:
        """``raw`` (a ``node_view.lua`` reply) as a NodeState; None for an unknown node (empty
        reply). ``int`` reads the script's decimal replies, bytes or str, directly. Models are
        built by their validating constructors: cheaper than ``model_construct`` on pydantic
        2.13 (measured: NodeState 1.7 us against 3.2 us, Notice 3 us against 20 us)."""
        if not raw:
            self._items.pop(node_id, None)
            return None
        last = self._items.get(node_id)
        if last is None:
            state = NodeState(
                info=_view_info(node_id, raw[0]),
                lease=stored_lease_from_fields(flat_pairs(raw[1])) if raw[1] else None,
                open_debits=_view_totals(raw),
                open_reservations=int(raw[7]),
                open_compute=_view_time(raw),
            )
        elif last[0] == raw:
            return last[1]
        else:
            state = _changed(node_id, raw, *last)
        if last is None and len(self._items) >= self._capacity:
            self._items.clear()
        self._items[node_id] = (raw, state)
        return state


def _changed(node_id: str, raw: Sequence[Any], was: Sequence[Any], before: NodeState) -> NodeState:
    """The state for ``raw``, reusing the parts of ``before`` (built from ``was``) whose fields
    did not change: a notice moves only the info's ``seq``, a debit only the totals."""
    info = before.info
    if was[0] != raw[0]:
        if list(was[0][:-1]) == list(raw[0][:-1]):
            info = info.model_copy(update={"notice_seq": int(raw[0][-1] or 0)})
        else:
            info = _view_info(node_id, raw[0])
    lease = before.lease
    if was[1] != raw[1]:
        lease = stored_lease_from_fields(flat_pairs(raw[1])) if raw[1] else None
    same_totals = list(was[2:]) == list(raw[2:])
    return NodeState(
        info=info,
        lease=lease,
        open_debits=before.open_debits if same_totals else _view_totals(raw),
        open_reservations=int(raw[7]),
        open_compute=before.open_compute if same_totals else _view_time(raw),
    )


def _notice_debit(stored: Raw) -> Credits:
    c1, c2, c3, c4, c5 = (max(0, int(v)) for v in text(stored).split(","))
    return Credits(
        compute_tokens=c1, kv_tokens=c2, kv_transfer_bytes=c3, output_tokens=c4, slots=c5
    )


notice_debit: Memo[Raw, Credits] = Memo(_notice_debit)
"""A notice's ``d`` field as Credits: a grant and its release or expiry carry the same debit,
and requests of one shape the same one, so most notices a relay reads parse none."""

_NOTICE_FIELDS = tuple((name.encode(), name) for name in ("k", "r", "d", "t", "p"))


def notice_from(node_id: str, entry_id: Raw, fields: Mapping[Raw, Raw]) -> Notice:
    """A notice stream entry as ``cf_notice`` wrote it (every grant and expiry makes one, and
    each agent stream's relay reads it); ``node_id`` is one the caller already checked (it
    named the stream's key). Fields are read by their raw names (bytes or str replies alike),
    not through a decoded copy of the entry: the relay reads every grant and expiry."""
    k, r, d, t, p = (fields.get(raw, fields.get(name)) for raw, name in _NOTICE_FIELDS)
    return Notice(
        node_id=node_id,
        seq=int(text(entry_id).split("-", 1)[0]),
        kind=NoticeKind(text(k) if k is not None else ""),
        reservation_id=text(r) if r is not None else "",
        debit=notice_debit(d) if d is not None else Credits(),
        at_ms=int(t) if t is not None else 0,
        pulled_tokens=int(p) if p is not None else None,
    )


def entry_seq(entry_id: Raw) -> int:
    """The notice seq of a stream entry id (``<seq>-0``)."""
    if isinstance(entry_id, bytes):  # as replies carry it: no decoded copy (int() reads bytes)
        return int(entry_id.split(b"-", 1)[0])
    return int(entry_id.split("-", 1)[0])


_NOTICE_KINDS: dict[Raw, NoticeKind] = {
    raw: kind for kind in NoticeKind for raw in (kind.value, kind.value.encode())
}
"""A stored ``k`` field (bytes or str) -> its kind."""

notice_debit_memo: Memo[Raw, tuple[int, int, int, int, int]] = Memo(
    lambda stored: notice_debit(stored).as_tuple()
)
"""A notice's ``d`` field as its amounts, validated as the Notice's debit is (a node's grants
repeat a few debits)."""


_new_row: Callable[[type[NoticeRow], tuple[Any, ...]], NoticeRow] = tuple.__new__
"""``NoticeRow(*values)`` without the named tuple's own ``__new__`` (a Python call per row)."""


def notice_rows(node_id: str, entries: Sequence[tuple[Raw, Mapping[Raw, Raw]]]) -> list[NoticeRow]:
    """Notice stream entries as the relay's rows, value for value what ``NoticeRow.of(
    notice_from(...))`` makes, without the Notice in between: the relay of every grant and
    expiry to its agent was a sixth of a busy broker's CPU (issue 13). An entry that is not
    plainly valid (an unknown kind, pulled tokens out of range) takes that slow path, which
    refuses it as before."""
    rows: list[NoticeRow] = []
    kinds = _NOTICE_KINDS
    for entry_id, fields in entries:
        get = fields.get  # read field by field: a generator per entry cost more than its reads
        k = get(b"k")
        if k is not None:  # redis-py returns one key type per reply (bytes, or str decoded)
            r, d, t, p = get(b"r"), get(b"d"), get(b"t"), get(b"p")
        else:
            k, r, d, t, p = get("k"), get("r"), get("d"), get("t"), get("p")
        kind = kinds.get(k) if k is not None else None
        pulled = int(p) if p is not None else None
        if kind is None or (pulled is not None and not 0 <= pulled <= MAX_TOKENS):
            rows.append(NoticeRow.of(notice_from(node_id, entry_id, fields)))
            continue
        row = (
            entry_seq(entry_id),
            kind,
            (r.decode() if isinstance(r, bytes) else r) if r is not None else "",
            notice_debit_memo(d) if d is not None else None,
            int(t) if t is not None else 0,
            pulled,
        )
        rows.append(_new_row(NoticeRow, row))
    return rows


def event_from(raw: Raw) -> NodeEvent:
    at_ms, kind, message = text(raw).split("|", 2)
    return NodeEvent(at_ms=int(at_ms), kind=kind, message=message)


def live_pool_loads(raw: Mapping[Raw, Raw], now_ms: int) -> list[StoredPoolLoad]:
    """The unexpired reports of one pool hash, sorted by reporting node."""
    stored = [stored_pool_load(v) for v in raw.values()]
    return sorted((s for s in stored if s.expires_at_ms > now_ms), key=lambda s: s.load.node_id)


def stored_pool_load(raw: Raw) -> StoredPoolLoad:
    """One stored report. Fields this version does not know (a newer broker replica stored the
    report during a rolling upgrade) are set aside, so older replicas keep reading the pool's
    load from the fields they know rather than failing every read of it; a bad value of a
    known field is still refused."""
    try:
        return StoredPoolLoad.model_validate_json(raw)
    except ValidationError as exc:
        if not any(e["type"] == "extra_forbidden" for e in exc.errors()):
            raise
    data, _ = known_fields(StoredPoolLoad, json.loads(raw))
    if isinstance(data.get("load"), dict):
        data["load"], _ = known_fields(PoolLoad, data["load"])
    return StoredPoolLoad.model_validate(data)


def flat_pairs(values: Sequence[Raw]) -> dict[str, str]:
    """A flat ``[k1, v1, k2, v2, ...]`` reply (HGETALL inside Lua) as a dict."""
    return {text(values[i]): text(values[i + 1]) for i in range(0, len(values) - 1, 2)}
