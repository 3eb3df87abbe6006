"""Coalescing one script's calls into pipelines: lease ingest at fleet scale (issue #11).

Every agent sends a lease every period (200 ms by default), so one replica serving 5,000 agents
takes about 25,000 upserts a second. One EVALSHA round trip each left the event loop waiting on
the network most of the time (550-800 leases/s measured on 8 streams). :class:`Coalescer`
gathers the calls made while a pipeline is in flight (and those ready in the same loop turn)
and sends them as the next pipeline, so a replica makes at most one round trip per batch per
shard. Within a batch, the leases of one Cluster slot (all of them on a plain Redis) go 16 to an
``upsert_leases`` call: one EVALSHA with one packed argument per lease instead of one EVALSHA
with ~60 arguments each, which was most of the broker's CPU per lease. Each caller still gets
its own reply or its own error (the script catches a failing lease's error and goes on): the
monotonic (epoch, version) check stays inside the script, per lease, atomic. A batch has one
deadline timer, not one per lease (:class:`Coalescer`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from operator import ne
from typing import Any, NamedTuple

from redis.exceptions import ResponseError

from crossflow_ctl.domain.models import Lease
from crossflow_ctl.store import redis_codec as codec
from crossflow_ctl.store.coalescer import Coalescer
from crossflow_ctl.store.keys import EVENTS_CAP, HISTORY_CAP, NOTICES_CAP, Keys
from crossflow_ctl.store.redis_cache import NodeCache
from crossflow_ctl.store.redis_scripts import Scripts

_SCRIPT_HEAD = tuple(
    str(v).encode() for v in (HISTORY_CAP, EVENTS_CAP, NOTICES_CAP, codec.LEASE_FIELD_NAMES)
)
"""``upsert_leases``' first four arguments, the same for every call (encoded once); the fifth,
keys per lease, is the store's."""

LEASES_PER_SCRIPT = 16
"""Leases per ``upsert_leases`` call: one call runs them back to back inside Redis (about 1 ms
for 16), so debits queued behind it wait no longer than behind a few pipelined commands."""

WRITTEN_CAPACITY = 1 << 14
"""Nodes whose last written lease a replica keeps (:class:`LeaseIngest`: about 2 KB each); when
full it starts over (each node's next lease is then written whole; a replica streaming more
nodes than this round-robin writes every lease whole: correct, only without the saving)."""
_RECV = list(codec.LEASE_FIELDS).index("recv")


class UpsertCall(NamedTuple):
    keys: tuple[bytes, ...]
    """The node's seven keys, in the script's order, and on a standalone Redis its lender index
    bucket (encoded once per node, not per lease)."""
    slot: int
    """The node's Cluster hash slot (0 on a plain Redis): calls of one slot share a script."""
    values: tuple[str, ...]
    """The lease hash's values (:func:`.redis_codec.lease_hash_values`)."""
    packed: str
    """The lease hash's values as one argument (:func:`.redis_codec.packed_lease_values`): the
    lease's one serialized form, stored as the hash and as the history entry."""
    lease: Lease
    received_at_ms: int
    expires_at_ms: int
    lends: bool
    """Whether the lease lends (if accepted and not cordoned: in the lender index)."""


