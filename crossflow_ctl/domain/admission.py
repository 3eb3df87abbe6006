"""The admission policy (DESIGN.md §4): Demand, Benefit and Safety, and node choice.

Pure: it is given the request, the prefill pool's load, the candidate nodes' states, the policy
settings and the time, and returns a :class:`Plan` with every number it used. The broker then
asks the store to check-and-debit the first choice atomically; the store re-checks Safety against
the latest lease, so a plan made on a slightly old read can never over-commit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Annotated, NamedTuple

from pydantic import Field

from crossflow_ctl.domain.lending import compute_debit, queue_wait_ms
from crossflow_ctl.domain.models import (
    MAX_COMPUTE_US,
    MAX_MS,
    MAX_TOKENS,
    Credits,
    Frozen,
    Lease,
    NodeId,
    NodeState,
    PoolName,
    PoolSnapshot,
    Share,
)
from crossflow_ctl.domain.pending import NONE_UNREPORTED, Unreported
from crossflow_ctl.domain.policy import PolicySettings
from crossflow_ctl.domain.safety import need_for, room_left, short_of_room


class Decision(StrEnum):
    BORROW = "borrow"
    NORMAL = "normal"


class Reason(StrEnum):
    BORROWED = "borrowed"
    NO_DEMAND = "no_demand"
    POOL_LOAD_MISSING = "pool_load_missing"
    NO_BENEFIT = "no_benefit"
    NO_ROOM = "no_room"
    NO_LEASES = "no_leases"
    STORE_UNAVAILABLE = "store_unavailable"
    TIMEOUT = "timeout"
    SHADOW_MODE = "shadow_mode"
    DRY_RUN = "dry_run"
    BORROWING_DISABLED = "borrowing_disabled"
    BROKER_UNAVAILABLE = "broker_unavailable"
    """A fail-closed client could not reach the broker (never answered by a broker)."""


NOTHING_TO_PREFILL = "no uncached prompt tokens: nothing to prefill"
"""A node check's ``detail`` for a prompt with no uncached tokens (no Benefit anywhere)."""

MAX_REQUEST_ID_LEN = 256
MAX_CANDIDATES = 1_024
MAX_ATTEMPT = 1_000
"""``AdmissionRequest``'s bounds, named for the wire's check of a request before it skips
validation (:func:`crossflow_ctl.wire.convert_admission.admit_request_from_proto`)."""


class AdmissionRequest(Frozen):
    request_id: Annotated[str, Field(max_length=MAX_REQUEST_ID_LEN)] = ""
    uncached_prompt_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)]
    cached_prefix_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] = 0
    cached_prefix_node_id: NodeId | None = None
    """Decode node holding the cached prefix; None when it lives in the prefill pool."""
    expected_output_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] = 0
    candidate_node_ids: Annotated[tuple[NodeId, ...], Field(max_length=MAX_CANDIDATES)] = ()
    dry_run: bool = False
    pool: PoolName = "default"
    attempt: Annotated[int, Field(ge=0, le=MAX_ATTEMPT)] = 0
    """0 on the first call of ``request_id``, n on its n-th retry (see service.requests)."""
    held_ahead_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] = 0
    """Uncached prompt tokens the router holds back from the prefill pool ahead of this prompt
    (late binding): they reach prefill before it does, so its normal path waits for them too."""
    prefill_node_id: NodeId | None = None
    """The prefill server the router would send the prompt to on the normal path: Demand and
    Benefit then use that server's own wait when the pool reports waits in time
    (``PoolSnapshot.estimated_wait_ms``). None: the router picks the least-loaded server."""
    explain: bool = False
    """Answer with the explanation (the plan's numbers and texts on the wire). Dry runs carry
    it whatever this says; other answers leave it out unless asked: it is built per answer."""


class DemandCheck(Frozen):
    holds: bool
    pool_wait_ms: float | None
    threshold_ms: float
    outstanding_uncached_tokens: int = 0
    processing_rate_tps: float = 0.0
    reporting_nodes: int = 0
    pending_uncached_tokens: int = 0
    """Uncached tokens sent to the pool since its reports, counted into ``pool_wait_ms``
    (:mod:`crossflow_ctl.domain.pending`)."""
    prefill_node_id: str | None = None
    """The prefill server whose wait ``pool_wait_ms`` is (the request's); None: the pool's."""
    timed: bool = False
    """``pool_wait_ms`` is from the servers' reported waits in time (that of
    ``prefill_node_id``, else the least-loaded server's), not tokens over rate."""

    @property
    def no_rate(self) -> bool:
        """Work outstanding, no rate reported: the wait is unbounded (``PoolSnapshot.no_rate``)."""
        return (
            not self.timed
            and self.outstanding_uncached_tokens > 0
            and self.processing_rate_tps <= 0
        )


