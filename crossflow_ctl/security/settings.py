"""Settings models for transport security, nested into each process's one settings model.

``ClientCredentials`` (agent ``broker_auth``, crossflowctl contexts, the client library): a CA
bundle turns TLS on; a certificate and key add mutual TLS; ``server_name`` overrides the name
checked against the broker's certificate; ``token_file`` holds a bearer token sent as
``authorization: Bearer <token>`` on every call (for meshes that terminate TLS).

``AuthSettings`` (broker ``auth``): ``tls`` (server certificate and key; a client CA turns on
mutual TLS, required of every caller, and identities from certificates), a token file of hashes
(:mod:`.identity`), the SPIFFE trust domain, the services left open, and whether routers may use
the read-only admin RPCs. With neither a client CA nor a token file, callers are not
authenticated: the broker then serves on loopback only (the demo), unless ``insecure: true``
(``crossflow-broker serve --insecure``) says that something else guards the port; bearer tokens
beyond loopback need TLS, or ``insecure``. ``required: true`` refuses to start unauthenticated
even on loopback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from crossflow_ctl.domain.models import ID_PATTERN

OPEN_BY_DEFAULT = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ClientCredentials(_Model):
    """How a caller proves itself to the broker (and checks the broker)."""

    ca_file: Path | None = None
    """PEM CA bundle that signed the broker's certificate; setting it turns TLS on."""
    cert_file: Path | None = None
    """PEM client certificate (mutual TLS); needs ``key_file``."""
    key_file: Path | None = None
    """PEM private key of ``cert_file``."""
    server_name: Annotated[str, Field(max_length=253)] | None = None
    """Name to check the broker's certificate against instead of the host in the address."""
    token_file: Path | None = None
    """File holding a bearer token, sent as ``authorization: Bearer`` metadata."""

    @model_validator(mode="after")
    def _pairs(self) -> ClientCredentials:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file must be given together")
        if self.cert_file is not None and self.ca_file is None:
            raise ValueError("cert_file needs ca_file (mutual TLS runs over TLS)")
        return self

    @property
    def tls(self) -> bool:
        return self.ca_file is not None


class ServerTLS(_Model):
    cert_file: Path | None = None
    """PEM server certificate (chain); with ``key_file`` the broker serves TLS."""
    key_file: Path | None = None
    """PEM private key of ``cert_file``."""
    client_ca_file: Path | None = None
    """PEM CA bundle for client certificates: mutual TLS, required of every caller (grpc's
    Python server cannot ask for an optional one); identities from their SPIFFE URIs, else a
    bearer token."""

    @model_validator(mode="after")
    def _pairs(self) -> ServerTLS:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file must be given together")
        if self.client_ca_file is not None and self.cert_file is None:
            raise ValueError("client_ca_file needs cert_file and key_file (mTLS runs over TLS)")
        return self

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


class AuthSettings(_Model):
    """Who may call the broker, and what each caller may do."""

    required: bool = False
    """Refuse to start unless callers are authenticated (a client CA or a token file), even
    when listening on loopback only."""
    insecure: bool = False
    """Serve beyond loopback without authenticating callers, or with bearer tokens over
    plaintext (a mesh that encrypts and authenticates the traffic): refused otherwise. Logged
    as a warning at start and shown by ``crossflowctl get nodes``."""
    tls: ServerTLS = ServerTLS()
    token_file: Path | None = None
    """Token hashes to identities, one ``sha256:<hex> spiffe://<domain>/<role>/<name>`` a line."""
    trust_domain: Annotated[str, Field(min_length=1, max_length=253, pattern=ID_PATTERN)] = (
        "crossflow"
    )
    """SPIFFE trust domain of every identity (``spiffe://<trust_domain>/<role>/<name>``)."""
    open_services: tuple[str, ...] = OPEN_BY_DEFAULT
    """Fully qualified gRPC services anyone may call (health checks, reflection)."""
    routers_read_nodes: bool = True
    """Let routers call the read-only admin RPCs (ListNodes, GetNode, ListPools, GetPolicy)."""

    @property
    def authenticates(self) -> bool:
        return self.tls.client_ca_file is not None or self.token_file is not None