class LeaseIngest:
    """``upsert_lease`` calls of one store, coalesced into ``upsert_leases`` calls (one per
    ``LEASES_PER_SCRIPT`` leases of one slot, all in one pipeline); each stored lease also
    refreshes ``cache`` in place, and the batch's lender changes go to ``lenders_changed`` (this
    replica's draw) and to ``index_lenders`` (the lender index: one pipeline a batch) when it is
    given; None when the script updates the index itself (a plain Redis, where one script may
    name the node's keys and its index bucket). ``slot``: a node's Cluster hash slot, None on a
    plain Redis; ``timeout_s``: the :class:`Coalescer`'s bound on each caller's wait.

    Most of a lease's fields repeat the node's last lease (its model's constants, credits that
    did not move), and each field the script writes costs Redis about as much as the rest of
    the lease's work. So the ingest remembers the values of the last lease it sent for each
    node and marks which of the next one's differ; the script writes only those when the
    node's hash still holds that last lease (its ``ev`` and ``recv``, which no other lease
    shares) and the whole lease otherwise: a lease another replica stored meanwhile, or one of
    ours that failed or went stale, costs one whole write, never a wrong field."""

    def __init__(
        self,
        keys: Keys,
        scripts: Scripts,
        lenders_changed: Callable[[dict[str, int | None]], None],
        index_lenders: Callable[[dict[str, int | None]], Awaitable[None]] | None,
        cache: NodeCache,
        slot: Callable[[str], int] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self._scripts = scripts
        self._lenders_changed = lenders_changed
        self._index_lenders = index_lenders
        self._cache = cache
        self._coalescer: Coalescer[UpsertCall] = Coalescer(self._batch, timeout_s=timeout_s)
        folded = index_lenders is None
        self._head = (*_SCRIPT_HEAD, b"8" if folded else b"7")

        def node_keys(node_id: str) -> tuple[tuple[bytes, ...], int]:
            k = keys.node(node_id)
            flat = [k.info, k.lease, k.reservations, k.notices, k.history, k.events, k.expiries]
            if folded:
                flat.append(keys.lenders(keys.bucket(node_id)))
            return tuple(key.encode() for key in flat), 0 if slot is None else slot(k.info)

        self._node_keys = codec.Memo(node_keys, capacity=1 << 16)
        self._written: dict[str, tuple[str, ...]] = {}
        """Each node's last lease sent (its hash values), as if stored: a call that is not
        stored drops it (if still the last), and the script checks it before relying on it."""

    @property
    def batches(self) -> int:
        return self._coalescer.batches

    def upsert(self, lease: Lease, now_ms: int, max_ttl_ms: int) -> asyncio.Future[Any]:
        """The future of the ``upsert_leases`` script's reply for ``lease`` (see the script's
        header). Not a coroutine: the lease is queued at once, the caller awaits the reply."""
        keys, slot = self._node_keys(lease.node_id)
        expires = now_ms + min(lease.ttl_ms, max_ttl_ms)
        values = codec.lease_hash_values(lease, now_ms, expires)
        call = UpsertCall(
            keys=keys,
            slot=slot,
            values=values,
            packed=codec.packed_lease_values(values),
            lease=lease,
            received_at_ms=now_ms,
            expires_at_ms=expires,
            lends=not values[codec.ZERO_FIELD],  # '' when the lease lends
        )
        return self._coalescer.submit(call)

    async def _batch(self, calls: Sequence[UpsertCall]) -> list[Any]:
        """The leases that arrived together: ``upsert_leases`` calls (each lease still checked
        and stored on its own) in one pipeline, then (on a Cluster) one lender index update."""
        by_slot: dict[int, list[int]] = {}
        for i, call in enumerate(calls):
            by_slot.setdefault(call.slot, []).append(i)
        chunks = [
            positions[start : start + LEASES_PER_SCRIPT]
            for positions in by_slot.values()
            for start in range(0, len(positions), LEASES_PER_SCRIPT)
        ]
        changed = [self._changed(call) for call in calls]  # in order: a node's later lease last
        script_calls = []
        for chunk in chunks:
            args: list[Any] = [*self._head]
            for i in chunk:
                args += (changed[i], calls[i].packed)
            script_calls.append(([key for i in chunk for key in calls[i].keys], args))
        replies = await self._scripts.run_each("upsert_leases", script_calls)
        out: list[Any] = [None] * len(calls)
        for chunk, reply in zip(chunks, replies, strict=True):
            for n, i in enumerate(chunk):
                out[i] = reply if isinstance(reply, BaseException) else _one(reply[n])
        changes: dict[str, int | None] = {}
        for call, one in zip(calls, out, strict=True):
            if isinstance(one, BaseException) or int(one[0]) != 1:
                if self._written.get(call.lease.node_id) is call.values:
                    del self._written[call.lease.node_id]  # not stored: the next is whole
            else:
                purged, cordoned = int(one[3]), bool(int(one[4]))
                self._cache.leased(
                    call.lease, call.received_at_ms, call.expires_at_ms, purged, cordoned
                )
                lends = call.lends and not cordoned
                changes[call.lease.node_id] = call.expires_at_ms if lends else None
        if changes:
            self._lenders_changed(changes)
            if self._index_lenders is not None:
                await self._index_lenders(changes)
        return out

    def _changed(self, call: UpsertCall) -> bytes:
        """The script's ``changed`` argument for ``call``: which values differ from the node's
        last lease sent, one byte each (1: changed), then that lease's ``ev`` and ``recv``; b""
        (write every field) when none is known. The call becomes the node's last lease."""
        node_id = call.lease.node_id
        last = self._written.get(node_id)
        if last is None and len(self._written) >= WRITTEN_CAPACITY:
            self._written.clear()
        self._written[node_id] = call.values
        if last is None:
            return b""
        return bytes(map(ne, call.values, last)) + (last[0] + last[_RECV]).encode()

    async def close(self) -> None:
        await self._coalescer.close()


def _one(reply: Any) -> Any:
    """One lease's reply, or the error the script caught for it (``{-2, error}``)."""
    if int(reply[0]) == -2:
        return ResponseError(codec.text(reply[1]))
    return reply
