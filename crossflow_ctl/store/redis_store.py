"""The Redis store: production state shared by every broker replica (DESIGN.md §3, §6).

Every per-node change (lease upsert, check-and-debit, commit, release, cordon, delete) is one
Lua script (``lua/*.lua``, EVALSHA with NOSCRIPT fallback) that also appends the node's notice
to its stream (and PUBLISHes a wake) in the same atomic step, so notices and state never
disagree.

Redis Cluster: a node's keys share the hash tag ``{<ns>:n:<node>}`` (:mod:`.keys`), so each
script touches one slot and only keys passed in KEYS; the node and lender indexes are split into
hash-tagged buckets (:mod:`.redis_index`) written by plain commands, never inside a per-node
script on a Cluster (on a standalone Redis, where no slot rule applies, ``upsert_leases`` also
writes the lender index); no MULTI spans slots (pipelines are non-transactional, split per
master by redis-py).
The cluster-wide borrowing limit is the ``share`` factor inside each node's own check.

Round trips: ``try_debit``, ``commit``, ``release`` one each (``try_debits``: one for a whole
batch, one script call per node, pipelined); ``admission_view`` none when warm: the pool's
reports, a working set drawn from the lender index and its nodes' states are reused for up to
``cache_max_age_ms`` by each replica and renewed in the background before then
(:mod:`.redis_view`, :mod:`.redis_cache`: fails closed when stale, never caches absence); each
debit's reply and each lease this replica stores refresh the node's entry in place, so a warm
Admit is the debit's one round trip. Flat in fleet size. Leases arriving together share
``upsert_leases`` calls (16 leases of one slot each) in one pipeline, which on a standalone
Redis also update the lender index (on a Cluster, one more pipeline does: :mod:`.redis_ingest`);
waiting notice reads cost nothing until a wake (:mod:`.redis_notices`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import structlog
from redis.asyncio import Redis, RedisCluster
from redis.crc import key_slot
from redis.exceptions import AuthenticationError, RedisError, ResponseError

from crossflow_ctl.api.v1 import lease_pb2
from crossflow_ctl.domain.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    StoreAuthFailed,
    StoreUnavailable,
)
from crossflow_ctl.domain.models import (
    Credits,
    Lease,
    NodeInfo,
    NodeRole,
    NodeState,
    Notice,
    PoolLoad,
    PoolSnapshot,
    Reservation,
    Share,
    StoredLease,
    StoredPoolLoad,
    is_node_id,
    validated,
)
from crossflow_ctl.domain.online_calibration import StepModelReport
from crossflow_ctl.domain.policy import VersionedPolicy
from crossflow_ctl.store import redis_codec as codec
from crossflow_ctl.store.base import (
    REPLY_LOST,
    DebitOutcome,
    DebitRequest,
    LeaseOutcome,
    NodeEvent,
    Store,
    check_identity,
    owner_arg,
)
from crossflow_ctl.store.keys import (
    EVENTS_CAP,
    HISTORY_CAP,
    NOTICES_CAP,
    Keys,
    node_of_reservation,
)
from crossflow_ctl.store.redis_admin import RedisAdmin
from crossflow_ctl.store.redis_connect import RedisConnection, connect, error_text
from crossflow_ctl.store.redis_debit import (
    UNKNOWN_NODE,
    DebitCall,
    refresh_cache,
    script_calls,
)
from crossflow_ctl.store.redis_index import NodeIndex
from crossflow_ctl.store.redis_ingest import LeaseIngest
from crossflow_ctl.store.redis_notices import NoticeReader
from crossflow_ctl.store.redis_records import RedisRecords
from crossflow_ctl.store.redis_scripts import LOST_REPLY, DedicatedLine, Scripts
from crossflow_ctl.store.redis_view import AdmissionView

log = structlog.get_logger()

LOST = DebitOutcome(granted=False, refusal=REPLY_LOST)
"""A late debit's outcome when its reply was lost (``DedicatedLine``)."""

DEFAULT_CACHE_MAX_AGE_MS = 50
"""A quarter of the agents' default 200 ms period: the staleness a cached pool read adds."""
DEFAULT_MAX_CONNECTIONS = 16
"""Connections one store opens to Redis (per Cluster node), whatever the number of agents
(the broker's ``redis_max_connections``)."""


