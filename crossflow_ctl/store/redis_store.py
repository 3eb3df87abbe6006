"""The Redis store: production state shared by every broker replica (DESIGN.md §3, §6).

Every per-node change (lease upsert, check-and-debit, commit, release, cordon) is one Lua script
(``lua/*.lua``, EVALSHA with NOSCRIPT fallback) that also appends the node's notice to its
stream in the same atomic step, so notices and state never disagree.

Redis Cluster compatible by construction: a node's keys share the hash tag ``{<ns>:n:<node>}``
(see :mod:`crossflow_ctl.store.keys`), so each script touches one slot and only keys passed in
KEYS; the global keys (node index, lender index, pool index, policy) are only read or written by
plain commands, never inside a per-node script; a pool's reports have their own tag and script;
no MULTI spans slots (pipelines are non-transactional). The cluster-wide
borrowing limit is the ``share`` factor applied inside each node's own check (see
``PolicySettings.borrow_share``), so it needs no cross-slot operation.

Round trips: ``try_debit``, ``commit``, ``release`` one each; ``admission_view`` one (the
read-only ``node_view`` script per candidate, pipelined; a plain EVALSHA for one node), with the
pool's reports and a draw from the lender index reused for up to ``cache_max_age_ms`` by each
replica (:mod:`crossflow_ctl.store.redis_cache`: fails closed when stale, never caches absence);
on a cache miss the pool's reports join the same pipeline and a lender draw costs one more trip.
Flat in fleet size. Lease upsert and cordon two (the script, then the lender index, which is
only a sampling hint).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any

import structlog
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, RedisError, ResponseError

from crossflow_ctl.domain.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    StoreAuthFailed,
    StoreUnavailable,
)
from crossflow_ctl.domain.models import (
    CREDIT_NAMES,
    Credits,
    Lease,
    NodeInfo,
    NodeRole,
    NodeState,
    Notice,
    PoolLoad,
    PoolSnapshot,
    Reservation,
    ReservationState,
    StoredLease,
    StoredPoolLoad,
    validated,
)
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.store import redis_codec as codec
from crossflow_ctl.store.base import (
    DebitOutcome,
    LeaseOutcome,
    NodeEvent,
    Store,
    check_debit_args,
    owner_arg,
)
from crossflow_ctl.store.keys import (
    EVENTS_CAP,
    HISTORY_CAP,
    NOTICES_CAP,
    Keys,
    is_node_id,
    new_reservation_id,
    node_of_reservation,
)
from crossflow_ctl.store.redis_cache import LenderSample, PoolCache
from crossflow_ctl.store.redis_connect import RedisConnection, connect
from crossflow_ctl.store.redis_notices import NoticeReader
from crossflow_ctl.store.redis_scripts import Scripts

log = structlog.get_logger()

DEFAULT_CACHE_MAX_AGE_MS = 50
"""A quarter of the agents' default 200 ms period: the staleness a cached pool read adds."""
LENDER_DRAW = 64
"""Lenders drawn from the index per refresh; each admission samples its candidates among them."""


