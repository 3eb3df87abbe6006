"""The store interface every implementation honours, and the values it returns.

Semantics (both implementations, proved by tests/store/test_contract.py):

* ``upsert_lease`` refuses a lease whose (epoch, version) is not newer than the stored one and
  changes nothing (§5.1). An accepted lease replaces the old one (§5.2); its expiry is
  ``now_ms + min(ttl_ms, max_ttl_ms)`` on the broker's clock (§5.5). It purges reservations that
  have expired and RELEASED ones whose release notice the agent had seen when its snapshot was
  taken (``lease.last_notice_seq >= release_seq``, §5.4).
* ``try_debit`` checks, in one atomic step, that the node is known, not cordoned, has a live
  non-zero lease, and that ``lease.credits x share - open debits >= debit`` on every credit
  (``share``: one for every credit, or :class:`~crossflow_ctl.domain.models.Shares`),
  the open debits and the debit counted in the lease's unit (:mod:`crossflow_ctl.domain.safety`:
  timed compute debits by their node time at the lease's rate); then records a HELD
  reservation (with its ``compute_us``) and a GRANT notice (§5.3). Otherwise nothing changes.
* Open debits are the sum of the node's reservations that have not expired and have not been
  purged (HELD, COMMITTED and RELEASED-but-not-yet-seen).
* Every grant, commit, release, expiry and cordon change appends a notice with the node's next
  sequence number; agents' streams relay them (§6).
* ``register_node`` keeps a node's identity: a role or pool other than the registered one is
  refused (FailedPrecondition naming ``role`` or ``pool``) unless the node is cordoned.
* The policy is versioned: ``set_policy`` writes only when the stored version (0 when none) is
  ``expected_version``, raising :class:`Aborted` otherwise, and changes nothing then.
* Request records (``read_request`` / ``record_request``) make retried Admit, Commit and Release
  calls exact: the first outcome recorded under a key wins, later ones get it back; records
  expire after their TTL. A store that ``folds_request_records`` also takes a record with a
  debit (``DebitRequest.record``), in the debit's own atomic step: a record already there is
  returned and nothing is debited (refusal ``recorded``); a grant is recorded with it.
* Every method that touches the backend raises :class:`StoreUnavailable` on backend errors.
"""

from __future__ import annotations

import abc
import asyncio
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple

from crossflow_ctl.aio import wait_settled
from crossflow_ctl.api.v1 import lease_pb2
from crossflow_ctl.domain.errors import FailedPrecondition, InvalidArgument
from crossflow_ctl.domain.models import (
    CREDIT_NAMES,
    MAX_COMPUTE_US,
    MAX_TOKENS,
    Credits,
    Frozen,
    Lease,
    NodeInfo,
    NodeRole,
    NodeState,
    Notice,
    PoolLoad,
    PoolSnapshot,
    Reservation,
    Share,
    Shares,
    StoredLease,
)
from crossflow_ctl.domain.online_calibration import StepModelReport
from crossflow_ctl.domain.policy import VersionedPolicy
from crossflow_ctl.wire.convert import notice_to_proto


def check_debit_args(
    share: Share,
    hold_ttl_ms: int,
    owner: str = "",
    compute_us: int = 0,
    pulled_tokens: int | None = None,
) -> None:
    """The arguments of :meth:`Store.try_debit` every implementation refuses alike."""
    check_compute_us(compute_us)
    check_pulled_tokens(pulled_tokens)
    for name, part in zip(CREDIT_NAMES, Shares.of(share), strict=True):
        if not 0.0 <= part <= 1.0:
            field = "share" if not isinstance(share, Shares) else f"share.{name}"
            raise InvalidArgument(f"share must be within [0, 1], got {part}", field=field)
    if hold_ttl_ms <= 0:
        raise InvalidArgument("hold_ttl_ms must be positive", field="hold_ttl_ms")
    check_owner(owner)


def check_compute_us(compute_us: int) -> None:
    """A debit's node time is within ``[0, MAX_COMPUTE_US]`` microseconds."""
    if not 0 <= compute_us <= MAX_COMPUTE_US:
        raise InvalidArgument(
            f"compute_us must be within [0, {MAX_COMPUTE_US}], got {compute_us}",
            field="compute_us",
        )


