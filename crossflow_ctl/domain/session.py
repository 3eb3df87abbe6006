"""What a broker tells each connected agent, and how it holds leases to it until agents adopt it.

An agent sizes its lease over the borrow horizon and reads its grants' transfer bytes in the KV
bytes per token its broker announced: in the Welcome at connect, then in a
``SessionSettings`` message each time the shared policy changes them while the stream is open
(every replica pushes them down its own streams when the policy version it holds changes). The
agent adopts them on its next lease.

Until it does (one agent period after the push; never, for an agent that predates the message),
its lease may still be sized over an older horizon. DESIGN.md §4 needs the commit TTL to
outlast the longest borrowed prefill the horizon allows, so two guards hold the gap:

* :func:`within_horizon`: the replica that ingests a lease caps its compute credit to what the
  lease's own rate and queue wait allow over the replica's current horizon, so borrowed prefill
  granted against it fits the horizon the commit TTL was checked against, whatever horizon the
  agent used; and scales its output and kv_transfer credits by the replica's horizon over the
  one the lease says it was sized over (``Lease.horizon_ms``; as sent when it does not say);
* :func:`crossflow_ctl.domain.policy.check_retired_horizons` (at ``policy set``): the commit
  TTL may not go below a horizon the policy had until the leases sized over it, and the grants
  made against them, are gone (policy refresh + lease TTL + hold TTL after the change).
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import Field

from crossflow_ctl.domain.models import Credits, Frozen, Lease
from crossflow_ctl.domain.policy import VersionedPolicy


class SessionSettings(Frozen):
    """The policy-derived settings an agent's stream carries (Welcome, SessionSettings)."""

    max_lease_ttl_ms: Annotated[int, Field(ge=0)]
    borrow_horizon_ms: Annotated[int, Field(ge=0)]
    """0: not told (an older broker); the agent then keeps its own."""
    kv_bytes_per_token: Annotated[int, Field(ge=0)]
    policy_version: Annotated[int, Field(ge=0)] = 0

    @classmethod
    def of(cls, versioned: VersionedPolicy) -> SessionSettings:
        policy = versioned.policy
        return cls.trusted(
            max_lease_ttl_ms=policy.max_lease_ttl_ms,
            borrow_horizon_ms=policy.borrow_horizon_ms,
            kv_bytes_per_token=policy.kv_bytes_per_token,
            policy_version=versioned.version,
        )

    def differs_from(self, other: SessionSettings) -> bool:
        """Whether an agent told ``other`` must be told these (the version alone is not news)."""
        return self.model_copy(update={"policy_version": other.policy_version}) != other


def horizon_compute_tokens(lease: Lease, horizon_ms: int) -> int | None:
    """The most compute credit ``lease`` can offer over ``horizon_ms``: its borrowed-prefill rate
    x (the horizon - its queue wait), the agent's own sizing
    (:mod:`crossflow_ctl.domain.lease_credits`), rounded up. None when the lease has no rate
    (nothing to size by)."""
    rate = lease.borrowed_prefill_rate_tps
    if rate <= 0.0:
        return None
    seconds = max(0.0, horizon_ms / 1000.0 - lease.queue_wait_ms / 1000.0)
    return math.ceil(rate * seconds)


def within_horizon(lease: Lease, horizon_ms: int) -> Lease:
    """``lease`` with its credits capped to what ``horizon_ms`` allows (the same lease when they
    are within it: a lease sized over ``horizon_ms`` or a shorter one).

    Compute to :func:`horizon_compute_tokens`, from the lease's own rate and queue wait. The
    output credit (``b x H / t(B + b)``, b the slots, t the step with them) and the kv_transfer
    one (``min(network x H x share, kv x bytes/token)``) are sized over the agent's horizon H too,
    so they scale by ``horizon_ms / H`` when the lease says its H (``Lease.horizon_ms``) and it is
    longer: floor, under one token or byte below exact (and a kv_transfer credit that the kv
    bytes bounded, not the network, ends below exact, never above).

    A lease from an agent older than the field (0) keeps them as sent, as before it: the compute
    credit brackets H only through the reference agent's arithmetic, and what the replica last
    told the stream may not be adopted yet (or ever, by an older agent). Such an output credit
    is looser than it should be, no more: each output debit is at most ``ceil(horizon_ms /
    ITL)`` tokens for a lease that states its ITL or SLO (``horizon_output_tokens``), and slots
    bound how many are open."""
    credits = lease.credits
    update: dict[str, int] = {}
    cap = horizon_compute_tokens(lease, horizon_ms)
    if cap is not None and credits.compute_tokens > cap:
        update["compute_tokens"] = cap
    sized_over = lease.horizon_ms
    if sized_over > horizon_ms:
        update["output_tokens"] = credits.output_tokens * horizon_ms // sized_over
        update["kv_transfer_bytes"] = credits.kv_transfer_bytes * horizon_ms // sized_over
    if not update:
        return lease
    capped = Credits.trusted(**{**credits.model_dump(), **update})
    return lease.model_copy(update={"credits": capped})