class NormalPath(Frozen):
    wait_ms: float
    prefill_ms: float
    kv_transfer_ms: float
    hold_ms: float = 0.0
    """The prefill pool's time for the tokens the router holds ahead of the prompt."""

    @property
    def total_ms(self) -> float:
        return self.hold_ms + self.wait_ms + self.prefill_ms + self.kv_transfer_ms


class NodeCheck(Frozen):
    node_id: str
    verdict: Reason
    """BORROWED when this node passes Benefit and Safety, else why it does not."""
    detail: str = ""
    """Why the node was not priced (no usable lease) or has nothing to prefill; "" where the
    check's numbers say it (:meth:`text`, built only for an explanation, not per check)."""
    queue_wait_ms: float = 0.0
    """The lease's wait plus that of the broker's open debits on the node (``lending``)."""
    service_ms: float = 0.0
    benefit: bool = False
    safe: bool = False
    available: Credits = Credits()
    debit: Credits = Credits()
    debit_us: Annotated[int, Field(ge=0, le=MAX_COMPUTE_US)] = 0
    """The node time behind the debit's compute, in microseconds (0: untimed); the store
    counts the debit in its latest lease's unit from it (:mod:`.safety`)."""
    short_credits: tuple[str, ...] = ()
    lease_epoch: int = 0
    lease_version: int = 0

    @property
    def predicted_ttft_ms(self) -> float:
        return self.queue_wait_ms + self.service_ms

    def text(self, normal_ms: float) -> str:
        """The check in words: its ``detail``, else what its numbers say against the normal
        path's total (``normal_ms``: ``Plan.normal_path``'s)."""
        if self.detail:
            return self.detail
        if self.verdict is Reason.BORROWED:
            return f"predicted {self.predicted_ttft_ms:.1f} ms"
        if self.verdict is Reason.NO_BENEFIT:
            return f"predicted {self.predicted_ttft_ms:.1f} ms >= normal {normal_ms:.1f} ms"
        if self.verdict is Reason.NO_ROOM:
            return "short on " + ", ".join(self.short_credits)
        return ""


class Plan(Frozen):
    """The policy's verdict before any debit: NORMAL with a reason, or ranked nodes to try."""

    reason: Reason
    demand: DemandCheck
    normal_path: NormalPath | None = None
    nodes: tuple[NodeCheck, ...] = ()
    ranked: tuple[NodeCheck, ...] = ()
    """Nodes that pass Benefit and Safety, best (lowest predicted TTFT) first."""

    def summary(self) -> str:
        d = self.demand
        if self.reason is Reason.POOL_LOAD_MISSING:
            if d.prefill_node_id is not None:
                return f"demand fails: no live load report from prefill server {d.prefill_node_id}"
            return "demand fails: no live load report from the prefill pool"
        if d.holds:  # the wait's text only where it is shown (not in a borrowed answer's)
            if not self.ranked:
                return f"{self.reason.value}: no node passes both benefit and safety"
            best = self.ranked[0]
            normal = self.normal_path.total_ms if self.normal_path else 0.0
            return (
                f"borrow on {best.node_id}: predicted TTFT {best.predicted_ttft_ms:.1f} ms "
                f"< normal path {normal:.1f} ms"
            )
        wait = f"{d.pool_wait_ms:.1f}" if d.pool_wait_ms is not None else "?"
        if d.pending_uncached_tokens:
            wait += f" ms (with {d.pending_uncached_tokens} tokens sent since its reports)"
        else:
            wait += " ms"
        if d.prefill_node_id is not None and d.timed:
            wait += f" on {d.prefill_node_id}"
        return f"demand fails: prefill wait {wait} <= threshold {d.threshold_ms:.1f} ms"

    @property
    def normal_ms(self) -> float:
        """The normal path's total (0 when none was estimated)."""
        return self.normal_path.total_ms if self.normal_path is not None else 0.0