class RedisStore(Store):
    """``client``: a ``redis.asyncio.Redis`` (not closed by :meth:`close`) or a URL (owned).

    A URL gets socket timeouts of ``socket_timeout_s`` and no client-side retries; a supplied
    client keeps its own settings (give it timeouts, and no retry on timeout, for the same
    guarantees). The key layout and scripts are slot-safe for Redis Cluster (module docstring);
    running with a cluster client (``redis.asyncio.RedisCluster``) is not yet wired or tested.

    ``cache_max_age_ms`` bounds how long this replica reuses a pool's load reports and a draw
    from the lender index on the admission path (:mod:`crossflow_ctl.store.redis_cache`; 0
    turns both caches off)."""

    def __init__(
        self,
        client: Redis | str,
        namespace: str = "cf",
        *,
        socket_timeout_s: float = 1.0,
        op_timeout_s: float = 3.0,
        cache_max_age_ms: int = DEFAULT_CACHE_MAX_AGE_MS,
        connection: RedisConnection | None = None,
    ) -> None:
        if isinstance(client, str):
            client = connect(client, connection or RedisConnection(), socket_timeout_s)
            self._owned = True
        else:
            self._owned = False
        self._r: Redis = client
        self._k = Keys(namespace)
        self._op_timeout_s = op_timeout_s
        self._scripts = Scripts(client)
        self._pools = PoolCache(cache_max_age_ms)
        self._lenders = LenderSample(cache_max_age_ms)
        block_chunk_ms = max(1, int(socket_timeout_s * 250))  # 3/4 of the timeout as slack
        self._notices = NoticeReader(client, self._k, self._backend, block_chunk_ms)

    @contextlib.asynccontextmanager
    async def _backend(self, what: str, extra_s: float = 0.0) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self._op_timeout_s + extra_s):
                yield
        except AuthenticationError as exc:
            raise StoreAuthFailed(f"redis refused the credentials: {exc}") from None
        except ResponseError as exc:
            if str(exc).startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
                raise StoreAuthFailed(f"redis refused the credentials: {exc}") from None
            log.warning("store_unavailable", op=what, error=repr(exc))
            raise StoreUnavailable(f"redis {what} failed: {exc!r}") from None
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("store_unavailable", op=what, error=repr(exc))
            raise StoreUnavailable(f"redis {what} failed: {exc!r}") from None

    async def _index_lender(self, node_id: str, lease_expires_ms: int | None) -> None:
        """Add or drop ``node_id`` in the lender index, best effort.

        The index only steers sampling (admission re-checks the node's real state, and entries
        leave by score once their lease expires), so a failure here must not turn a change
        that is already stored into an error for the caller."""
        self._lenders.drop()
        try:
            async with asyncio.timeout(self._op_timeout_s):
                if lease_expires_ms is None:
                    await self._r.zrem(self._k.lenders, node_id)
                else:
                    await self._r.zadd(self._k.lenders, {node_id: lease_expires_ms})
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("lender_index_update_failed", node_id=node_id, error=repr(exc))

    async def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return await self._scripts.run(name, keys, args)

    async def _views(
        self, node_ids: Sequence[str], now_ms: int, pool: str | None = None
    ) -> tuple[Any, list[NodeState]]:
        """One round trip: the pool's reports (when asked) and each node's ``node_view``."""
        before = [] if pool is None else [("HGETALL", self._k.pool(pool))]
        view_keys = [
            [k.info, k.lease, k.reservations, k.expiries] for k in map(self._k.node, node_ids)
        ]
        out = await self._scripts.views(before, view_keys, now_ms)
        views = out[len(before) :]
        states = [
            state
            for node_id, raw in zip(node_ids, views, strict=True)
            if (state := codec.node_state_from_view(node_id, raw)) is not None
        ]
        return (out[0] if pool is not None else None), states

    # -- agents -----------------------------------------------------------------------------
    async def register_node(
        self,
        node_id: str,
        role: NodeRole,
        pool: str,
        labels: dict[str, str],
        now_ms: int,
    ) -> NodeInfo:
        validated(NodeInfo, node_id=node_id, role=role, pool=pool, labels=dict(labels))
        k = self._k.node(node_id)
        async with self._backend("register_node"):
            pipe = self._r.pipeline(transaction=False)
            fields = ["role", role.value, "pool", pool, "labels", json.dumps(labels)]
            pipe.hset(k.info, items=list(fields))
            for name in ("cordoned", "cordon_reason", "seq"):
                pipe.hsetnx(k.info, name, "0" if name != "cordon_reason" else "")
            pipe.sadd(self._k.nodes, node_id)
            pipe.hgetall(k.info)
            out = await pipe.execute()
        self._notices.remember(node_id)
        return codec.info_from(node_id, codec.text_map(out[-1]))

    async def upsert_lease(self, lease: Lease, now_ms: int, max_ttl_ms: int) -> LeaseOutcome:
        k = self._k.node(lease.node_id)
        expires = now_ms + min(lease.ttl_ms, max_ttl_ms)
        stored = StoredLease(lease=lease, received_at_ms=now_ms, expires_at_ms=expires)
        zero = ""
        if lease.zero_reason is not None:
            zero = lease.zero_reason.value
        elif lease.credits.is_zero():
            zero = "no_capacity"
        args: list[Any] = [
            now_ms,
            f"{lease.epoch:020d}{lease.version:020d}",
            lease.epoch,
            lease.version,
            expires,
            zero,
            *lease.credits.as_tuple(),
            lease.last_notice_seq,
            stored.model_dump_json(),
            HISTORY_CAP,
            EVENTS_CAP,
            NOTICES_CAP,
        ]
        keys = [k.info, k.lease, k.reservations, k.notices, k.history, k.events, k.expiries]
        async with self._backend("upsert_lease"):
            out = await self._run("upsert_lease", keys, args)
        if int(out[0]) == 1:
            lends = not zero and not int(out[4])
            await self._index_lender(lease.node_id, expires if lends else None)
        if int(out[0]) == -1:
            raise FailedPrecondition(f"node {lease.node_id!r} is not registered", field="node_id")
        return LeaseOutcome(
            accepted=int(out[0]) == 1,
            stored_epoch=int(codec.text(out[1])),
            stored_version=int(codec.text(out[2])),
            purged_reservations=int(out[3]),
        )

    async def put_pool_load(self, load: PoolLoad, now_ms: int, max_ttl_ms: int) -> None:
        expires = now_ms + min(load.ttl_ms, max_ttl_ms)
        stored = StoredPoolLoad(load=load, received_at_ms=now_ms, expires_at_ms=expires)
        keys = [self._k.pool(load.pool), self._k.pool_expiries(load.pool)]
        args: list[str | int] = [now_ms, load.node_id, stored.model_dump_json(), expires]
        async with self._backend("put_pool_load"):
            pipe = self._r.pipeline(transaction=False)
            await self._scripts.queue("put_pool_load", keys, args, pipe)
            pipe.sadd(self._k.pools, load.pool)
            await pipe.execute()
        self._pools.drop(load.pool)

    # -- admission --------------------------------------------------------------------------
    async def admission_view(
        self, pool: str, node_ids: Sequence[str], sample: int, now_ms: int
    ) -> tuple[PoolSnapshot | None, list[NodeState]]:
        ids = [n for n in dict.fromkeys(node_ids) if is_node_id(n)]
        snapshot = self._pools.get(pool, now_ms)
        async with self._backend("admission_view"):
            if not node_ids and sample > 0:
                picked = self._lenders.pick(sample, now_ms)
                ids = picked if picked is not None else await self._draw_lenders(sample, now_ms)
            if snapshot is not None and not ids:
                return snapshot, []
            reports, states = await self._views(ids, now_ms, None if snapshot else pool)
        if snapshot is None:
            snapshot = self._pools.put(pool, codec.live_pool_loads(reports, now_ms), now_ms)
        return snapshot, states

    async def _draw_lenders(self, sample: int, now_ms: int) -> list[str]:
        """Drop expired lenders and draw up to LENDER_DRAW of them (one round trip), keep the
        draw for the next requests, and pick ``sample`` of the live ones."""
        pipe = self._r.pipeline(transaction=False)
        pipe.zremrangebyscore(self._k.lenders, "-inf", now_ms)
        pipe.zrandmember(self._k.lenders, max(sample, LENDER_DRAW), withscores=True)
        flat = (await pipe.execute())[1] or []
        members = [(codec.text(flat[i]), int(float(flat[i + 1]))) for i in range(0, len(flat), 2)]
        self._lenders.put(members, now_ms)
        return self._lenders.choose(members, sample, now_ms)

    async def try_debit(
        self,
        node_id: str,
        debit: Credits,
        share: float,
        now_ms: int,
        hold_ttl_ms: int,
        request_id: str = "",
        owner: str = "",
    ) -> DebitOutcome:
        check_debit_args(share, hold_ttl_ms, owner)
        if not is_node_id(node_id):
            return DebitOutcome(granted=False, refusal="unknown_node")
        k = self._k.node(node_id)
        rid = new_reservation_id(node_id, secrets.randbits(128))
        expires = now_ms + hold_ttl_ms
        args = [now_ms, repr(float(share)), expires, rid, request_id, *debit.as_tuple()]
        async with self._backend("try_debit"):
            out = await self._run(
                "try_debit",
                [k.info, k.lease, k.reservations, k.notices, k.expiries],
                [*args, NOTICES_CAP, owner],
            )
        status = codec.text(out[0])
        if status == "unknown_node":
            return DebitOutcome(granted=False, refusal=status)
        epoch, version = int(codec.text(out[1])), int(codec.text(out[2]))
        if status != "granted":
            short: tuple[str, ...] = ()
            if status == "short":
                short = tuple(CREDIT_NAMES[int(i) - 1] for i in codec.text(out[3]).split(","))
            return DebitOutcome(
                granted=False,
                refusal=status,
                short_credits=short,
                lease_epoch=epoch,
                lease_version=version,
            )
        # Every field is already valid (a checked node id, a validated debit, numbers this
        # store produced), so the grant skips re-validation on the admission path.
        res = Reservation.model_construct(
            reservation_id=rid,
            node_id=node_id,
            state=ReservationState.HELD,
            debit=debit,
            lease_epoch=epoch,
            lease_version=version,
            created_at_ms=now_ms,
            expires_at_ms=expires,
            grant_seq=int(out[3]),
            request_id=request_id,
            owner=owner,
        )
        return DebitOutcome.model_construct(
            granted=True, reservation=res, lease_epoch=epoch, lease_version=version
        )

    async def _change(self, name: str, reservation_id: str, args: list[Any]) -> Reservation:
        node_id = node_of_reservation(reservation_id)
        k = self._k.node(node_id)
        async with self._backend(name):
            out = await self._run(name, [k.info, k.reservations, k.notices, k.expiries], args)
        status = codec.text(out[0])
        if status == "not_found":
            raise NotFound(f"unknown reservation {reservation_id!r}", field="reservation_id")
        if status == "expired":
            raise NotFound(f"reservation {reservation_id!r} expired", field="reservation_id")
        if status == "not_owner":
            raise PermissionDenied(
                f"reservation {reservation_id!r} belongs to another router",
                field="reservation_id",
            )
        if status == "released":
            raise FailedPrecondition(
                f"reservation {reservation_id!r} was released", field="reservation_id"
            )
        return codec.reservation_from(reservation_id, node_id, out[1])

    async def commit(
        self, reservation_id: str, now_ms: int, commit_ttl_ms: int, owner: str | None = None
    ) -> Reservation:
        if commit_ttl_ms <= 0:
            raise InvalidArgument("commit_ttl_ms must be positive", field="commit_ttl_ms")
        args = [now_ms, reservation_id, now_ms + commit_ttl_ms, NOTICES_CAP, owner_arg(owner)]
        return await self._change("commit", reservation_id, args)

    async def release(
        self, reservation_id: str, now_ms: int, owner: str | None = None
    ) -> Reservation:
        args = [now_ms, reservation_id, NOTICES_CAP, owner_arg(owner)]
        return await self._change("release", reservation_id, args)

    # -- operators --------------------------------------------------------------------------
    async def set_cordon(self, node_id: str, cordoned: bool, reason: str, now_ms: int) -> NodeInfo:
        if not is_node_id(node_id):
            raise NotFound(f"unknown node {node_id!r}", field="node_id")
        k = self._k.node(node_id)
        args = [now_ms, "1" if cordoned else "0", reason, NOTICES_CAP, EVENTS_CAP]
        async with self._backend("set_cordon"):
            out = await self._run("set_cordon", [k.info, k.notices, k.events, k.lease], args)
        if codec.text(out[0]) == "not_found":
            raise NotFound(f"unknown node {node_id!r}", field="node_id")
        lease_exp, zero = codec.text(out[2]), codec.text(out[3])
        lends = not cordoned and lease_exp and not zero and int(lease_exp) > now_ms
        await self._index_lender(node_id, int(lease_exp) if lends else None)
        return codec.info_from(node_id, codec.flat_pairs(out[1]))

    async def _node_ids(self) -> list[str]:
        return sorted(codec.text(n) for n in await self._r.smembers(self._k.nodes))

    async def list_nodes(self, now_ms: int) -> list[NodeState]:
        async with self._backend("list_nodes"):
            _, states = await self._views(await self._node_ids(), now_ms)
        return states

    async def get_node(self, node_id: str, now_ms: int) -> NodeState:
        states: list[NodeState] = []
        if is_node_id(node_id):
            async with self._backend("get_node"):
                _, states = await self._views([node_id], now_ms)
        if not states:
            raise NotFound(f"unknown node {node_id!r}", field="node_id")
        return states[0]

    async def list_reservations(self, node_id: str | None, now_ms: int) -> list[Reservation]:
        if node_id is not None and not is_node_id(node_id):
            raise NotFound(f"unknown node {node_id!r}", field="node_id")
        async with self._backend("list_reservations"):
            ids = [node_id] if node_id is not None else await self._node_ids()
            pipe = self._r.pipeline(transaction=False)
            for n in ids:
                pipe.exists(self._k.node(n).info)
                pipe.hgetall(self._k.node(n).reservations)
            out = await pipe.execute()
        if node_id is not None and not out[0]:
            raise NotFound(f"unknown node {node_id!r}", field="node_id")
        found = [
            codec.reservation_from(codec.text(rid), n, rec)
            for n, raw in zip(ids, out[1::2], strict=True)
            for rid, rec in raw.items()
        ]
        return sorted(
            (r for r in found if r.expires_at_ms > now_ms),
            key=lambda r: (r.created_at_ms, r.node_id, r.grant_seq),
        )

    async def list_pools(self, now_ms: int) -> list[PoolSnapshot]:
        async with self._backend("list_pools"):
            pools = sorted(codec.text(p) for p in await self._r.smembers(self._k.pools))
            pipe = self._r.pipeline(transaction=False)
            for p in pools:
                pipe.hgetall(self._k.pool(p))
            out = await pipe.execute()
        return [
            PoolSnapshot(pool=p, reports=tuple(s.load for s in codec.live_pool_loads(raw, now_ms)))
            for p, raw in zip(pools, out, strict=True)
        ]

    async def _node_list(self, node_id: str, key: str, limit: int) -> list[Any]:
        if not is_node_id(node_id):
            raise NotFound(f"unknown node {node_id!r}", field="node_id")
        k = self._k.node(node_id)
        async with self._backend("read_list"):
            pipe = self._r.pipeline(transaction=False)
            pipe.exists(k.info)
            pipe.lrange(getattr(k, key), 0, max(0, limit) - 1)
            exists, items = await pipe.execute()
        if not exists:
            raise NotFound(f"unknown node {node_id!r}", field="node_id")
        return list(items) if limit > 0 else []

    async def lease_history(self, node_id: str, limit: int) -> list[StoredLease]:
        items = await self._node_list(node_id, "history", limit)
        return [StoredLease.model_validate_json(i) for i in items]

    async def node_events(self, node_id: str, limit: int) -> list[NodeEvent]:
        return [codec.event_from(i) for i in await self._node_list(node_id, "events", limit)]

    # -- notices ----------------------------------------------------------------------------
    async def read_notices(
        self, node_id: str, after_seq: int, limit: int, block_ms: int = 0
    ) -> list[Notice]:
        if not is_node_id(node_id):
            raise NotFound(f"unknown node {node_id!r}", field="node_id")
        if limit <= 0:
            return []
        return await self._notices.read(node_id, after_seq, limit, block_ms)

    # -- policy -----------------------------------------------------------------------------
    async def get_policy(self) -> PolicySettings | None:
        async with self._backend("get_policy"):
            raw = await self._r.get(self._k.policy)
        return PolicySettings.model_validate_json(raw) if raw else None

    async def set_policy(self, settings: PolicySettings) -> None:
        async with self._backend("set_policy"):
            await self._r.set(self._k.policy, settings.model_dump_json())

    # -- lifecycle --------------------------------------------------------------------------
    async def ping(self) -> None:
        async with self._backend("ping"):
            await self._r.ping()

    async def close(self) -> None:
        if self._owned:
            with contextlib.suppress(RedisError, OSError):
                await self._r.aclose()
