"""The CLI's one door to the broker: a session over the public client library.

Commands call these methods and get domain values back; nothing here knows gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from crossflow_ctl.domain.admission import Admission, AdmissionRequest
from crossflow_ctl.domain.models import Lease, NodeRole, NodeState, PoolSnapshot, Reservation
from crossflow_ctl.domain.policy import PolicySettings


@dataclass(frozen=True)
class Target:
    server: str
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    timeout_s: float = 5.0


@dataclass(frozen=True)
class NodeEventView:
    at_ms: int
    kind: str
    message: str


@dataclass(frozen=True)
class NodeDetail:
    node: NodeState
    reservations: list[Reservation] = field(default_factory=list)
    recent_leases: list[Lease] = field(default_factory=list)
    events: list[NodeEventView] = field(default_factory=list)


class BrokerSession:
    """Admin and Admission clients on one target, opened with ``async with``."""

    def __init__(self, target: Target) -> None:
        self.target = target

    async def __aenter__(self) -> BrokerSession:
        raise NotImplementedError("client library not wired yet")

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    async def list_nodes(self, role: NodeRole | None, selector: str) -> list[NodeState]:
        raise NotImplementedError

    async def get_node(self, name: str) -> NodeState:
        raise NotImplementedError

    async def describe_node(self, name: str) -> NodeDetail:
        raise NotImplementedError

    async def list_reservations(self, node: str | None) -> list[Reservation]:
        raise NotImplementedError

    async def list_pools(self) -> list[PoolSnapshot]:
        raise NotImplementedError

    async def cordon(self, name: str, reason: str) -> NodeState:
        raise NotImplementedError

    async def uncordon(self, name: str) -> NodeState:
        raise NotImplementedError

    async def get_policy(self) -> PolicySettings:
        raise NotImplementedError

    async def set_policy(self, updates: dict[str, str]) -> PolicySettings:
        raise NotImplementedError

    async def admit(self, request: AdmissionRequest) -> Admission:
        raise NotImplementedError
