"""Domain values (as the client library returns them) turned into plain rows for output."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from crossflow_ctl.cli.output import Column
from crossflow_ctl.client import NodeView
from crossflow_ctl.domain.models import Credits, PoolSnapshot, Reservation, StoredLease


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def age_s(ms: int, at_ms: int | None = None) -> int | None:
    """Whole seconds since ``ms`` (None for an unset time): what json and yaml carry."""
    if ms <= 0:
        return None
    return max(0, ((at_ms if at_ms is not None else now_ms()) - ms) // 1000)


def duration(seconds: int | None) -> str:
    """kubectl-style age: 5s, 3m, 2h, 4d."""
    if seconds is None:
        return "<none>"
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def age(ms: int, at_ms: int | None = None) -> str:
    """kubectl-style age of a time: 5s, 3m, 2h, 4d."""
    return duration(age_s(ms, at_ms))


def _age_text(key: str) -> Callable[[Mapping[str, Any]], str | None]:
    def text(row: Mapping[str, Any]) -> str | None:
        return None if row.get(key) is None else duration(row[key])

    return text


def _expires_text(row: Mapping[str, Any]) -> str:
    left = row["expires_in_ms"]
    return "expired" if left <= 0 else f"{left}ms"


def _version_text(row: Mapping[str, Any]) -> str | None:
    return None if row.get("lease_version") is None else f"v{row['lease_version']}"


def credits_dict(credits: Credits) -> dict[str, int]:
    return credits.model_dump(mode="json")


def lease_dict(stored: StoredLease, at_ms: int) -> dict[str, Any]:
    lease = stored.lease
    return {
        "epoch": lease.epoch,
        "version": lease.version,
        "ttl_ms": lease.ttl_ms,
        "expired": stored.expired(at_ms),
        "received_at_ms": stored.received_at_ms,
        "expires_at_ms": stored.expires_at_ms,
        "zero_reason": lease.zero_reason.value if lease.zero_reason else None,
        "zero_detail": lease.zero_detail,
        "credits": credits_dict(lease.credits),
        "queue_wait_ms": lease.queue_wait_ms,
        "borrowed_prefill_rate_tps": lease.borrowed_prefill_rate_tps,
        "itl_ms": lease.itl_ms,
        "itl_slo_ms": lease.itl_slo_ms,
        "last_notice_seq": lease.last_notice_seq,
    }


def node_row(
    view: NodeView, at_ms: int, reporting: frozenset[tuple[str, str]] = frozenset()
) -> dict[str, Any]:
    """One node; ``available`` is what the broker says is left to lend (lease x share - debits);
    ``reporting``: as for :meth:`NodeView.status`."""
    node = view.state
    stored = node.lease
    available = view.available
    return {
        "name": node.info.node_id,
        "role": node.info.role.value,
        "pool": node.info.pool,
        "status": view.status(at_ms, reporting),
        "cordoned": node.info.cordoned,
        "cordon_reason": node.info.cordon_reason,
        "labels": dict(node.info.labels),
        "registered_at_ms": node.info.registered_at_ms or None,
        "age_s": age_s(node.info.registered_at_ms, at_ms),
        "lease_version": stored.lease.version if stored else None,
        "lease_epoch": stored.lease.epoch if stored else None,
        "lease_age_s": age_s(stored.received_at_ms, at_ms) if stored else None,
        "compute_tokens": available.compute_tokens,
        "kv_tokens": available.kv_tokens,
        "kv_transfer_bytes": available.kv_transfer_bytes,
        "output_tokens": available.output_tokens,
        "slots": available.slots,
        "open_reservations": node.open_reservations,
        "open_debits": credits_dict(node.open_debits),
        "itl_ms": stored.lease.itl_ms if stored else None,
        "itl_slo_ms": stored.lease.itl_slo_ms if stored else None,
        "queue_wait_ms": stored.lease.queue_wait_ms if stored else None,
        "notice_seq": node.info.notice_seq,
        "latest_lease": lease_dict(stored, at_ms) if stored else None,
    }


NODE_COLUMNS = [  # AVAIL-*: what is left to lend (lease x share - debits), not the lease
    Column("NAME", "name"),
    Column("ROLE", "role"),
    Column("STATUS", "status"),
    Column("LEASE", "lease_version", text=_version_text),
    Column("AVAIL-COMPUTE", "compute_tokens"),
    Column("AVAIL-KV", "kv_tokens"),
    Column("AVAIL-SLOTS", "slots"),
    Column("OPEN", "open_reservations"),
    Column("AGE", "age_s", text=_age_text("age_s")),  # since the node registered
    Column("POOL", "pool", wide=True),
    Column("EPOCH", "lease_epoch", wide=True),
    Column("AVAIL-OUTPUT", "output_tokens", wide=True),
    Column("AVAIL-KV-XFER-BYTES", "kv_transfer_bytes", wide=True),
    Column("ITL-MS", "itl_ms", wide=True, unset=0.0),  # 0: no step measured (idle)
    Column("SLO-MS", "itl_slo_ms", wide=True),
    Column("WAIT-MS", "queue_wait_ms", wide=True),
    Column("LABELS", "labels", wide=True),
]


def lease_row(view: NodeView, at_ms: int) -> dict[str, Any] | None:
    node = view.state
    stored = node.lease
    if stored is None:
        return None
    row = lease_dict(stored, at_ms)
    credits = row["credits"]
    return {
        "name": node.info.node_id,
        **row,
        "compute_tokens": credits["compute_tokens"],
        "kv_tokens": credits["kv_tokens"],
        "output_tokens": credits["output_tokens"],
        "kv_transfer_bytes": credits["kv_transfer_bytes"],
        "slots": credits["slots"],
        "expires_in_ms": stored.expires_at_ms - at_ms,
    }


def _epoch_version_text(row: Mapping[str, Any]) -> str:
    return f"{row['epoch']}/{row['version']}"


LEASE_COLUMNS = [
    Column("NODE", "name"),
    Column("EPOCH/VERSION", "version", text=_epoch_version_text),
    Column("COMPUTE", "compute_tokens"),
    Column("KV", "kv_tokens"),
    Column("OUTPUT", "output_tokens"),
    Column("SLOTS", "slots"),
    Column("ZERO-REASON", "zero_reason"),
    Column("EXPIRES-IN", "expires_in_ms", text=_expires_text),
    Column("KV-XFER-BYTES", "kv_transfer_bytes", wide=True),
    Column("ITL-MS", "itl_ms", wide=True, unset=0.0),  # 0: no step measured (idle)
    Column("SLO-MS", "itl_slo_ms", wide=True),
    Column("RATE-TPS", "borrowed_prefill_rate_tps", wide=True),
    Column("NOTICE-SEQ", "last_notice_seq", wide=True),
]


def reservation_row(res: Reservation, at_ms: int) -> dict[str, Any]:
    return {
        "id": res.reservation_id,
        "node": res.node_id,
        "state": res.state.value,
        "debit": credits_dict(res.debit),
        "compute_tokens": res.debit.compute_tokens,
        "kv_tokens": res.debit.kv_tokens,
        "lease_epoch": res.lease_epoch,
        "lease_version": res.lease_version,
        "created_at_ms": res.created_at_ms,
        "expires_at_ms": res.expires_at_ms,
        "age_s": age_s(res.created_at_ms, at_ms),
        "expires_in_ms": res.expires_at_ms - at_ms,
        "grant_seq": res.grant_seq,
        "release_seq": res.release_seq,
        "request_id": res.request_id,
        "owner": res.owner,
    }


def _reservation_lease_text(row: Mapping[str, Any]) -> str:
    return f"{row['lease_epoch']}/{row['lease_version']}"


RESERVATION_COLUMNS = [
    Column("ID", "id"),
    Column("NODE", "node"),
    Column("STATE", "state"),
    Column("COMPUTE", "compute_tokens"),
    Column("KV", "kv_tokens"),
    Column("AGE", "age_s", text=_age_text("age_s")),
    Column("EXPIRES-IN", "expires_in_ms", text=_expires_text),
    Column("LEASE", "lease_version", wide=True, text=_reservation_lease_text),
    Column("GRANT-SEQ", "grant_seq", wide=True),
    Column("RELEASE-SEQ", "release_seq", wide=True),
    Column("REQUEST", "request_id", wide=True),
    Column("OWNER", "owner", wide=True),  # the router it was granted to (with auth)
]


def pool_row(pool: PoolSnapshot) -> dict[str, Any]:
    wait = pool.estimated_wait_ms()
    return {
        "name": pool.pool,
        "reporting_nodes": len(pool.reports),
        "outstanding_uncached_tokens": pool.outstanding_uncached_tokens,
        "processing_rate_tps": pool.processing_rate_tps,
        "prefill_rate_tps": pool.prefill_rate_tps,
        "estimated_wait_ms": None if pool.no_rate else wait,
        "no_rate": pool.no_rate,
        "queued_requests": sum(r.queued_requests for r in pool.reports),
        "reports": [r.model_dump(mode="json") for r in pool.reports],
    }


def _wait_text(row: Mapping[str, Any]) -> str:
    if row["no_rate"]:
        return "no rate"
    wait = row["estimated_wait_ms"]
    return "-" if wait is None else f"{wait:.0f}"


POOL_COLUMNS = [
    Column("POOL", "name"),
    Column("NODES", "reporting_nodes"),
    Column("OUTSTANDING", "outstanding_uncached_tokens"),
    Column("RATE-TPS", "processing_rate_tps"),
    Column("WAIT-MS", "estimated_wait_ms", text=_wait_text),
    Column("QUEUED", "queued_requests", wide=True),
    Column("PREFILL-TPS", "prefill_rate_tps", wide=True),
]
