"""Every Redis key name, and the reservation id format, built in one place.

Per-node keys share the hash tag ``{<ns>:n:<node_id>}`` so that all of one node's state (info,
lease, reservations, notice stream, history, events) lives on one Redis Cluster slot and each
per-node Lua script touches one slot only. Global keys (node index, lender index, pools, policy)
carry their own tags and are never passed to a per-node script on a Cluster (on a standalone
Redis ``upsert_leases`` takes the node's lender index bucket too); the node and lender indexes
are split into ``INDEX_BUCKETS`` buckets by a CRC32 of the node id, each with its own tag.

Every key starts with ``<ns>:`` (before the tag) so one namespace's keys can be found with a
prefix scan (tests clean up this way); the slot is chosen by the first ``{...}`` only.

Reservation ids are ``<32 hex digits>@<node_id>``, so commit and release find the node's keys
from the id alone, with no global lookup.
"""

from __future__ import annotations

import functools
import hashlib
import re
import zlib
from dataclasses import dataclass

from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.models import MAX_ID_LEN

HISTORY_CAP = 32
"""Accepted leases kept per node for ``lease_history`` (Redis keeps up to 8 more between trims:
``upsert_leases.lua``; reads return at most this many)."""
EVENTS_CAP = 64
"""State-change events kept per node for ``node_events``."""
NOTICES_CAP = 10_000
"""Notices kept per node (about); an agent further behind resumes from the oldest kept."""

INDEX_BUCKETS = 16
"""The node and lender indexes are split into this many hash-tagged buckets, so that on Redis
Cluster they spread over the masters instead of making one hot slot."""
NODE_KEYS_CACHED = 4096
"""Nodes whose key names a process keeps built (least recently used beyond that)."""

_RESERVATION_ID = re.compile(r"^([0-9a-f]{32})@([A-Za-z0-9][A-Za-z0-9._-]*)$")


def new_reservation_id(node_id: str, bits: int) -> str:
    """A reservation id for ``node_id`` from 128 random bits."""
    return f"{bits & ((1 << 128) - 1):032x}@{node_id}"


def node_of_reservation(reservation_id: str) -> str:
    """The node a reservation id names; InvalidArgument when the id is malformed."""
    match = _RESERVATION_ID.fullmatch(reservation_id) if len(reservation_id) <= 200 else None
    if match is None or len(match.group(2)) > MAX_ID_LEN:
        raise InvalidArgument(
            f"malformed reservation id {reservation_id[:80]!r} (want <32 hex>@<node_id>)",
            field="reservation_id",
        )
    return match.group(2)


@dataclass(frozen=True, slots=True)
class NodeKeys:
    """The keys of one node; all share one hash tag (one Cluster slot)."""

    info: str
    """HASH: node info fields, cordon state, the notice sequence (``seq``) and running totals of
    the stored reservations' debits (``open``: "c1,c2,c3,c4,c5,count,us,timed", us the timed
    debits' node microseconds and timed their compute tokens: ``lua/_lib.lua`` cf_totals_of)."""
    lease: str
    """HASH: the stored lease, one field per value and nothing else (``redis_codec.LEASE_FIELDS``:
    ``ev``, ``epoch``, ``version``, ``exp``, ``zero``, ``c1``..``c5`` for the scripts, then the
    rest of the lease)."""
    reservations: str
    """HASH: reservation id -> reservation JSON."""
    notices: str
    """STREAM: notices, entry id ``<seq>-0``, capped with MAXLEN ~."""
    history: str
    """LIST: recent stored leases as JSON, newest first, capped."""
    events: str
    """LIST: recent node events as JSON, newest first, capped."""

    expiries: str
    """ZSET: reservation id scored by its expiry (ms), to purge without a scan."""


@functools.lru_cache(maxsize=NODE_KEYS_CACHED)
def _node_keys(namespace: str, node_id: str) -> NodeKeys:
    """A node's key names, built once (every debit, lease and notice read names them)."""
    tag = f"{namespace}:{{{namespace}:n:{node_id}}}"
    return NodeKeys(
        info=f"{tag}:info",
        lease=f"{tag}:lease",
        reservations=f"{tag}:res",
        notices=f"{tag}:notices",
        history=f"{tag}:history",
        events=f"{tag}:events",
        expiries=f"{tag}:exp",
    )


@dataclass(frozen=True, slots=True)
class Keys:
    namespace: str

    def node(self, node_id: str) -> NodeKeys:
        return _node_keys(self.namespace, node_id)

    def bucket(self, node_id: str) -> int:
        """The index bucket of ``node_id`` (stable across processes: CRC32, not ``hash``)."""
        return zlib.crc32(node_id.encode()) % INDEX_BUCKETS

    def nodes(self, bucket: int) -> str:
        """SET: the known node ids of one index bucket."""
        return f"{self.namespace}:{{{self.namespace}:g:{bucket}}}:nodes"

    def lenders(self, bucket: int) -> str:
        """ZSET: one bucket's nodes with a live non-zero lease and no cordon, scored by lease
        expiry (ms)."""
        return f"{self.namespace}:{{{self.namespace}:g:{bucket}}}:lenders"

    @property
    def notice_wakes(self) -> str:
        """Pub/sub channel: the id of every node whose notice stream grew (``cf_notice``)."""
        return f"{self.namespace}:notices"

    @property
    def pools(self) -> str:
        """SET: every pool name that has reported."""
        return f"{self.namespace}:{{{self.namespace}:g}}:pools"

    def pool(self, pool: str) -> str:
        """HASH: prefill node id -> stored pool load JSON (expiry inside)."""
        return f"{self.namespace}:{{{self.namespace}:p:{pool}}}:load"

    def pool_expiries(self, pool: str) -> str:
        """ZSET: prefill node id scored by its report's expiry (same tag as :meth:`pool`)."""
        return f"{self.namespace}:{{{self.namespace}:p:{pool}}}:exp"

    def pool_seq(self, pool: str) -> str:
        """STRING: the pool's last report ingest sequence, an INCR counter (same tag as
        :meth:`pool`)."""
        return f"{self.namespace}:{{{self.namespace}:p:{pool}}}:seq"

    @property
    def policy(self) -> str:
        """HASH: the shared policy: ``version`` and ``json`` (PolicySettings)."""
        return f"{self.namespace}:{{{self.namespace}:g}}:policy"

    def request(self, key: str) -> str:
        """STRING: one request record (idempotent retries); its own tag, hashed from ``key``
        (any text) so records spread over Cluster slots."""
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        return f"{self.namespace}:{{{self.namespace}:q:{digest}}}"
