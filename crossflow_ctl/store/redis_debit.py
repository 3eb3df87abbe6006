"""The Redis store's check-and-debit: the ``try_debit`` script's calls and replies.

A batch's debits are grouped by node: ONE script call per node checks and debits all of them in
order, atomically (each sees the ones before it), and the calls for different nodes go out in
one pipeline (not a transaction: each node's call is atomic on its own, on its own slot).

Kept apart from :mod:`crossflow_ctl.store.redis_store` because it is the admission hot path:
nothing here validates what the store itself produced, and each reply refreshes the replica's
cached view of the node (:class:`crossflow_ctl.store.redis_cache.NodeCache`), so the next plan
needs no read of its own.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from crossflow_ctl.domain.models import (
    CREDIT_NAMES,
    Credits,
    Reservation,
    ReservationState,
    Share,
    Shares,
)
from crossflow_ctl.store import redis_codec as codec
from crossflow_ctl.store.base import DebitOutcome, DebitRequest, RequestRecord, grant_member
from crossflow_ctl.store.keys import NOTICES_CAP, Keys, new_reservation_id
from crossflow_ctl.store.redis_cache import NodeCache

UNKNOWN_NODE = DebitOutcome(granted=False, refusal="unknown_node")


class DebitCall(NamedTuple):
    """One debit of a ``try_debit`` script call, with what its reply needs to become a
    DebitOutcome. A NamedTuple, not a frozen dataclass: as immutable, and built in less than
    half the time (a frozen dataclass sets each field through ``object.__setattr__``), once
    per debit of every Admit."""

    node_id: str
    debit: Credits
    compute_us: int
    pulled_tokens: int | None
    request_id: str
    owner: str
    reservation_id: str
    now_ms: int
    expires_at_ms: int
    record: RequestRecord | None = None

    @classmethod
    def build_all(
        cls, requests: Sequence[DebitRequest], now_ms: int, hold_ttl_ms: int
    ) -> list[DebitCall]:
        """A call per debit, each with a new reservation id from 128 random bits of the
        system's source, read for the whole batch at once (one system call, not one each)."""
        raw = secrets.token_bytes(16 * len(requests))
        return [
            cls.build(r, now_ms, hold_ttl_ms, int.from_bytes(raw[16 * i : 16 * i + 16]))
            for i, r in enumerate(requests)
        ]

    @classmethod
    def build(cls, request: DebitRequest, now_ms: int, hold_ttl_ms: int, bits: int) -> DebitCall:
        """The call for ``request``; its reservation id from ``bits`` (128 random bits)."""
        return cls(  # positionally, in field order (named arguments cost more per debit)
            request.node_id,
            request.debit,
            request.compute_us,
            request.pulled_tokens,
            request.request_id,
            request.owner,
            new_reservation_id(request.node_id, bits),
            now_ms,
            now_ms + hold_ttl_ms,
            request.record,
        )

    def packed(self, key_index: int) -> str:
        """This debit as the script's ONE argument (``try_debit.lua``): a header of ids and
        numbers, then the free texts (request id, owner, the record's head and tail) told apart
        by their byte lengths in the header. ``key_index``: where its request record's key sits
        among the call's record keys (0: none). A grant records the head, the lease, the tail:
        the grant's reservation id and expiry first, then the payload's own members."""
        head = tail = ""
        ttl_ms = 0
        if self.record is not None:
            members = self.record.payload.strip()[1:]  # the payload object without its "{"
            head = f'{{{grant_member(self.reservation_id)},"expires_at_ms":{self.expires_at_ms},'
            tail = members if members.lstrip() == "}" else "," + members
            ttl_ms = self.record.ttl_ms
        d = self.debit
        pulled = "" if self.pulled_tokens is None else self.pulled_tokens
        return (
            f"{self.reservation_id},{d.compute_tokens},{d.kv_tokens},{d.kv_transfer_bytes},"
            f"{d.output_tokens},{d.slots},{self.compute_us},{pulled},{key_index},{ttl_ms},"
            f"{_size(self.request_id)},"
            f"{_size(self.owner)},{_size(head)}:{self.request_id}{self.owner}{head}{tail}"
        )

    def outcome(self, out: Any) -> DebitOutcome:
        """This debit's reply as a DebitOutcome."""
        if out[0] in _GRANTED:  # the common reply, read as it came (int() reads bytes too)
            return self._granted(int(out[1]), int(out[2]), int(out[3]))
        status = codec.text(out[0])
        if status == "unknown_node":
            return UNKNOWN_NODE
        epoch, version = int(codec.text(out[1])), int(codec.text(out[2]))
        if status == "recorded":
            return DebitOutcome(
                granted=False,
                refusal=status,
                lease_epoch=epoch,
                lease_version=version,
                recorded=codec.text(out[3]),
            )
        if status not in ("granted", "short"):
            return DebitOutcome(
                granted=False, refusal=status, lease_epoch=epoch, lease_version=version
            )
        if status == "short":
            short = tuple(CREDIT_NAMES[int(i) - 1] for i in codec.text(out[3]).split(","))
            return DebitOutcome(
                granted=False,
                refusal=status,
                short_credits=short,
                lease_epoch=epoch,
                lease_version=version,
            )
        return self._granted(epoch, version, int(out[3]))

    def _granted(self, epoch: int, version: int, grant_seq: int) -> DebitOutcome:
        """The outcome of this debit granted under lease ``epoch``/``version`` as the node's
        notice ``grant_seq``."""
        # Built without validation (``trusted``, every field in order: cheaper than the
        # validating constructors, which are cheaper than model_construct): the debit is this
        # call's own, the numbers the script's integers.
        res = Reservation.trusted(
            reservation_id=self.reservation_id,
            node_id=self.node_id,
            state=ReservationState.HELD,
            debit=self.debit,
            compute_us=self.compute_us,
            lease_epoch=epoch,
            lease_version=version,
            created_at_ms=self.now_ms,
            expires_at_ms=self.expires_at_ms,
            grant_seq=grant_seq,
            release_seq=0,
            request_id=self.request_id,
            owner=self.owner,
        )
        return DebitOutcome.grant(
            res, epoch, version, "" if self.record is None else self.record.key
        )


