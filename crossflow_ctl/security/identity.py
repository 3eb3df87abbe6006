"""Caller identities: a role (node, router, admin) and a name.

Certificates carry the identity as a SPIFFE URI in their subjectAltName::

    spiffe://crossflow/node/gpu-7        the agent of node gpu-7 (may publish only for gpu-7)
    spiffe://crossflow/router/router-a   a router (Admit/Commit/Release of its own reservations)
    spiffe://crossflow/admin/alice       an operator (every RPC)

The trust domain (``crossflow``) is a setting. A certificate names its caller by exactly one
SPIFFE URI among its subjectAltName URIs (:func:`certificate_identity`): one with several is
refused (which would it be?), as is one whose only SPIFFE URI names no identity here; one with
none proves no identity (a bearer token still may). The common name is never read, even without
a SAN (gRPC reports the CN as the peer's identity then). Bearer tokens map to the same URIs
through a token file whose lines are ``sha256:<64 hex> <identity URI>`` (``#`` starts a
comment); only hashes are kept at rest and a presented token is compared, in constant time, with
every entry.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path

from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.domain.models import ID_PATTERN, MAX_ID_LEN, Frozen

_NAME = re.compile(ID_PATTERN)
_HASH = re.compile(r"^sha256:([0-9a-f]{64})$")
SPIFFE = "spiffe://"


class Role(StrEnum):
    NODE = "node"
    ROUTER = "router"
    ADMIN = "admin"


class Identity(Frozen):
    """An authenticated caller."""

    role: Role
    name: str

    @property
    def uri_path(self) -> str:
        """``<role>/<name>``: the form recorded as a reservation's owner."""
        return f"{self.role.value}/{self.name}"

    def uri(self, trust_domain: str) -> str:
        return f"{SPIFFE}{trust_domain}/{self.uri_path}"


def parse_identity_uri(uri: str, trust_domain: str) -> Identity | None:
    """The identity a SPIFFE URI names in ``trust_domain``; None for any other URI."""
    prefix = f"{SPIFFE}{trust_domain}/"
    if not uri.startswith(prefix):
        return None
    role, sep, name = uri[len(prefix) :].partition("/")
    if not sep or role not in Role.__members__.values():
        return None
    if len(name) > MAX_ID_LEN or not _NAME.fullmatch(name):
        return None
    return Identity(role=Role(role), name=name)


class CertificateRefused(ValueError):
    """A verified client certificate that names no single acceptable identity (the message
    says why, for the caller)."""


def certificate_identity(uri_sans: Sequence[str], trust_domain: str) -> Identity | None:
    """The identity of a verified client certificate from its URI SANs (``uri_sans``; never its
    common name): the one SPIFFE URI among them, when it names an identity in
    ``trust_domain``. None when there is no SPIFFE URI at all; :class:`CertificateRefused` when
    there are several (the scheme compared without case, as URIs do) or the one there is names
    no identity here."""
    spiffe = [uri for uri in uri_sans if uri[: len(SPIFFE)].lower() == SPIFFE]
    if not spiffe:
        return None
    if len(spiffe) > 1:
        raise CertificateRefused(
            f"the client certificate has {len(spiffe)} SPIFFE URI SANs "
            f"({', '.join(spiffe)}); exactly one must name the caller"
        )
    who = parse_identity_uri(spiffe[0], trust_domain)
    if who is None:
        raise CertificateRefused(
            f"the client certificate's SPIFFE URI SAN {spiffe[0]!r} is not "
            f"{SPIFFE}{trust_domain}/<node|router|admin>/<name>"
        )
    return who


def hash_token(token: str) -> str:
    """The at-rest form of a bearer token: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


class TokenTable:
    """Token hashes -> identities, from a token file (module docstring)."""

    def __init__(self, entries: list[tuple[bytes, Identity]]) -> None:
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    @classmethod
    def load(cls, path: Path, trust_domain: str, field: str = "auth.token_file") -> TokenTable:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read token file {path}: {exc}", field=field) from None
        entries: list[tuple[bytes, Identity]] = []
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            match = _HASH.fullmatch(parts[0]) if len(parts) == 2 else None
            who = parse_identity_uri(parts[1], trust_domain) if match else None
            if match is None or who is None:
                raise ConfigError(
                    f"{path}:{number}: want 'sha256:<64 hex> spiffe://{trust_domain}/"
                    "<node|router|admin>/<name>'",
                    field=field,
                )
            entries.append((bytes.fromhex(match.group(1)), who))
        if not entries:
            raise ConfigError(f"token file {path} holds no token", field=field)
        return cls(entries)

    def lookup(self, token: str) -> Identity | None:
        """The identity of ``token``; every entry is compared (constant time per entry)."""
        digest = hashlib.sha256(token.encode()).digest()
        found: Identity | None = None
        for stored, who in self._entries:
            if hmac.compare_digest(stored, digest):
                found = who
        return found