def check_pulled_tokens(pulled_tokens: int | None) -> None:
    """A debit's pulled-in prefix is None or within ``[0, MAX_TOKENS]`` tokens."""
    if pulled_tokens is not None and not 0 <= pulled_tokens <= MAX_TOKENS:
        raise InvalidArgument(
            f"pulled_tokens must be within [0, {MAX_TOKENS}], got {pulled_tokens}",
            field="pulled_tokens",
        )


def check_owner(owner: str) -> str:
    """An owner is ``<role>/<name>`` of an identity (no ``|`` or ``*``), or ""."""
    if owner and (len(owner) > 256 or not _OWNER.fullmatch(owner)):
        raise InvalidArgument(f"malformed owner {owner[:80]!r}", field="owner")
    return owner


def owner_arg(owner: str | None) -> str:
    """The owner filter of commit/release as the Redis scripts take it (``*``: anyone)."""
    return "*" if owner is None else check_owner(owner)


_OWNER = re.compile(r"^[a-z]+/[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_identity(info: NodeInfo, role: NodeRole, pool: str) -> None:
    """FailedPrecondition when a Hello would change a registered, uncordoned node's identity."""
    if info.cordoned:
        return
    for field, have, want in (("role", info.role.value, role.value), ("pool", info.pool, pool)):
        if have != want:
            raise FailedPrecondition(
                f"node {info.node_id!r} is registered with {field} {have!r}, not {want!r}; "
                "cordon it to change its identity",
                field=field,
            )


class LeaseOutcome(Frozen):
    accepted: bool
    stored_epoch: int
    stored_version: int
    purged_reservations: int = 0


REPLY_LOST = "reply_lost"
"""The refusal of a late debit (``Store.try_debits_settled``) whose reply was lost."""


class DebitOutcome(Frozen):
    granted: bool
    reservation: Reservation | None = None
    short_credits: tuple[str, ...] = ()
    refusal: str = ""
    """Why nothing was debited: unknown_node, cordoned, no_lease, expired, zero_lease, short,
    or recorded (the debit's request record already held ``recorded``); or ``REPLY_LOST``:
    the reply of a debit its caller stopped waiting for was lost, so whether it debited is
    unknown (a grant then holds its room until its hold TTL)."""
    lease_epoch: int = 0
    lease_version: int = 0
    recorded: str | None = None
    """With refusal ``recorded``: the record found under the debit's record key."""
    record_key: str = ""
    """A grant recorded under this request record key (``DebitRequest.record``), else ""."""

    @classmethod
    def grant(
        cls, reservation: Reservation, lease_epoch: int, lease_version: int, record_key: str = ""
    ) -> DebitOutcome:
        """A granted debit's outcome, built without validation (every store's hot path: the
        reservation was just built, the rest are the lease's numbers; named, not ``cls``, so
        tests/test_trusted_calls.py checks it gets every field)."""
        return DebitOutcome.trusted(
            granted=True,
            reservation=reservation,
            short_credits=(),
            refusal="",
            lease_epoch=lease_epoch,
            lease_version=lease_version,
            recorded=None,
            record_key=record_key,
        )


class RequestRecord(NamedTuple):
    """A request record written with a grant, in the debit's atomic step.

    ``payload`` is a JSON object; the record is that object with the grant's facts added as
    members: ``reservation_id``, ``expires_at_ms``, ``lease_epoch`` and ``lease_version``
    (the payload must not hold them)."""

    key: str
    ttl_ms: int
    payload: str


def grant_member(reservation_id: str) -> str:
    """How a request record (a compact JSON object) names the reservation it was granted."""
    return f'"reservation_id":"{reservation_id}"'


class DebitRequest(NamedTuple):
    """One debit of a batch (:meth:`Store.try_debits`)."""

    node_id: str
    debit: Credits
    request_id: str = ""
    owner: str = ""
    """The granted router's identity ("" without authentication)."""
    record: RequestRecord | None = None
    """Only for a store that ``folds_request_records`` (module docstring)."""
    compute_us: int = 0
    """The node time behind the debit's compute (``Reservation.compute_us``; 0: untimed)."""
    pulled_tokens: int | None = None
    """The prefix tokens the debit's kv_transfer pulls in, for its GRANT notice
    (``Notice.pulled_tokens``; None: the notice does not say)."""


class NodeEvent(Frozen):
    at_ms: int
    kind: str
    message: str


class Store(abc.ABC):
    """Leases, pool load, reservations, notices and the shared policy."""

    folds_request_records: bool = False
    """Whether :meth:`try_debits` takes request records with debits (``DebitRequest.record``),
    saving the admission a round trip: a store whose record and node keys can meet in one
    atomic step (standalone Redis; not Redis Cluster, where they lie in different slots)."""

    # -- agents -----------------------------------------------------------------------------
    @abc.abstractmethod
    async def register_node(
        self,
        node_id: str,
        role: NodeRole,
        pool: str,
        labels: dict[str, str],
        now_ms: int,
    ) -> NodeInfo:
        """Create or refresh a node's info on agent Hello; keeps its cordon state.

        FailedPrecondition (field ``role`` or ``pool``) when the node is registered with another
        role or pool and is not cordoned; nothing changes then."""

    @abc.abstractmethod
    async def upsert_lease(self, lease: Lease, now_ms: int, max_ttl_ms: int) -> LeaseOutcome:
        """Store ``lease`` if newer than the stored one (see module docstring)."""

    @abc.abstractmethod
    async def put_pool_load(self, load: PoolLoad, now_ms: int, max_ttl_ms: int) -> bool:
        """Record one prefill server's report; it expires after min(ttl, max_ttl). The report
        gets the pool's next ingest sequence (``StoredPoolLoad.seq``), assigned by the store
        itself, so every replica orders the pool's reports alike. Returns whether the node is
        registered (a deleted one's report is stored, to expire, but its stream should end so
        its agent registers it again, as a decode node's next lease does)."""

    @abc.abstractmethod
    async def put_step_model(self, node_id: str, report: StepModelReport) -> bool:
        """Keep ``report`` as the node's latest step model (informational, for describe; it
        goes with the node). False, and nothing stored, when the node is not registered."""

    @abc.abstractmethod
    async def step_model(self, node_id: str) -> StepModelReport | None:
        """The node's latest step model; None when its agent sent none. NotFound for an
        unknown node."""

    # -- admission --------------------------------------------------------------------------
    @abc.abstractmethod
    async def admission_view(
        self, pool: str, node_ids: Sequence[str], sample: int, now_ms: int
    ) -> tuple[PoolSnapshot | None, list[NodeState]]:
        """The pool's live reports and the candidates' states, in one round trip.

        With no ``node_ids``, up to ``sample`` random nodes holding a live non-zero lease are
        taken, so the cost does not grow with the fleet. Unknown ids are left out."""

    @abc.abstractmethod
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
        """Atomically check room on every credit and record a HELD reservation owned by
        ``owner`` (the granted router's identity, "" without authentication). ``compute_us``:
        the node time behind the debit's compute (0: untimed, counted in its tokens).
        ``pulled_tokens``: the prefix tokens its kv_transfer pulls in, for its GRANT notice
        (None: the notice leaves them out)."""

    async def try_debits(
        self, debits: Sequence[DebitRequest], share: Share, now_ms: int, hold_ttl_ms: int
    ) -> list[DebitOutcome]:
        """:meth:`try_debit` for each item, in order; each one atomic on its own node (a batch
        is not a transaction). Stores with a network round trip send the batch as one.

        InvalidArgument, changing nothing, for an item with a ``record`` when the store does not
        ``folds_request_records`` (dropping it would leave a retry with no outcome to find), or
        with a bad owner, node time or pulled tokens: every item is checked before any is
        debited, so no grant is made for a batch that then fails."""
        self.check_debits(debits, share, hold_ttl_ms)
        return [
            await self.try_debit(
                d.node_id,
                d.debit,
                share,
                now_ms,
                hold_ttl_ms,
                d.request_id,
                d.owner,
                d.compute_us,
                d.pulled_tokens,
            )
            for d in debits
        ]

    def check_debits(self, debits: Sequence[DebitRequest], share: Share, hold_ttl_ms: int) -> None:
        """What :meth:`try_debits` refuses (InvalidArgument), checked for every item before
        any is sent or debited."""
        check_debit_args(share, hold_ttl_ms)
        for d in debits:
            check_owner(d.owner)
            check_compute_us(d.compute_us)
            check_pulled_tokens(d.pulled_tokens)
            if d.record is not None and not self.folds_request_records:
                raise InvalidArgument(
                    f"{type(self).__name__} takes no request record with a debit"
                    " (a Redis Cluster store cannot write it in the debit's atomic step)"
                )

    async def try_debits_settled(
        self,
        debits: Sequence[DebitRequest],
        share: Share,
        now_ms: int,
        hold_ttl_ms: int,
        late: Callable[[list[DebitOutcome]], None],
    ) -> list[DebitOutcome]:
        """:meth:`try_debits` for a caller that may stop waiting (cancelled: the admission
        deadline, or its own caller gone): the debits may still land then, and their outcomes
        go to ``late`` once known, so a grant nobody was told of can be released (none when
        the store failed: a HELD debit expires by itself). A timeout the store call sets up
        cancels the debit, never the caller.

        Here: :meth:`try_debits` in a task of its own from the start, the caller waiting on a
        future the task settles as its last step (what ``asyncio.shield`` does, one event-loop
        turn sooner). A store whose debit can be waited for in the caller's own task and still
        be finished once it left overrides it: the Redis store's dedicated connection, and the
        in-process store, which runs the debits inline unless it must wait for its lock."""
        return await settled_debits(
            self.try_debits(debits, share, now_ms, hold_ttl_ms), late, self._late_debits()
        )

    _late: set[asyncio.Task[list[DebitOutcome]]] | None = None

    def _late_debits(self) -> set[asyncio.Task[list[DebitOutcome]]]:
        """The debits of callers that stopped waiting still running here (:meth:`settle`)."""
        late = self._late
        if late is None:
            late = self._late = set()
        return late

    @abc.abstractmethod
    async def commit(
        self, reservation_id: str, now_ms: int, commit_ttl_ms: int, owner: str | None = None
    ) -> Reservation:
        """HELD -> COMMITTED (expiry now + commit_ttl). NotFound if unknown or expired;
        FailedPrecondition if already released; PermissionDenied, changing nothing, when
        ``owner`` is given and is not the reservation's. Committing twice is idempotent."""

    @abc.abstractmethod
    async def release(
        self, reservation_id: str, now_ms: int, owner: str | None = None
    ) -> Reservation:
        """HELD/COMMITTED -> RELEASED with a RELEASE notice. NotFound if unknown or expired;
        PermissionDenied, changing nothing, when ``owner`` is given and is not the
        reservation's. Releasing twice is idempotent."""

    # -- operators --------------------------------------------------------------------------
    @abc.abstractmethod
    async def set_cordon(self, node_id: str, cordoned: bool, reason: str, now_ms: int) -> NodeInfo:
        """Cordon or uncordon a known node (NotFound otherwise), with a notice."""

    @abc.abstractmethod
    async def delete_node(self, node_id: str, force: bool, now_ms: int) -> int:
        """Remove a node and all its state (lease, reservations, notices, history, events)
        from every index; returns how many of its reservations still counted. NotFound if
        unknown; FailedPrecondition naming ``force`` when reservations still count and
        ``force`` is false (nothing changes then)."""

    @abc.abstractmethod
    async def expire_nodes(self, idle_ms: int, now_ms: int) -> list[str]:
        """Delete every node not heard of (registered, or an accepted lease or pool load) for
        ``idle_ms`` and with no reservation still counting; returns their ids, sorted.
        Idempotent: any replica may sweep, at any time."""

    @abc.abstractmethod
    async def list_nodes(self, now_ms: int) -> list[NodeState]:
        """Every known node, sorted by id."""

    @abc.abstractmethod
    async def get_node(self, node_id: str, now_ms: int) -> NodeState:
        """One node (NotFound if unknown)."""

    @abc.abstractmethod
    async def list_reservations(self, node_id: str | None, now_ms: int) -> list[Reservation]:
        """Open (counting) reservations, of one node or all, sorted by creation."""

    @abc.abstractmethod
    async def list_pools(self, now_ms: int) -> list[PoolSnapshot]:
        """Every pool with its live reports."""

    @abc.abstractmethod
    async def lease_history(self, node_id: str, limit: int) -> list[StoredLease]:
        """The node's most recent accepted leases, newest first."""

    @abc.abstractmethod
    async def node_events(self, node_id: str, limit: int) -> list[NodeEvent]:
        """State changes (lease zeroed or restored, cordon, new epoch), newest first."""

    # -- notices ----------------------------------------------------------------------------
    @abc.abstractmethod
    async def read_notices(
        self, node_id: str, after_seq: int, limit: int, block_ms: int = 0
    ) -> list[Notice]:
        """Notices with seq > after_seq, oldest first; waits up to block_ms when none. Returns,
        or raises StoreUnavailable, within about block_ms plus one call's timeout (callers
        arm no timer of their own)."""

    async def read_notice_batch(
        self, node_id: str, after_seq: int, limit: int, block_ms: int = 0
    ) -> lease_pb2.NoticeBatch:
        """:meth:`read_notices` as the message an agent stream relays, each notice converted
        by ``notice_to_proto``. A store may build it without the Notice models in between
        (the Redis store decodes its stream entries straight into the message)."""
        notices = await self.read_notices(node_id, after_seq, limit, block_ms)
        return lease_pb2.NoticeBatch(notices=[notice_to_proto(n) for n in notices])

    # -- policy -----------------------------------------------------------------------------
    @abc.abstractmethod
    async def get_policy(self) -> VersionedPolicy | None:
        """The policy shared by all broker replicas with its version, None if never set."""

    @abc.abstractmethod
    async def set_policy(self, policy: VersionedPolicy, expected_version: int) -> None:
        """Store ``policy`` (with its version) if the stored version is ``expected_version``
        (0: none stored); Aborted with the stored version otherwise."""

    # -- request records (idempotent retries) -------------------------------------------------
    @abc.abstractmethod
    async def read_request(self, key: str) -> str | None:
        """The outcome recorded under ``key``, None when none is (or it expired)."""

    @abc.abstractmethod
    async def record_request(self, key: str, outcome: str, ttl_ms: int) -> str | None:
        """Record ``outcome`` under ``key`` unless one is recorded (None: this one was);
        otherwise return the recorded one and change nothing. Of two calls racing to record,
        exactly one wins."""

    @abc.abstractmethod
    async def forget_request(self, key: str, reservation_id: str) -> None:
        """Delete the record under ``key`` if it names ``reservation_id`` (a grant recorded
        with its debit that is being released because no caller heard of it)."""

    # -- lifecycle --------------------------------------------------------------------------
    @abc.abstractmethod
    async def ping(self) -> None:
        """Raise StoreUnavailable when the backend does not answer."""

    async def settle(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for debits still running, or their replies still being
        read, in the background (of callers that stopped waiting: ``try_debits_settled``), so
        their ``late`` hand-overs happen now, while the store can still release what they
        granted (at shutdown: before the broker waits for its releases and the store closes)."""
        await wait_settled(lambda: self._late or (), timeout_s)

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections."""


async def settled_debits(
    call: Awaitable[list[DebitOutcome]],
    late: Callable[[list[DebitOutcome]], None],
    running: set[asyncio.Task[list[DebitOutcome]]],
) -> list[DebitOutcome]:
    """``call`` (debits) in a task of its own, its outcomes to ``late`` should its caller stop
    waiting (``Store.try_debits_settled``); such a task is in ``running`` until it ends (its
    hand-over runs first: ``Store.settle`` waits for both)."""
    answer: asyncio.Future[list[DebitOutcome]] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(_settling(call, answer))
    try:
        return await answer
    except asyncio.CancelledError:
        task.add_done_callback(lambda done: _hand_over(done, late))
        if not task.done():
            running.add(task)
            task.add_done_callback(running.discard)
        raise
    except BaseException:
        # The task ended with that same error in the step that set it: retrieved here,
        # as shield retrieves it, so asyncio never reports it as unretrieved.
        if task.done() and not task.cancelled():
            task.exception()
        raise


async def _settling(
    call: Awaitable[list[DebitOutcome]], answer: asyncio.Future[list[DebitOutcome]]
) -> list[DebitOutcome]:
    """``call``'s outcome, also settled into ``answer`` (unless its waiter gave up) in the same
    step: the waiter resumes on the next loop turn."""
    try:
        outcomes = await call
    except asyncio.CancelledError:
        answer.cancel()
        raise
    except BaseException as exc:
        if not answer.done():
            answer.set_exception(exc)
        raise
    if not answer.done():
        answer.set_result(outcomes)
    return outcomes


def _hand_over(
    debits: asyncio.Future[list[DebitOutcome]], late: Callable[[list[DebitOutcome]], None]
) -> None:
    """Done-callback of debits their caller stopped waiting for: their outcomes to ``late``
    (nothing when they failed or were cancelled: nothing landed, or a HELD debit expires)."""
    if not debits.cancelled() and debits.exception() is None:
        late(debits.result())