class Admission(Frozen):
    """The answer to one Admit, after the store's debit (or the reason there was none)."""

    decision: Decision
    reason: Reason
    message: str = ""
    node_id: str = ""
    reservation_id: str = ""
    lease_epoch: int = 0
    lease_version: int = 0
    expires_at_ms: int = 0
    predicted_ttft_ms: float = 0.0
    normal_ttft_ms: float = 0.0
    plan: Plan | None = None
    shadow_decision: Decision | None = None
    replayed: bool = False
    """The recorded outcome of an earlier call with the same request_id, not a new decision."""
    debit: Credits | None = None
    """BORROW: the credits the reservation took from ``node_id``; None on a NORMAL answer (and
    from a broker that does not say)."""

    @classmethod
    def normal(cls, reason: Reason, message: str, plan: Plan | None = None) -> Admission:
        normal = plan.normal_path.total_ms if plan and plan.normal_path else 0.0
        # Every field, in order, of its type (the NORMAL answer of every Admit that does not
        # borrow): built without validation.
        return Admission.trusted(
            decision=Decision.NORMAL,
            reason=reason,
            message=message,
            node_id="",
            reservation_id="",
            lease_epoch=0,
            lease_version=0,
            expires_at_ms=0,
            predicted_ttft_ms=0.0,
            normal_ttft_ms=normal,
            plan=plan,
            shadow_decision=None,
            replayed=False,
            debit=None,
        )


def horizon_output_tokens(
    request: AdmissionRequest, itl_ms: float, settings: PolicySettings
) -> int:
    """Output tokens the request can decode within the borrow horizon at ``itl_ms`` per token.

    The lease's output credit counts tokens over the horizon, so the debit must too: a request
    expecting 2,000 output tokens on a node stepping every 20 ms takes 100 tokens of a 2 s
    horizon's output credit, not 2,000. Unknown ITL (0) debits the whole expected output.
    """
    if itl_ms <= 0:
        return request.expected_output_tokens
    per_horizon = math.ceil(settings.borrow_horizon_ms / itl_ms)
    return min(request.expected_output_tokens, per_horizon)


class Debit(NamedTuple):
    """What one borrowed request takes from a node: its credits, and the node time behind the
    compute credit in microseconds (``compute_us``, 0: untimed)."""

    credits: Credits
    compute_us: int = 0


def pulled_tokens(request: AdmissionRequest, node_id: str) -> int:
    """The cached prefix tokens borrowing on ``node_id`` pulls in from elsewhere: the request's
    prefix unless it is already on that node. Its debit's kv_transfer credit is these tokens at
    the policy's KV bytes per token (:func:`debit_for`); its GRANT notice carries them as they
    are, so the agent needs no unit to read them."""
    remote = request.cached_prefix_tokens > 0 and request.cached_prefix_node_id != node_id
    return request.cached_prefix_tokens if remote else 0


def debit_for(
    request: AdmissionRequest, node_id: str, settings: PolicySettings, lease: Lease | None = None
) -> Debit:
    """The credits one borrowed request takes from ``node_id`` under its ``lease``.

    * compute: the prompt's own prefill cost, priced with the lease's per-token coefficients at
      its cached prefix, in the lease's unit, with the node time it stands for
      (:func:`~crossflow_ctl.domain.lending.compute_debit`; the uncached tokens, untimed, when
      the lease has no rate);
    * kv: what the request places on the node while the broker counts it: its uncached prompt,
      a cached prefix that must be pulled in (one already on this node is in its cache and its
      telemetry), and the output it decodes within the horizon (later growth is in the agent's
      per-request reserve once the request shows in the node's batch);
    * kv_transfer: the remote prefix's bytes; output: tokens decoded within the horizon at the
      lease's ITL; slots: one.
    """
    pulled = pulled_tokens(request, node_id)
    uncached, cached = request.uncached_prompt_tokens, request.cached_prefix_tokens
    itl_ms = 0.0
    compute, compute_us = uncached, 0
    if lease is not None:
        itl_ms = lease.itl_ms or lease.itl_slo_ms
        compute, compute_us = compute_debit(
            uncached,
            cached,
            lease.prefill_s_per_token,
            lease.prefill_s_per_token_context,
            lease.borrowed_prefill_rate_tps,
        )
    output = horizon_output_tokens(request, itl_ms, settings)
    credits = Credits.trusted(
        compute_tokens=compute,
        kv_tokens=min(MAX_TOKENS, uncached + pulled + output),
        kv_transfer_bytes=pulled * settings.kv_bytes_per_token,
        output_tokens=output,
        slots=1,
    )
    return Debit(credits, compute_us)


