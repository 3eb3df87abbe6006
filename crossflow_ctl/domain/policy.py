"""Policy settings: one validated model, shared by the broker, the CLI and the simulator."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from crossflow_ctl.domain.errors import FailedPrecondition, InvalidArgument
from crossflow_ctl.domain.models import (
    MAX_HORIZON_MS,
    Frozen,
    Shares,
    known_fields,
    validated,
    validated_from,
)

# GPT-OSS-120B-like: 2 (K and V) x 36 layers x 8 KV heads x 64 head dim x 2 bytes (bf16).
DEFAULT_KV_BYTES_PER_TOKEN = 2 * 36 * 8 * 64 * 2


class PolicySettings(Frozen):
    """Admission policy knobs (DESIGN.md §4); changed live with ``crossflowctl policy set``."""

    enabled: bool = True
    """Master switch: false answers NORMAL to every Admit."""
    shadow_mode: bool = False
    """Decide and record everything, but always answer NORMAL and debit nothing."""
    demand_threshold_ms: Annotated[float, Field(ge=0.0, le=600_000.0, allow_inf_nan=False)] = 200.0
    """Demand holds when the prefill pool's estimated wait is above this (or above a prompt's
    own threshold, when ``demand_prefill_ratio`` makes that lower)."""
    demand_prefill_ratio: (
        Annotated[float, Field(ge=0.0, le=1_000.0, allow_inf_nan=False)] | None
    ) = 1.0
    """A prompt's own Demand threshold, as a multiple of its prefill time on the prefill pool:
    for it the pool is behind once the wait is above ``min(demand_threshold_ms, ratio x its
    prefill time)``. A short prompt's TTFT is mostly queueing (a 100 ms wait triples that of a
    50 ms prefill) while a long one's is mostly its own prefill, so the pool is behind for short
    prompts sooner. None: every prompt uses ``demand_threshold_ms``."""
    benefit_margin_ms: Annotated[float, Field(ge=0.0, le=600_000.0, allow_inf_nan=False)] = 0.0
    """Borrowing must beat the normal path's TTFT by at least this much."""
    borrow_share: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.5
    """Cluster-wide borrowing limit, as the share of every decode node's lease that may be lent.

    Applied per node inside the node's own atomic check-and-debit, so the sum of borrowed credit
    over the whole cluster never exceeds ``borrow_share`` x the sum of leases, without any
    cross-slot operation (Redis Cluster safe). The rest stays free for requests already coming
    from the prefill pool. On the KV credits ``borrow_kv_share`` applies instead."""
    borrow_kv_share: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    """The borrowing limit on the KV credits, kv and kv_transfer, as ``borrow_share`` is on the
    others (compute, output, slots).

    The share keeps free what the node's own work needs, and that differs by credit. Borrowed
    compute, output and slots are work the node takes on only on the borrowed path: they slow
    its batch (ITL) and crowd its own decode. KV is not: a request's KV (its prompt, a pulled-in
    prefix, its output) lands on a decode node whichever path it takes, and the lease's KV
    credit is already net of the reserve for the running requests' growth and of the KV
    promised to the engine's waiting queue (requests transferred from the prefill pool). The
    kv_transfer credit is how that KV comes in, capped by the KV credit in bytes; the agent
    sets its share of the network (``LeaseSettings.kv_transfer_share``). At ``borrow_share``
    0.5 no 1M-token node could ever take a prompt with a 500k-token prefix, which then queued
    for prefill and took the same KV on a decode node anyway; on the agentic sample at 4x
    (2P4D, seeds 0-3) those were 22 of the 39 prompts held or queued over 5 s. Lower it to
    keep part of every node's KV for requests still in prefill, whose KV is not in the node's
    queue yet."""
    hold_ttl_ms: Annotated[int, Field(gt=0, le=600_000)] = 2_000
    """A HELD reservation not committed within this expires."""
    commit_ttl_ms: Annotated[int, Field(gt=0, le=3_600_000)] = 30_000
    """A COMMITTED reservation not released within this expires. Must outlast the horizon."""
    max_lease_ttl_ms: Annotated[int, Field(gt=0, le=60_000)] = 2_000
    """Cap on a lease's TTL, counted from receipt on the broker's clock."""
    borrow_horizon_ms: Annotated[int, Field(gt=0, le=MAX_HORIZON_MS)] = 8_000
    """How long borrowed work may run; agents size compute and output credit over it.

    Four TTFT targets (2 s) by default. The horizon caps how much borrowed prefill a node takes
    on; whether a prompt is better off borrowed is Benefit's call (predicted wait + service
    against the normal path's), so a longer horizon does not let a prompt borrow into a worse
    TTFT. A horizon of one TTFT target refused every prompt whose own prefill needs more than
    horizon x share of a node, however long the pool's queue: on the agentic sample at 16x
    (prompts 10-60k tokens over 100k+ prefixes) those were the p99, and 8 s took leases from
    losing to winning against the threshold heuristic on mean and p99 TTFT there, Mooncake cells
    moving by at most about 1% (the README's simulator section gives the sweep). The commit TTL
    must outlast it."""
    kv_bytes_per_token: Annotated[int, Field(gt=0, le=100_000_000)] = DEFAULT_KV_BYTES_PER_TOKEN
    """KV bytes per token of the served model, for transfer-time and transfer-credit estimates."""
    kv_transfer_bytes_per_s: Annotated[float, Field(gt=0.0, le=1e13, allow_inf_nan=False)] = 25e9
    """Network bandwidth between servers for KV transfer (prefill to decode, remote prefixes)."""
    default_prefill_rate_tps: Annotated[float, Field(gt=0.0, le=1e9, allow_inf_nan=False)] = (
        20_000.0
    )
    """Per-request prefill rate of the prefill pool when its agents do not report one."""
    candidate_sample: Annotated[int, Field(ge=1, le=64)] = 8
    """Nodes sampled when the router names no candidates (cost stays flat with fleet size)."""
    admit_timeout_ms: Annotated[int, Field(ge=1, le=10_000)] = 50
    """Admission answers NORMAL (fail closed) when the store takes longer than this."""

    @property
    def shares(self) -> Shares:
        """The borrow share of each credit: ``borrow_kv_share`` on kv and kv_transfer,
        ``borrow_share`` on the others (what Safety applies, :mod:`crossflow_ctl.domain.safety`)."""
        share = self.borrow_share
        kv = self.borrow_kv_share
        return Shares(share, kv, kv, share, share)

    @model_validator(mode="after")
    def _commit_outlasts_horizon(self) -> PolicySettings:
        if self.commit_ttl_ms < self.borrow_horizon_ms:
            # A custom error: pydantic prefixes a ValueError's text with "Value error, ".
            raise PydanticCustomError(
                "commit_ttl_below_horizon",
                "commit_ttl_ms ({commit}) must be at least borrow_horizon_ms ({horizon}): an "
                "expired committed reservation may still run (raise commit_ttl_ms, or lower "
                "borrow_horizon_ms)",
                {"commit": self.commit_ttl_ms, "horizon": self.borrow_horizon_ms},
            )
        return self

    def updated(self, updates: dict[str, Any]) -> PolicySettings:
        """A copy with ``updates`` applied and validated; raises InvalidArgument naming the key."""
        unknown = sorted(set(updates) - set(type(self).model_fields))
        if unknown:
            raise InvalidArgument(f"unknown policy setting {unknown[0]!r}", field=unknown[0])
        return validated(PolicySettings, **{**self.model_dump(), **updates})