def _failure(what: str, exc: BaseException) -> StoreAuthFailed | StoreUnavailable:
    """The domain error for a failed Redis call (logged when the store is unavailable)."""
    if isinstance(exc, AuthenticationError) or (
        isinstance(exc, ResponseError) and str(exc).startswith(("NOAUTH", "WRONGPASS", "NOPERM"))
    ):
        return StoreAuthFailed(f"redis refused the credentials: {exc}")
    log.warning("store_unavailable", op=what, error=error_text(exc))
    return StoreUnavailable(f"redis {what} failed: {error_text(exc)}")


class RedisStore(Store):
    """``client``: a ``redis.asyncio.Redis`` or ``RedisCluster`` (not closed by :meth:`close`),
    or a URL (owned; ``cluster=True`` connects to a Redis Cluster through it).

    A URL gets socket timeouts of ``socket_timeout_s``, no client-side retries and at most
    ``max_connections`` connections (per Cluster node); callers wait for a free one up to
    ``op_timeout_s`` (on a Cluster, for one of ``max_connections - 1`` calls in flight at once,
    whatever their nodes: redis-py's cluster client would fail them at once, see
    :mod:`.redis_cluster`); a supplied client keeps its own settings (give it timeouts, and no retry
    on timeout, for the same guarantees). Every call is also bounded by ``op_timeout_s`` as a
    whole, except the debit (:meth:`try_debits`, the admission hot path): its caller's
    deadline bounds it (``admit_timeout_ms``), and the socket timeouts otherwise. Notices wait
    on one pub/sub subscription per store (:mod:`crossflow_ctl.store.redis_notices`), so the
    connection count does not grow with the number of agent streams. The key layout and
    scripts are slot-safe (module docstring); the store contract suite
    (``tests/store/test_contract.py`` and the others on the ``store`` fixture of
    ``tests/store/conftest.py``) runs on a real 3-master cluster too.

    ``cache_max_age_ms`` bounds how long this replica reuses a pool's load reports and a draw
    from the lender index on the admission path (:mod:`crossflow_ctl.store.redis_cache`; 0
    turns both caches off)."""

    def __init__(
        self,
        client: Redis | RedisCluster | str,
        namespace: str = "cf",
        *,
        socket_timeout_s: float = 1.0,
        op_timeout_s: float = 3.0,
        cache_max_age_ms: int = DEFAULT_CACHE_MAX_AGE_MS,
        connection: RedisConnection | None = None,
        cluster: bool = False,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        if isinstance(client, str):
            client = connect(
                client,
                connection or RedisConnection(),
                socket_timeout_s,
                client_name=f"crossflow:{namespace}",  # CLIENT LIST shows whose they are
                cluster=cluster,
                max_connections=max_connections,
                pool_timeout_s=op_timeout_s,
            )
            self._owned = True
        else:
            self._owned = False
        self._r: Redis | RedisCluster = client
        self.folds_request_records = not isinstance(client, RedisCluster)
        """Standalone Redis: a record and a node's keys may meet in one script (one round
        trip for a BORROW with a request id); on a Cluster they lie in different slots."""
        self._k = Keys(namespace)
        self._op_timeout_s = op_timeout_s
        self._scripts = Scripts(client)
        self._debit_line = (
            DedicatedLine(client, self._scripts, "try_debit") if isinstance(client, Redis) else None
        )
        self._index = NodeIndex(client, self._k, self._scripts)
        self._node_views = codec.NodeViews()
        self._view = AdmissionView(
            self._k, self._index, self._views, self._backend, cache_max_age_ms, op_timeout_s
        )
        self._pools, self._lenders, self._node_cache = self._view.caches
        self._notices = NoticeReader(client, self._k, self._backend, op_timeout_s)
        cluster_client = isinstance(client, RedisCluster)
        slot = (lambda key: key_slot(key.encode())) if cluster_client else None
        self._ingest = LeaseIngest(
            self._k,
            self._scripts,
            self._lenders.changed,
            # Standalone: upsert_leases writes the lender index itself (no pipeline of ZADDs
            # after each batch); a Cluster's index buckets lie in other slots than the nodes.
            self._write_lenders if cluster_client else None,
            self._node_cache,
            slot,
            timeout_s=op_timeout_s,
        )
        self._admin = RedisAdmin(client, self._k, self._scripts, self._index, self._forget)
        self._records = RedisRecords(client, self._k, self._scripts, self._backend)

    @contextlib.asynccontextmanager
    async def _backend(self, what: str, extra_s: float = 0.0) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self._op_timeout_s + extra_s):
                yield
        except (RedisError, OSError, TimeoutError) as exc:
            raise _failure(what, exc) from None

    async def _index_lenders(self, changes: dict[str, int | None]) -> None:
        """Add (lease expiry) or drop (None) lenders, best effort; this replica's lender draw
        follows at once (:meth:`LenderSample.changed`).

        The index only steers sampling (admission re-checks the node's real state, and entries
        leave by score once their lease expires), so a failure here must not turn a change
        that is already stored into an error for the caller."""
        self._lenders.changed(changes)
        await self._write_lenders(changes)

    async def _write_lenders(self, changes: dict[str, int | None]) -> None:
        """The lender index part of :meth:`_index_lenders` (best effort, logged)."""
        try:
            async with asyncio.timeout(self._op_timeout_s):
                await self._index.set_lenders(changes)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("lender_index_update_failed", nodes=len(changes), error=error_text(exc))

    def _forget(self, node_id: str) -> None:
        """A node was deleted: this replica's caches must not vouch for it."""
        self._notices.forget(node_id)
        self._node_cache.drop(node_id)
        self._lenders.drop()

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
            if (state := self._node_views.state(node_id, raw)) is not None
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
            args = [role.value, pool, json.dumps(labels), now_ms]
            out = await self._run("register_node", [k.info], args)
            if codec.text(out[0]) == "identity":
                stored = NodeInfo.model_construct(
                    node_id=node_id, role=NodeRole(codec.text(out[1])), pool=codec.text(out[2])
                )
                check_identity(stored, role, pool)
            pipe = self._r.pipeline(transaction=False)
            self._index.queue_add(pipe, node_id)
            await pipe.execute()
        self._notices.remember(node_id)
        return codec.info_from(node_id, codec.flat_pairs(out[1]))

    async def upsert_lease(self, lease: Lease, now_ms: int, max_ttl_ms: int) -> LeaseOutcome:
        try:  # bounded by the ingest's own per-batch deadline (no timer per lease)
            out = await self._ingest.upsert(lease, now_ms, max_ttl_ms)
        except (RedisError, OSError, TimeoutError) as exc:
            raise _failure("upsert_lease", exc) from None
        if int(out[0]) == -1:
            raise FailedPrecondition(f"node {lease.node_id!r} is not registered", field="node_id")
        return LeaseOutcome.trusted(  # integers from the script, one reply a lease: unchecked
            accepted=int(out[0]) == 1,
            stored_epoch=int(out[1]),
            stored_version=int(out[2]),
            purged_reservations=int(out[3]),
        )

    async def put_pool_load(self, load: PoolLoad, now_ms: int, max_ttl_ms: int) -> bool:
        expires = now_ms + min(load.ttl_ms, max_ttl_ms)
        stored = StoredPoolLoad(load=load, received_at_ms=now_ms, expires_at_ms=expires)
        # The script adds the sequence. A report without a wait in time is written as before it
        # existed, so older replicas still read it (docs/upgrading.md).
        report = stored.model_dump_json(exclude={"seq"}, exclude_none=True)
        pool = load.pool
        keys = [self._k.pool(pool), self._k.pool_expiries(pool), self._k.pool_seq(pool)]
        args: list[str | int] = [now_ms, load.node_id, report, expires]
        async with self._backend("put_pool_load"):
            await self._scripts.run_with(
                "put_pool_load", keys, args, ("SADD", self._k.pools, load.pool)
            )
            registered = await self._run("touch_node", [self._k.node(load.node_id).info], [now_ms])
        self._pools.drop(load.pool)
        return bool(int(registered))

    async def put_step_model(self, node_id: str, report: StepModelReport) -> bool:
        info = self._k.node(node_id).info
        async with self._backend("put_step_model"):
            out = await self._run("put_step_model", [info], [report.model_dump_json()])
        return bool(int(out))

    async def step_model(self, node_id: str) -> StepModelReport | None:
        async with self._backend("read_list"):
            raw = await self._admin.node_field(node_id, "stepmodel")
        if raw is None:
            return None
        try:
            return StepModelReport.model_validate_json(raw)
        except ValueError as exc:
            raise StoreUnavailable(f"stored step model is corrupt: {exc}") from None

    # -- admission --------------------------------------------------------------------------
    async def admission_view(
        self, pool: str, node_ids: Sequence[str], sample: int, now_ms: int
    ) -> tuple[PoolSnapshot | None, list[NodeState]]:
        return await self._view.read(pool, node_ids, sample, now_ms)

    async def try_debit(
        self,
        node_id: str,
        debit: Credits,
        share: Share,
        now_ms: int,
        hold_ttl_ms: int,
        request_id: str = "",
        owner: str = "",
        compute_us: int = 0,
        pulled_tokens: int | None = None,
    ) -> DebitOutcome:
        request = DebitRequest(
            node_id, debit, request_id, owner, compute_us=compute_us, pulled_tokens=pulled_tokens
        )
        return (await self.try_debits((request,), share, now_ms, hold_ttl_ms))[0]

    async def try_debits(
        self, debits: Sequence[DebitRequest], share: Share, now_ms: int, hold_ttl_ms: int
    ) -> list[DebitOutcome]:
        """ONE script call per node, all of them in ONE round trip (pipelined when several)."""
        return await self._debit(debits, share, now_ms, hold_ttl_ms, None)

    async def try_debits_settled(
        self,
        debits: Sequence[DebitRequest],
        share: Share,
        now_ms: int,
        hold_ttl_ms: int,
        late: Callable[[list[DebitOutcome]], None],
    ) -> list[DebitOutcome]:
        """``Store.try_debits_settled`` in the caller's own task on a standalone Redis (the
        dedicated connection reads what a cancelled caller left and hands it to ``late``: no
        task per debit round); as the base class does on a Cluster."""
        if self._debit_line is None:
            return await super().try_debits_settled(debits, share, now_ms, hold_ttl_ms, late)
        return await self._debit(debits, share, now_ms, hold_ttl_ms, late)

    async def _debit(
        self,
        debits: Sequence[DebitRequest],
        share: Share,
        now_ms: int,
        hold_ttl_ms: int,
        late: Callable[[list[DebitOutcome]], None] | None,
    ) -> list[DebitOutcome]:
        self.check_debits(debits, share, hold_ttl_ms)
        wellformed = _wellformed_node_ids(debits)
        known = [d for d in debits if wellformed[d.node_id]]
        calls = DebitCall.build_all(known, now_ms, hold_ttl_ms)
        groups = script_calls(self._k, calls, share)

        def outcomes(replies: Sequence[Any]) -> list[DebitOutcome]:
            """Each debit's outcome (a call that failed or never went out: unknown_node; one
            whose late reply was lost: ``REPLY_LOST``)."""
            by_call: list[DebitOutcome] = [UNKNOWN_NODE] * len(calls)
            for group, reply in zip(groups, replies, strict=True):
                if not isinstance(reply, list):
                    _mark_lost(by_call, group.positions, reply)
                    continue
                for position, item in zip(group.positions, reply, strict=True):
                    by_call[position] = calls[position].outcome(item)
                node_id = calls[group.positions[0]].node_id
                refresh_cache(self._node_cache, node_id, reply[-1], now_ms)
            if len(known) == len(debits):
                return by_call
            found = iter(by_call)
            return [next(found) if wellformed[d.node_id] else UNKNOWN_NODE for d in debits]

        script_args = [(g.keys, g.args) for g in groups]
        # no timeout of its own: the admission deadline (or the socket timeouts) bound it
        try:
            if not groups:
                replies: list[Any] = []
            elif self._debit_line is not None:
                hand_over = None if late is None else (lambda got: late(outcomes(got)))
                replies = await self._debit_line.run_each(script_args, hand_over)
                failed = next((r for r in replies if isinstance(r, Exception)), None)
                if failed is not None:
                    if late is not None:  # the other nodes' calls may have granted: released
                        late(outcomes(replies))
                    raise failed
            elif len(groups) == 1:
                replies = [await self._run("try_debit", *script_args[0])]
            else:
                replies = await self._scripts.run_many("try_debit", script_args)
        except (RedisError, OSError, TimeoutError) as exc:
            raise _failure("try_debit", exc) from None
        return outcomes(replies)

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
        self._node_cache.drop(node_id)
        await self._index_lenders({node_id: int(lease_exp) if lends else None})
        return codec.info_from(node_id, codec.flat_pairs(out[1]))

    async def delete_node(self, node_id: str, force: bool, now_ms: int) -> int:
        async with self._backend("delete_node"):
            return await self._admin.delete_node(node_id, force, now_ms)

    async def expire_nodes(self, idle_ms: int, now_ms: int) -> list[str]:
        async with self._backend("expire_nodes"):
            return await self._admin.expire_nodes(idle_ms, now_ms)

    async def _node_ids(self) -> list[str]:
        return await self._index.node_ids()

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
        async with self._backend("list_reservations"):
            return await self._admin.list_reservations(node_id, now_ms)

    async def list_pools(self, now_ms: int) -> list[PoolSnapshot]:
        async with self._backend("list_pools"):
            return await self._admin.list_pools(now_ms)

    async def lease_history(self, node_id: str, limit: int) -> list[StoredLease]:
        # The list may hold a few more than the cap (upsert_leases.lua trims it in steps).
        async with self._backend("read_list"):
            items = await self._admin.node_list(node_id, "history", min(limit, HISTORY_CAP))
        return [codec.stored_lease_from_packed(i) for i in items]

    async def node_events(self, node_id: str, limit: int) -> list[NodeEvent]:
        async with self._backend("read_list"):
            items = await self._admin.node_list(node_id, "events", limit)
        return [codec.event_from(i) for i in items]

    # -- notices ----------------------------------------------------------------------------
    async def read_notices(
        self, node_id: str, after_seq: int, limit: int, block_ms: int = 0
    ) -> list[Notice]:
        if not is_node_id(node_id):
            raise NotFound(f"unknown node {node_id!r}", field="node_id")
        if limit <= 0:
            return []
        return await self._notices.read(node_id, after_seq, limit, block_ms)

    async def read_notice_batch(
        self, node_id: str, after_seq: int, limit: int, block_ms: int = 0
    ) -> lease_pb2.NoticeBatch:
        if not is_node_id(node_id):
            raise NotFound(f"unknown node {node_id!r}", field="node_id")
        batch = lease_pb2.NoticeBatch()
        if limit > 0:
            entries = await self._notices.read_entries(node_id, after_seq, limit, block_ms)
            codec.notice_entries_to_proto(node_id, entries, batch)
        return batch

    # -- policy -----------------------------------------------------------------------------
    async def get_policy(self) -> VersionedPolicy | None:
        return await self._records.get_policy()

    async def set_policy(self, policy: VersionedPolicy, expected_version: int) -> None:
        await self._records.set_policy(policy, expected_version)

    # -- request records (crossflow_ctl.store.redis_records) ----------------------------------
    async def read_request(self, key: str) -> str | None:
        return await self._records.read_request(key)

    async def record_request(self, key: str, outcome: str, ttl_ms: int) -> str | None:
        return await self._records.record_request(key, outcome, ttl_ms)

    async def forget_request(self, key: str, reservation_id: str) -> None:
        await self._records.forget_request(key, reservation_id)

    # -- lifecycle --------------------------------------------------------------------------
    async def ping(self) -> None:
        async with self._backend("ping"):
            await self._r.ping()

    async def settle(self, timeout_s: float) -> None:
        """The dedicated line's late reads (standalone Redis), then the debits run in tasks
        of their own (Redis Cluster, and rounds that do not take the line), in one timeout."""
        deadline = time.monotonic() + timeout_s
        if self._debit_line is not None:
            await self._debit_line.settle(timeout_s)
        await super().settle(max(0.0, deadline - time.monotonic()))

    async def close(self) -> None:
        if self._debit_line is not None:
            await self._debit_line.close()
        await self._view.close()
        await self._ingest.close()
        await self._notices.close()
        if self._owned:
            with contextlib.suppress(RedisError, OSError):
                if isinstance(self._r, Redis):  # its pool was built here, so close it too
                    await self._r.aclose(close_connection_pool=True)
                else:
                    await self._r.aclose()


def _wellformed_node_ids(debits: Sequence[DebitRequest]) -> dict[str, bool]:
    """Whether each node id of a batch is well formed (``is_node_id``), checked once per node
    (a batch's debits share few nodes)."""
    out: dict[str, bool] = {}
    for d in debits:
        if d.node_id not in out:
            out[d.node_id] = is_node_id(d.node_id)
    return out


def _mark_lost(by_call: list[DebitOutcome], positions: Sequence[int], reply: object) -> None:
    """The outcomes of a call that gave no script reply: ``LOST`` when its late reply was lost
    (the call may have debited), else they stay unknown_node (it failed or never went out)."""
    if reply is LOST_REPLY:
        for position in positions:
            by_call[position] = LOST