def check_demand(
    pool: PoolSnapshot | None,
    settings: PolicySettings,
    pending_tokens: int = 0,
    prefill_node_id: str | None = None,
    sent_to: Mapping[str, int] | None = None,
) -> DemandCheck:
    """Demand at ``demand_threshold_ms``. Without ``prefill_node_id``, of the pool as a whole:
    whether it is behind for every prompt (a prompt's own threshold is never higher, and, when
    the pool reports waits in time, its server's wait never lower than the least-loaded one's:
    :func:`prompt_demand`, :func:`target_demand`). With it, for a prompt bound for that server.
    ``pending_tokens``: uncached tokens sent to the pool that its reports do not show yet
    (:func:`~crossflow_ctl.domain.pending.unreported_tokens`); ``sent_to``: those sent to a
    named server, by server, when the pool reports waits in time (then not in
    ``pending_tokens``: :class:`~crossflow_ctl.domain.pending.Unreported`)."""
    wait = (
        pool.estimated_wait_ms(pending_tokens, prefill_node_id, sent_to)
        if pool is not None
        else None
    )
    if pool is None or wait is None:
        return DemandCheck(
            holds=False,
            pool_wait_ms=None,
            threshold_ms=settings.demand_threshold_ms,
            prefill_node_id=prefill_node_id,
        )
    rate = pool.processing_rate_tps  # a sum over the reports: read once
    waits = pool.server_waits_ms(sent_to)
    if waits is not None and sent_to:  # what was sent to the server whose wait this is
        server = prefill_node_id or min(waits, key=waits.__getitem__)
        pending_tokens += sent_to.get(server, 0)
    # Every field, in order, of its type (computed above, per Admit): without validation.
    return DemandCheck.trusted(
        holds=wait > settings.demand_threshold_ms,
        pool_wait_ms=wait,
        threshold_ms=settings.demand_threshold_ms,
        outstanding_uncached_tokens=pool.outstanding_uncached_tokens,
        processing_rate_tps=rate,
        reporting_nodes=len(pool.reports),
        pending_uncached_tokens=pending_tokens if rate > 0 else 0,
        prefill_node_id=prefill_node_id,
        timed=waits is not None,
    )


def target_demand(
    demand: DemandCheck,
    pool: PoolSnapshot | None,
    request: AdmissionRequest,
    settings: PolicySettings,
    pending: Unreported = NONE_UNREPORTED,
) -> DemandCheck:
    """The pool's Demand (``demand``, :func:`check_demand` without a server) for a prompt the
    router would send to ``request.prefill_node_id``: that server's wait, with the tokens sent
    since the reports (``pending``, what ``demand`` was computed with); the pool's when the
    request names none. A ``demand`` already for that server (this function's answer, which a
    caller planning many requests on one pool keeps per server) is returned as it is."""
    target = request.prefill_node_id
    if target is None or pool is None or demand.prefill_node_id == target:
        return demand
    return check_demand(pool, settings, pending.shared, target, pending.by_server)


def prompt_demand(demand: DemandCheck, normal: NormalPath, settings: PolicySettings) -> DemandCheck:
    """Demand for one prompt: the pool's wait above the lower of ``demand_threshold_ms`` and
    ``demand_prefill_ratio`` x the prompt's own prefill time on the pool (``normal``).

    The threshold says when the pool is behind *for this prompt*: queueing that adds more than
    the ratio of its own prefill time to its TTFT. A short prompt meets it long before a long
    one does, and only a prompt whose threshold is below the pool-wide one changes answer, so
    the pool-wide Demand (:func:`check_demand`, what a room watch reports) still implies every
    prompt's. A missing wait fails for every prompt, as before."""
    ratio = settings.demand_prefill_ratio
    if demand.pool_wait_ms is None or ratio is None:
        return demand
    own = ratio * normal.prefill_ms
    if own >= demand.threshold_ms:
        return demand
    # A copy, not a field-by-field rebuild: a field added to DemandCheck later (as the named
    # server's id was) must carry over, not fall silently to its default. Every field in order,
    # two of them replaced by values of their types: built without validation, per Admit.
    holds = demand.pool_wait_ms > own
    return demand.replaced(threshold_ms=own, holds=holds)


def pool_prefill_rate(pool: PoolSnapshot | None) -> float:
    """The pool's per-request prefill rate (0: unknown), which the normal path of every prompt
    planned on ``pool`` uses: a caller planning many on one snapshot reads it once."""
    return pool.prefill_rate_tps if pool else 0.0