class RetiredHorizon(Frozen):
    """A borrow horizon a policy change lowered, and until when (this replica's clock, ms) leases
    sized over it, and reservations granted against them, may still be committed (see
    :func:`retire_horizon`)."""

    horizon_ms: int
    until_ms: int


def retire_horizon(
    old: PolicySettings, new: PolicySettings, now_ms: int, refresh_ms: int
) -> RetiredHorizon | None:
    """What lowering the horizon from ``old``'s to ``new``'s at ``now_ms`` leaves in force, None
    when it was not lowered. An agent may size leases over the old horizon until its replica
    holds the new policy (``refresh_ms``, the replicas' re-read period) and pushes it (from then
    on that replica also caps the leases it ingests: :func:`crossflow_ctl.domain.session.
    within_horizon`); such a lease lives up to ``max_lease_ttl_ms`` after, and a reservation
    granted against it is committed within ``hold_ttl_ms``: the longest of either policy."""
    if new.borrow_horizon_ms >= old.borrow_horizon_ms:
        return None
    settle = (
        refresh_ms
        + max(old.max_lease_ttl_ms, new.max_lease_ttl_ms)
        + max(old.hold_ttl_ms, new.hold_ttl_ms)
    )
    return RetiredHorizon(horizon_ms=old.borrow_horizon_ms, until_ms=now_ms + settle)


