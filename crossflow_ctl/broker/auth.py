"""Authentication and authorization of every broker RPC: one rule table, checked by the broker's
server interceptor (:mod:`crossflow_ctl.broker.interceptor`) before each call.

Who: the one SPIFFE URI SAN of the peer's verified client certificate (mutual TLS; never its
common name, and a certificate with several SPIFFE URIs, or one naming no identity of this
trust domain, is refused), else the identity of an ``authorization: Bearer <token>`` header
found in the token file (crossflow_ctl.security). Neither -> UNAUTHENTICATED. What:
:data:`RULES` names the roles allowed per service and method:

    LeaseService/*                  node (and only for its own node: checked on the stream)
    AdmissionService/*              router, admin (Commit/Release: own reservations, admin any)
    AdminService read-only RPCs     admin, and router when ``auth.routers_read_nodes``
    AdminService/* (the rest)       admin
    auth.open_services              anyone (health, reflection by default)

An RPC of a known service that the table does not list falls to its service's default, so a new
RPC is never open by accident; an unknown service is refused. The identity of the caller is
available to the servicers through :func:`caller` (a context variable set for the RPC).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar, Token
from typing import Any

import grpc
import structlog

from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.security import AuthSettings, Identity, Role, TokenTable
from crossflow_ctl.security.channel import read_ca_bundle, read_key_pair
from crossflow_ctl.security.identity import CertificateRefused, certificate_identity

log = structlog.get_logger()

_caller: ContextVar[Identity | None] = ContextVar("crossflow_caller", default=None)

LEASE = "crossflow.v1.LeaseService"
ADMISSION = "crossflow.v1.AdmissionService"
ADMIN = "crossflow.v1.AdminService"

SERVICE_DEFAULTS: dict[str, frozenset[Role]] = {
    LEASE: frozenset({Role.NODE}),
    ADMISSION: frozenset({Role.ROUTER, Role.ADMIN}),
    ADMIN: frozenset({Role.ADMIN}),
}
READ_ONLY_ADMIN = ("ListNodes", "GetNode", "ListPools", "GetPolicy")
"""Admin RPCs that change nothing and reveal no reservation id (ListReservations does)."""


def rules(settings: AuthSettings) -> dict[str, frozenset[Role]]:
    """Method path (``/pkg.Service/Method``) or service name -> the roles allowed."""
    table: dict[str, frozenset[Role]] = dict(SERVICE_DEFAULTS)
    if settings.routers_read_nodes:
        for method in READ_ONLY_ADMIN:
            table[f"/{ADMIN}/{method}"] = frozenset({Role.ADMIN, Role.ROUTER})
    return table


def caller() -> Identity | None:
    """The authenticated caller of the current RPC; None when the broker authenticates no one."""
    return _caller.get()


def reservation_owner() -> str:
    """What Admit records as the owner of a reservation: ``router/<name>``, or "" (no auth)."""
    who = _caller.get()
    return who.uri_path if who is not None else ""


def owner_filter() -> str | None:
    """The owner a Commit/Release must match: None (anyone) for admins and without auth."""
    who = _caller.get()
    if who is None or who.role is Role.ADMIN:
        return None
    return who.uri_path


PEER_URI = "peer_uri"
"""The auth context property holding the verified peer certificate's URI SANs, and only those
(``peer_identities()`` falls back to the common name when a certificate has no SAN)."""


def peer_identity(context: grpc.aio.ServicerContext, trust_domain: str) -> Identity | None:
    """The identity the verified client certificate names by its one SPIFFE URI SAN; None
    without a certificate or without a SPIFFE URI; CertificateRefused otherwise
    (:func:`~crossflow_ctl.security.identity.certificate_identity`)."""
    uris = (context.auth_context() or {}).get(PEER_URI) or ()
    return certificate_identity([raw.decode(errors="replace") for raw in uris], trust_domain)


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


Check = Callable[[grpc.aio.ServicerContext], Awaitable[Identity]]
"""Authenticates and authorizes one call of a method (aborting it when refused): its caller."""


def bind_caller(who: Identity) -> Token[Identity | None]:
    """Make ``who`` the caller of the current RPC (:func:`caller`); ``unbind_caller`` undoes it."""
    return _caller.set(who)


def unbind_caller(token: Token[Identity | None]) -> None:
    _caller.reset(token)


class Authorizer:
    """Authenticates the caller and applies :func:`rules`; the broker's interceptor
    (:mod:`crossflow_ctl.broker.interceptor`) runs :meth:`check_for`'s check before each call."""

    def __init__(self, settings: AuthSettings, tokens: TokenTable | None) -> None:
        self._settings = settings
        self._tokens = tokens
        self._rules = rules(settings)
        self._open = frozenset(settings.open_services)

    def allowed(self, method: str) -> frozenset[Role] | None:
        """The roles allowed to call ``method``; None when anyone may."""
        service = method.lstrip("/").partition("/")[0]
        if service in self._open:
            return None
        return self._rules.get(method, self._rules.get(service, frozenset()))

    def authenticate(
        self, context: grpc.aio.ServicerContext, metadata: Any
    ) -> tuple[Identity | None, str]:
        try:
            who = peer_identity(context, self._settings.trust_domain)
        except CertificateRefused as exc:  # ambiguous or foreign: no token makes up for it
            return None, str(exc)
        if who is not None:
            return who, ""
        token = _bearer(metadata)
        if token is not None and self._tokens is not None:
            who = self._tokens.lookup(token)
            return who, "" if who else "unknown bearer token"
        if token is not None:
            return None, "bearer tokens are not accepted by this broker"
        if context.auth_context().get("x509_subject"):
            return None, (
                "the client certificate has no SPIFFE URI SAN (its common name is not read) "
                "and no bearer token was sent"
            )
        return None, "no client certificate identity and no bearer token"

    def check_for(self, method: str) -> Check | None:
        """The check to run before each call of ``method``; None when it is open to anyone."""
        roles = self.allowed(method)
        if roles is None:
            return None

        async def check(context: grpc.aio.ServicerContext) -> Identity:
            who, why = self.authenticate(context, context.invocation_metadata())
            if who is None:
                log.info("auth.unauthenticated", method=method, why=why)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"authorization: {why}")
                raise AssertionError("unreachable: abort raises")
            if who.role not in roles:
                log.info("auth.denied", method=method, identity=who.uri_path)
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"authorization: {who.uri_path} may not call {method}",
                )
            return who

        return check