def estimate_normal_path(
    request: AdmissionRequest,
    demand: DemandCheck,
    pool: PoolSnapshot | None,
    settings: PolicySettings,
    prefill_rate_tps: float | None = None,
) -> NormalPath:
    """Hold + prefill-pool wait + prefill time + KV transfer of the whole prompt to decode.

    The hold is what a held prompt's alternative to borrowing still costs: the prompts the
    router holds ahead of it (``held_ahead_tokens``) go to the pool first, at the pool's
    processing rate (the per-request prefill rate when no server reports one).
    ``prefill_rate_tps``: :func:`pool_prefill_rate` of ``pool``, when the caller has it."""
    if prefill_rate_tps is None:
        prefill_rate_tps = pool_prefill_rate(pool)
    rate = prefill_rate_tps or settings.default_prefill_rate_tps
    prompt = request.uncached_prompt_tokens + request.cached_prefix_tokens
    pool_rate = demand.processing_rate_tps or rate
    # Four floats computed here (its fields, in order: built without validation, per Admit).
    return NormalPath.trusted(
        wait_ms=float(demand.pool_wait_ms or 0.0),
        prefill_ms=request.uncached_prompt_tokens / rate * 1000.0,
        kv_transfer_ms=prompt
        * settings.kv_bytes_per_token
        / settings.kv_transfer_bytes_per_s
        * 1000.0,
        hold_ms=min(MAX_MS, request.held_ahead_tokens / pool_rate * 1000.0),
    )


Room = tuple[tuple[int, ...], Credits]
"""A node's room per credit as Safety counts it (:func:`.safety.room_left`, may be negative),
and the same floored at zero (``NodeCheck.available``)."""


def node_rooms(nodes: Sequence[NodeState], share: Share) -> tuple[Room | None, ...]:
    """Each node's room at ``share`` (None without a lease): the same for every request planned
    on these states, so a batch computes it once per node, not once per request and node."""
    return tuple(None if n.lease is None else _room(n, n.lease.lease, share) for n in nodes)


def _room(node: NodeState, lease: Lease, share: Share) -> Room:
    """The node's room under ``lease`` (its latest), open debits counted in the lease's unit.
    A debit priced against this same lease is in that unit already (:func:`debit_for`); what
    it needs of this room is :func:`.safety.need_for`'s."""
    rate = lease.borrowed_prefill_rate_tps
    room = room_left(lease.credits, node.open_debits, share, rate, node.open_compute)
    return room, Credits.from_tuple(room)


def check_node(
    request: AdmissionRequest,
    node: NodeState,
    normal: NormalPath,
    settings: PolicySettings,
    now_ms: int,
    room: Room | None = None,
) -> NodeCheck:
    """Benefit and Safety on one node; ``room``: the node's at ``settings.shares``
    (:func:`node_rooms`), computed here when not given."""
    return _check_node(request, node, normal.total_ms, settings, now_ms, room)


