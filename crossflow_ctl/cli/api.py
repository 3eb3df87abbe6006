"""The CLI's one door to the broker: a session over the public client library.

Commands call these methods and get the client library's domain values back. The channel is
secured as the context (or the global flags) say: TLS, mutual TLS, a bearer token
(crossflow_ctl.security.channel).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import click
import grpc

from crossflow_ctl.cli.exit_codes import CliError, ExitCode
from crossflow_ctl.client import AdminClient, AdmissionClient, NodeDetailView, NodeView
from crossflow_ctl.client.base import channel_options
from crossflow_ctl.domain.admission import Admission, AdmissionRequest
from crossflow_ctl.domain.errors import (
    Aborted,
    BrokerUnavailable,
    FailedPrecondition,
    NotFound,
    StoreUnavailable,
    Unauthenticated,
)
from crossflow_ctl.domain.models import NodeRole, PoolSnapshot, Reservation
from crossflow_ctl.domain.policy import VersionedPolicy
from crossflow_ctl.security import ClientCredentials
from crossflow_ctl.security.channel import open_channel


@dataclass(frozen=True)
class Target:
    server: str
    credentials: ClientCredentials = field(default_factory=ClientCredentials)
    timeout_s: float = 5.0


def _channel(target: Target) -> grpc.aio.Channel:
    return open_channel(target.server, target.credentials, channel_options())


def _identity_hint(target: Target) -> str:
    """What a refused identity most likely means, from what the caller gave."""
    creds, server = target.credentials, target.server
    given = [
        f"{flag} {path}"
        for flag, path in (("--token-file", creds.token_file), ("--cert-file", creds.cert_file))
        if path is not None
    ]
    if given:
        return (
            f"the broker at {server} refused the identity given ({', '.join(given)}): check "
            "that it is one the broker knows (its token hashes, or a certificate its client CA "
            "signed); `crossflowctl config view` shows what the context gives"
        )
    return (
        f"the broker at {server} authenticates callers: give --token-file FILE, or --ca-file "
        "with --cert-file and --key-file, or a context that has them; `crossflowctl config "
        "view` shows what the context gives"
    )


def _tls_hint(error: str, creds: ClientCredentials) -> str:
    """What a connection closed during set-up most likely means: the two ends disagree on TLS
    (it read "is a broker serving there?" of a broker that was)."""
    text = error.lower()
    if "hostname verification" in text:
        return (
            "the broker's certificate is not for this address: give --server-name with the "
            "name it is for; "
        )
    if "handshake" in text and creds.tls:
        return (
            "the TLS handshake failed: a broker serving plaintext (leave out --ca-file), or a "
            "certificate that does not match --ca-file or --server-name; "
        )
    if "socket closed" not in text:
        return ""
    if not creds.tls:
        return (
            "the connection was closed during set-up: a broker serving TLS needs --ca-file "
            "(and, for mutual TLS, --cert-file and --key-file); "
        )
    if creds.cert_file is None:
        return (
            "the connection was closed during set-up: a broker asking for client certificates "
            "(mutual TLS) needs --cert-file and --key-file; "
        )
    return "the connection was closed during set-up: is the client certificate the broker's CA's? "


class BrokerSession:
    """Admin and Admission clients on one channel, opened with ``async with``."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._channel: grpc.aio.Channel | None = None
        self._admin: AdminClient | None = None
        self._admission: AdmissionClient | None = None
        self._warned: set[str] = set()

    async def __aenter__(self) -> BrokerSession:
        self._channel = _channel(self.target)
        timeout = self.target.timeout_s
        self._admin = AdminClient(self.target.server, timeout_s=timeout, channel=self._channel)
        self._admission = AdmissionClient(
            self.target.server, timeout_s=timeout, channel=self._channel
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._admin = self._admission = None

    @property
    def admin(self) -> AdminClient:
        if self._admin is None:
            raise RuntimeError("BrokerSession used outside 'async with'")
        return self._admin

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except Exception as exc:
            error = self._cli_error(exc)
            if error is None:
                raise
            raise error from None

    def _cli_error(self, exc: Exception) -> CliError | None:
        """The one-line error and exit code for a failed call (None: the error as it is)."""
        if isinstance(exc, StoreUnavailable):
            return CliError(
                f"broker at {self.target.server} answered, but its store is unavailable: {exc} "
                "(check the Redis its redis_url names: the broker's log says which)",
                ExitCode.UNAVAILABLE,
            )
        if isinstance(exc, BrokerUnavailable):
            return CliError(
                f"cannot reach the broker at {self.target.server}: {exc} ("
                + (_tls_hint(str(exc), self.target.credentials) or "is a broker serving there? ")
                + "pass --server HOST:PORT, or see `crossflowctl config view`)",
                ExitCode.UNAVAILABLE,
            )
        if isinstance(exc, Unauthenticated):
            return CliError(f"{exc} ({_identity_hint(self.target)})", ExitCode.DENIED)
        if isinstance(exc, NotFound) and exc.field == "node_id":
            return CliError(f"{exc} (`crossflowctl get nodes` lists them)", ExitCode.NOT_FOUND)
        return None

    async def list_nodes(self, role: NodeRole | None, selector: str) -> list[NodeView]:
        """The nodes; what the broker says about itself (``--insecure``, say) goes to stderr,
        each sentence once per session (a watch repeats no line)."""
        result: list[NodeView] = await self._call(self.admin.list_nodes(role, selector))
        for warning in self.admin.broker_warnings:
            if warning not in self._warned:
                self._warned.add(warning)
                click.echo(f"warning: {warning}", err=True)
        return result

    async def find_nodes(self, names: Sequence[str]) -> tuple[list[NodeView], list[str]]:
        """(the nodes named, in order, each once; the names the broker does not know)."""
        found: list[NodeView] = []
        missing: list[str] = []
        for name in dict.fromkeys(names):
            try:
                detail: NodeDetailView = await self.admin.get_node(name)
            except NotFound as exc:
                if exc.field != "node_id":
                    raise
                missing.append(name)
                continue
            except Exception as exc:
                error = self._cli_error(exc)
                if error is None:
                    raise
                raise error from None
            found.append(detail.node)
        return found, missing

    async def get_node(self, name: str) -> NodeView:
        detail: NodeDetailView = await self._call(self.admin.get_node(name))
        return detail.node

    async def describe_node(self, name: str) -> NodeDetailView:
        result: NodeDetailView = await self._call(self.admin.get_node(name))
        return result

    async def list_reservations(self, node: str | None) -> list[Reservation]:
        result: list[Reservation] = await self._call(self.admin.list_reservations(node))
        return result

    async def list_pools(self) -> list[PoolSnapshot]:
        result: list[PoolSnapshot] = await self._call(self.admin.list_pools())
        return result

    async def cordon(self, name: str, reason: str) -> NodeView:
        result: NodeView = await self._call(self.admin.cordon(name, reason))
        return result

    async def uncordon(self, name: str) -> NodeView:
        result: NodeView = await self._call(self.admin.uncordon(name))
        return result

    async def delete_node(self, name: str, force: bool) -> int:
        try:
            result: int = await self._call(self.admin.delete_node(name, force))
        except FailedPrecondition as exc:
            if exc.field != "force":
                raise
            message = f"{exc.message}: use --force to delete it anyway"
            raise CliError(message, ExitCode.ERROR) from None
        return result

    async def get_policy(self) -> VersionedPolicy:
        result: VersionedPolicy = await self._call(self.admin.get_policy())
        return result

    async def set_policy(self, updates: dict[str, str], expected_version: int) -> VersionedPolicy:
        try:
            result: VersionedPolicy = await self._call(
                self.admin.set_policy(dict(updates), expected_version)
            )
        except Aborted as exc:
            raise CliError(
                f"policy changed meanwhile ({exc.message}); read it again and retry",
                ExitCode.ERROR,
            ) from None
        return result

    async def admit(self, request: AdmissionRequest) -> Admission:
        if self._admission is None:
            raise RuntimeError("BrokerSession used outside 'async with'")
        result: Admission = await self._call(self._admission.admit(request))
        return result
