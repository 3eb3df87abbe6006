"""A throwaway PKI made at test time (no key is ever committed): one CA, a server certificate
for localhost/127.0.0.1, and client certificates whose SAN is a SPIFFE URI."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class TestCA:
    """A CA in ``directory``; :meth:`issue` writes a certificate and key signed by it."""

    __test__ = False

    def __init__(self, directory: Path, name: str = "crossflow-test-ca") -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(self._name)
            .issuer_name(self._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert = self.dir / f"{name}.crt"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        name: str,
        *,
        uris: tuple[str, ...] = (),
        dns: tuple[str, ...] = (),
        common_name: str | None = None,
    ) -> Pair:
        """A certificate and key in ``<name>.crt``/``.key``, its subject's CN ``common_name``
        (``name`` by default), its SAN the ``uris`` and ``dns`` names (none: no SAN at all)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
        sans += [x509.DNSName(d) for d in dns]
        if dns:
            sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name or name)]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        pair = Pair(self.dir / f"{name}.crt", self.dir / f"{name}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key.write_bytes(_key_pem(key))
        return pair

    def server(self) -> Pair:
        return self.issue("broker", dns=("localhost",))

    def client(self, role: str, name: str, trust_domain: str = "crossflow") -> Pair:
        return self.issue(f"{role}-{name}", uris=(f"spiffe://{trust_domain}/{role}/{name}",))