def check_retired_horizons(
    policy: PolicySettings, retired: Iterable[RetiredHorizon], now_ms: int
) -> None:
    """FailedPrecondition naming ``commit_ttl_ms`` when ``policy``'s commit TTL is below a horizon
    still in force at ``now_ms``: a reservation committed now may run prefill sized over it
    (DESIGN.md §4). Lowering the horizon and the commit TTL together takes two writes, the
    second once the first has settled."""
    for old in retired:
        if now_ms < old.until_ms and policy.commit_ttl_ms < old.horizon_ms:
            raise FailedPrecondition(
                f"commit_ttl_ms ({policy.commit_ttl_ms}) must stay at least {old.horizon_ms} "
                f"for {old.until_ms - now_ms} ms more: leases may still be sized over that "
                f"borrow horizon until agents adopt the lowered one; retry the commit TTL then "
                f"(lowering both takes two writes: the horizon first)",
                field="commit_ttl_ms",
            )


MAX_POLICY_UPDATES = 64
"""Most settings one SetPolicy may change (the policy has fewer knobs than this)."""
MAX_POLICY_VALUE_CHARS = 256
"""Longest text value of one update: every setting is a JSON scalar."""


class VersionedPolicy(Frozen):
    """The shared policy with its resource version (like a Kubernetes ``resourceVersion``).

    Every write raises the version by one; a write naming an ``expected_version`` that is not
    the stored one is refused (ABORTED) and changes nothing, so concurrent operators cannot
    overwrite each other unseen. Version 0 means "never written"."""

    policy: PolicySettings
    version: Annotated[int, Field(ge=0, lt=2**63)] = 0
    unknown_fields: tuple[str, ...] = ()
    """Fields of the stored policy this version does not know (a newer replica wrote it during
    a rolling upgrade): the settings above apply without them, and this replica refuses to write
    the policy (the write would drop them): :func:`stored_policy`."""

    def check_writable(self) -> None:
        """Refuse a write based on a policy whose fields this version cannot carry over."""
        if self.unknown_fields:
            raise FailedPrecondition(
                f"the stored policy (version {self.version}) holds settings this broker does "
                f"not know ({', '.join(self.unknown_fields)}): a newer replica wrote it; change "
                "the policy through an upgraded replica",
                field="policy",
            )


def stored_policy(data: object) -> tuple[PolicySettings, tuple[str, ...]]:
    """A stored policy's settings and the names of its fields this version does not know.

    Unknown fields are set aside, not refused: in a rolling upgrade a newer replica may write a
    setting an older one lacks, and refusing the whole policy would leave the older replica on a
    stale one (or none). Invalid values of known fields are refused (InvalidArgument). A policy
    stored before ``borrow_kv_share`` existed keeps its one ``borrow_share`` on the KV credits
    too (what it meant when written; ``policy set borrow_kv_share=...`` changes it)."""
    if not isinstance(data, dict):
        raise InvalidArgument("the stored policy is not a JSON object", field="policy")
    if "borrow_kv_share" not in data and "borrow_share" in data:
        # Stored before the KV credits had a share of their own: one share held every credit,
        # and an upgrade must not loosen the operator's limit on KV behind their back.
        data = {**data, "borrow_kv_share": data["borrow_share"]}
    kept, unknown = known_fields(PolicySettings, data)
    return validated_from(PolicySettings, kept), unknown


def parse_policy_updates(updates: dict[str, str]) -> dict[str, Any]:
    """Text values (as SetPolicy carries them) to JSON scalars: ``"0.3"`` -> 0.3, ``"true"``
    -> True, anything that is not JSON stays text. InvalidArgument naming the key for too many
    updates, an over-long value, or a JSON object or array (no setting takes one, and a deeply
    nested one must not reach the parser's recursion limit)."""
    if len(updates) > MAX_POLICY_UPDATES:
        raise InvalidArgument(
            f"at most {MAX_POLICY_UPDATES} updates, got {len(updates)}", field="updates"
        )
    known = PolicySettings.model_fields
    out: dict[str, Any] = {}
    for key, text in updates.items():
        if key not in known:
            raise InvalidArgument(
                f"unknown policy setting {key[:64]!r}", field=f"updates.{key[:64]}"
            )
        field = f"updates.{key}"
        if len(text) > MAX_POLICY_VALUE_CHARS:
            raise InvalidArgument(
                f"value longer than {MAX_POLICY_VALUE_CHARS} characters", field=field
            )
        if text.lstrip().startswith(("{", "[")):
            raise InvalidArgument("must be a scalar, not a JSON object or array", field=field)
        try:
            out[key] = json.loads(text)
        except ValueError:  # not JSON (plain text) or a number out of range
            out[key] = text
    return out
