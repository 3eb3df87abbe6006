"""Builders shared by the store tests."""

from __future__ import annotations

from typing import Any

from crossflow_ctl.domain.models import Credits, Lease, NodeRole
from crossflow_ctl.store.base import Store

NOW = 1_700_000_000_000
MAX_TTL = 2_000


def credits(value: int = 100, **overrides: int) -> Credits:
    base = dict.fromkeys(
        ("compute_tokens", "kv_tokens", "kv_transfer_bytes", "output_tokens", "slots"), value
    )
    return Credits(**{**base, **overrides})


def lease(
    node_id: str = "d1",
    epoch: int = 1,
    version: int = 1,
    value: int = 100,
    ttl_ms: int = 1_000,
    last_notice_seq: int = 0,
    **kw: Any,
) -> Lease:
    if "credits" not in kw:
        kw["credits"] = credits(value) if kw.get("zero_reason") is None else Credits()
    return Lease(
        node_id=node_id,
        epoch=epoch,
        version=version,
        ttl_ms=ttl_ms,
        last_notice_seq=last_notice_seq,
        **kw,
    )


async def register(store: Store, *node_ids: str, now_ms: int = NOW) -> None:
    for node_id in node_ids:
        await store.register_node(node_id, NodeRole.DECODE, "default", {}, now_ms)