def _check_node(
    request: AdmissionRequest,
    node: NodeState,
    normal_ms: float,
    settings: PolicySettings,
    now_ms: int,
    room: Room | None,
) -> NodeCheck:
    """:func:`check_node` given the normal path's total (``normal_ms``), which a plan reads
    once per request, not once per candidate node."""
    info = node.info
    node_id = info.node_id
    stored = node.lease
    lease = stored.lease if stored is not None else None
    debit, debit_us = debit_for(request, node_id, settings, lease)
    if info.cordoned:
        return NodeCheck(node_id=node_id, verdict=Reason.NO_LEASES, detail="cordoned", debit=debit)
    if stored is None or lease is None:
        return NodeCheck(node_id=node_id, verdict=Reason.NO_LEASES, detail="no lease", debit=debit)
    if stored.expired(now_ms):
        unusable = "lease expired"
    elif lease.zero_reason is not None:
        unusable = f"zero lease: {lease.zero_reason.value}"
    else:
        unusable = ""
    if unusable:
        return NodeCheck(
            node_id=node_id,
            verdict=Reason.NO_LEASES,
            detail=unusable,
            lease_epoch=lease.epoch,
            lease_version=lease.version,
            debit=debit,
            debit_us=debit_us,
        )
    left, available = room or _room(node, lease, settings.shares)
    opened, time, rate = node.open_debits, node.open_compute, lease.borrowed_prefill_rate_tps
    need = need_for(debit, debit_us, opened.compute_tokens, time, rate)
    short = short_of_room(left, need)  # ``available`` is floored at zero, for display only
    uncached = request.uncached_prompt_tokens
    service_ms = lease.prefill_service_s(uncached, request.cached_prefix_tokens) * 1000.0
    if debit.kv_transfer_bytes:
        service_ms += debit.kv_transfer_bytes / settings.kv_transfer_bytes_per_s * 1000.0
    wait_ms = queue_wait_ms(lease, opened.compute_tokens, time)
    predicted = wait_ms + service_ms
    # An empty prompt (nothing uncached) has no prefill to move: borrowing cannot help it.
    has_work = uncached > 0
    benefit = has_work and predicted + settings.benefit_margin_ms < normal_ms
    safe = not short
    # The texts that follow from the numbers are left to ``NodeCheck.text``: built only when
    # an explanation is asked for, not per node of every Admit.
    detail = ""
    if benefit and safe:  # the common answer first
        verdict = Reason.BORROWED
    elif not has_work:
        verdict, detail = Reason.NO_BENEFIT, NOTHING_TO_PREFILL
    elif not benefit:
        verdict = Reason.NO_BENEFIT
    else:
        verdict = Reason.NO_ROOM
    # Every field computed here, of its declared type: built without validation (``trusted``,
    # in field order), as Admit plans every candidate node of every request.
    return NodeCheck.trusted(
        node_id=node_id,
        verdict=verdict,
        detail=detail,
        queue_wait_ms=wait_ms,
        service_ms=service_ms,
        benefit=benefit,
        safe=safe,
        available=available,
        debit=debit,
        debit_us=debit_us,
        short_credits=short,
        lease_epoch=lease.epoch,
        lease_version=lease.version,
    )


def _rank(check: NodeCheck) -> tuple[float, str]:
    """Best first: the lowest predicted TTFT, then the node id."""
    return (check.predicted_ttft_ms, check.node_id)


def plan_admission(
    request: AdmissionRequest,
    pool: PoolSnapshot | None,
    nodes: Sequence[NodeState],
    settings: PolicySettings,
    now_ms: int,
    demand: DemandCheck | None = None,
    rooms: Sequence[Room | None] | None = None,
    pending: Unreported = NONE_UNREPORTED,
    prefill_rate_tps: float | None = None,
) -> Plan:
    """Demand, then Benefit and Safety on every candidate; rank the nodes that pass both.

    ``demand``: ``check_demand(pool, settings)``, or already its :func:`target_demand` for the
    request's prefill server (made the prompt's own by :func:`target_demand` and
    :func:`prompt_demand`), and ``rooms``: ``node_rooms(nodes,
    settings.shares)``, when the caller already has them (a batch of requests planned on
    one view shares them); ``pending``: the tokens sent since the pool's reports ``demand``
    was computed with; ``prefill_rate_tps``: ``pool.prefill_rate_tps`` (:func:`pool_prefill_rate`),
    likewise."""
    pool_demand = demand if demand is not None else check_demand(pool, settings)
    pool_demand = target_demand(pool_demand, pool, request, settings, pending)
    normal = estimate_normal_path(request, pool_demand, pool, settings, prefill_rate_tps)
    demand = prompt_demand(pool_demand, normal, settings)
    if rooms is None:
        rooms = node_rooms(nodes, settings.shares)
    normal_ms = normal.total_ms
    checks = tuple(
        [
            _check_node(request, n, normal_ms, settings, now_ms, r)
            for n, r in zip(nodes, rooms, strict=True)
        ]
    )
    passing = [c for c in checks if c.verdict is Reason.BORROWED]
    if len(passing) > 1:
        passing.sort(key=_rank)
    ranked = tuple(passing)
    if not settings.enabled:
        reason = Reason.BORROWING_DISABLED
    elif pool is None or demand.pool_wait_ms is None:
        reason = Reason.POOL_LOAD_MISSING
    elif not demand.holds:
        reason = Reason.NO_DEMAND
    elif ranked:
        reason = Reason.BORROWED
    elif any(c.verdict is Reason.NO_ROOM for c in checks):
        reason = Reason.NO_ROOM
    elif any(c.verdict is Reason.NO_BENEFIT for c in checks):
        reason = Reason.NO_BENEFIT
    else:
        reason = Reason.NO_LEASES
    # Every field built above, of its type: no validation (``trusted``), as for each check.
    return Plan.trusted(
        reason=reason,
        demand=demand,
        normal_path=normal,
        nodes=checks,
        ranked=ranked if reason is Reason.BORROWED else (),
    )