def server_credentials(settings: AuthSettings) -> grpc.ServerCredentials | None:
    """TLS server credentials from ``settings.tls``; None when the broker serves plaintext."""
    tls = settings.tls
    if tls.cert_file is None or tls.key_file is None:
        return None
    cert, key = read_key_pair(
        tls.cert_file, tls.key_file, ("auth.tls.cert_file", "auth.tls.key_file")
    )
    client_ca = (
        read_ca_bundle(tls.client_ca_file, "auth.tls.client_ca_file")
        if tls.client_ca_file is not None
        else None
    )
    return grpc.ssl_server_credentials(
        [(key, cert)],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def load_tokens(settings: AuthSettings) -> TokenTable | None:
    if settings.token_file is None:
        return None
    return TokenTable.load(settings.token_file, settings.trust_domain)


def is_loopback(listen: str) -> bool:
    host = listen.rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def check_startup(settings: AuthSettings, listen: str) -> tuple[str, ...]:
    """Refuse to start (ConfigError naming the setting) a broker that would serve callers it
    cannot trust: unauthenticated when ``required``; beyond loopback, unauthenticated or with
    bearer tokens over plaintext, unless ``insecure``. Returns what an operator must be told
    (empty when secure): the caller logs it, and ``crossflowctl get nodes`` shows it."""
    if settings.required and not settings.authenticates:
        raise ConfigError(
            "auth.required is set but no caller can be authenticated: set "
            "auth.tls.client_ca_file (mutual TLS) or auth.token_file",
            field="auth.required",
        )
    if is_loopback(listen):
        return ()
    warnings: list[str] = []
    if not settings.authenticates:
        if not settings.insecure:
            raise ConfigError(
                f"listening on {listen}, beyond loopback, with no way to authenticate "
                "callers: anyone who reaches the port could publish leases for any node, admit, "
                "list reservations and change the policy. Set auth.tls.client_ca_file (mutual "
                "TLS) or auth.token_file with auth.tls, listen on 127.0.0.1, or pass --insecure "
                "(auth.insecure: true) when something else guards the port",
                field="auth.insecure",
            )
        warnings.append(
            f"INSECURE: the broker serves {listen} beyond loopback without authenticating "
            "callers (auth.insecure): anyone who reaches the port can publish leases for any "
            "node, admit, list reservations and change the policy"
        )
    if settings.token_file is not None and not settings.tls.enabled:
        if not settings.insecure:
            raise ConfigError(
                f"bearer tokens over plaintext on {listen}: anyone on the path could read and "
                "replay them. Serve TLS (auth.tls.cert_file and key_file), listen on 127.0.0.1 "
                "(a sidecar in the pod), or pass --insecure (auth.insecure: true) when a mesh "
                "encrypts the traffic",
                field="auth.token_file",
            )
        warnings.append(
            f"INSECURE: bearer tokens cross plaintext on {listen} (auth.insecure): anyone on "
            "the path can read and replay them"
        )
    return tuple(warnings)