_GRANTED = frozenset((b"granted", "granted"))
"""A granted debit's status, as a reply may carry it (bytes, or str decoded)."""


@dataclass(frozen=True, slots=True)
class ScriptCall:
    """One ``try_debit`` script call: every debit of a batch on one node, in batch order."""

    keys: list[str]
    args: list[Any]
    positions: list[int]
    """Where each of its debits sits in the batch."""


def refresh_cache(cache: NodeCache, node_id: str, last: Any, now_ms: int) -> None:
    """Refresh the node's cached view from the LAST reply of its script call (the node's state
    after all of its debits), or drop it when the node refused before Safety."""
    status = codec.text(last[0])
    if status not in ("granted", "short", "recorded"):
        cache.drop(node_id)
        return
    totals = [int(v) for v in codec.text(last[4]).split(",")]
    cache.debited(node_id, int(codec.text(last[1])), int(codec.text(last[2])), totals, now_ms)


def _size(text: str) -> int:
    """``text``'s length in bytes as Redis receives it (UTF-8)."""
    return len(text) if text.isascii() else len(text.encode())


NODE_KEYS = 5
"""The node's own keys of a ``try_debit`` call; request record keys follow them."""


def packed_shares(share: Share) -> str:
    """The debit script's shares argument: each credit's share as exact float text (``repr``:
    Lua's ``tonumber`` reads back the same double), comma-separated in CREDIT_NAMES order."""
    return ",".join(repr(float(part)) for part in Shares.of(share))


def script_calls(keys: Keys, calls: Sequence[DebitCall], share: Share) -> list[ScriptCall]:
    """The batch grouped by node (one atomic script call per node), nodes in first-seen order;
    a debit's request record key joins its node's call's KEYS."""
    shares = packed_shares(share)
    by_node: dict[str, ScriptCall] = {}
    for position, call in enumerate(calls):
        group = by_node.get(call.node_id)
        if group is None:
            k = keys.node(call.node_id)
            group = by_node[call.node_id] = ScriptCall(
                keys=[k.info, k.lease, k.reservations, k.notices, k.expiries],
                args=[call.now_ms, shares, call.expires_at_ms, NOTICES_CAP],
                positions=[],
            )
        key_index = 0
        if call.record is not None:
            group.keys.append(keys.request(call.record.key))
            key_index = len(group.keys) - NODE_KEYS
        group.args.append(call.packed(key_index))
        group.positions.append(position)
    return list(by_node.values())
