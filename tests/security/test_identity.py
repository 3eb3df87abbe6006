"""Identities from SPIFFE URIs, the token file, the settings' checks and the hash-token command."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from crossflow_ctl.broker.__main__ import cli as broker_cli
from crossflow_ctl.broker.auth import Authorizer, is_loopback
from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.security import AuthSettings, ClientCredentials, Identity, Role, TokenTable
from crossflow_ctl.security.channel import check_credentials
from crossflow_ctl.security.identity import parse_identity_uri
from crossflow_ctl.service.config import load_settings


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("spiffe://crossflow/node/gpu-7", Identity(role=Role.NODE, name="gpu-7")),
        ("spiffe://crossflow/router/r.a_1", Identity(role=Role.ROUTER, name="r.a_1")),
        ("spiffe://crossflow/admin/alice", Identity(role=Role.ADMIN, name="alice")),
        ("spiffe://other/admin/alice", None),  # another trust domain
        ("spiffe://crossflow/root/alice", None),  # no such role
        ("spiffe://crossflow/admin/", None),
        ("spiffe://crossflow/admin/a/b", None),
        ("spiffe://crossflow/node/" + "x" * 129, None),
        ("https://crossflow/admin/alice", None),
    ],
)
def test_identity_uris(uri: str, expected: Identity | None) -> None:
    assert parse_identity_uri(uri, "crossflow") == expected


def test_hash_token_lines_load_and_only_the_token_matches(tmp_path: Path) -> None:
    runner = CliRunner()
    lines = []
    for token, who in (("tok-router", "router/r1"), ("tok-admin", "admin/ops")):
        result = runner.invoke(broker_cli, ["hash-token", who], input=token + "\n")
        assert result.exit_code == 0, result.output
        assert token not in result.output  # only the hash is written down
        lines.append(result.output.strip())
    path = tmp_path / "tokens"
    path.write_text("# comment\n\n" + "\n".join(lines) + "\n")
    table = TokenTable.load(path, "crossflow")
    assert len(table) == 2
    assert table.lookup("tok-router") == Identity(role=Role.ROUTER, name="r1")
    assert table.lookup("tok-admin") == Identity(role=Role.ADMIN, name="ops")
    assert table.lookup("tok-router ") is None and table.lookup("") is None
    bad = runner.invoke(broker_cli, ["hash-token", "root/x"], input="t\n")
    assert bad.exit_code == 2


@pytest.mark.parametrize(
    "content", ["", "# only a comment\n", "sha256:abc spiffe://crossflow/admin/a\n"]
)
def test_unusable_token_files_are_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "tokens"
    path.write_text(content)
    with pytest.raises(ConfigError) as refused:
        TokenTable.load(path, "crossflow")
    assert refused.value.field == "auth.token_file"


def test_settings_refuse_half_configured_tls(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(None, {"auth": {"tls": {"cert_file": str(tmp_path / "c")}}})
    assert refused.value.field == "auth.tls"
    with pytest.raises(ConfigError) as refused:
        load_settings(None, {"auth": {"tls": {"client_ca_file": str(tmp_path / "ca")}}})
    assert "client_ca_file needs cert_file" in str(refused.value)
    with pytest.raises(ValueError, match="cert_file needs ca_file"):
        ClientCredentials(cert_file=tmp_path / "c", key_file=tmp_path / "k")


def test_unreadable_credentials_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        check_credentials(ClientCredentials(ca_file=tmp_path / "missing.pem"))
    assert refused.value.field == "ca_file"
    token = tmp_path / "token"
    token.write_text("two words\n")
    with pytest.raises(ConfigError) as refused:
        check_credentials(ClientCredentials(token_file=token))
    assert refused.value.field == "token_file"


def test_tls_files_that_are_not_pem_are_refused_naming_the_setting(tmp_path: Path) -> None:
    """A CA, certificate or key file that was readable but not PEM (or a key of another
    certificate) was handed to gRPC as it was: crossflowctl and the agent then reported the
    broker as unreachable (exit 4, after gRPC's own C-core log lines) and the broker said
    "cannot listen on HOST:PORT: Failed to bind to address". Each is now refused where it is
    read, naming the setting, and the CLI exits 2."""
    from crossflow_ctl.broker.auth import server_credentials
    from crossflow_ctl.cli.ctl import cli as ctl_cli
    from crossflow_ctl.cli.exit_codes import ExitCode, exit_code_for, one_line
    from crossflow_ctl.security import ServerTLS
    from tests.security.pki import TestCA

    ca = TestCA(tmp_path / "pki")
    mine, other = ca.issue("a"), ca.issue("b")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    check_credentials(ClientCredentials(ca_file=ca.cert, cert_file=mine.cert, key_file=mine.key))
    cases = [
        (ClientCredentials(ca_file=junk), "ca_file", "holds no PEM certificate"),
        (ClientCredentials(ca_file=mine.key), "ca_file", "holds no PEM certificate"),
        (
            ClientCredentials(ca_file=ca.cert, cert_file=junk, key_file=mine.key),
            "cert_file",
            "holds no PEM certificate",
        ),
        (
            ClientCredentials(ca_file=ca.cert, cert_file=mine.cert, key_file=mine.cert),
            "key_file",
            "holds no PEM private key",
        ),
        (
            ClientCredentials(ca_file=ca.cert, cert_file=mine.cert, key_file=other.key),
            "cert_file",
            "is not the unencrypted private key of",
        ),
    ]
    for creds, field, words in cases:
        with pytest.raises(ConfigError, match=words) as refused:
            check_credentials(creds)
        assert refused.value.field == field
    server = ServerTLS(cert_file=junk, key_file=mine.key)
    with pytest.raises(ConfigError, match="holds no PEM certificate") as refused:
        server_credentials(AuthSettings(tls=server))
    assert refused.value.field == "auth.tls.cert_file"
    server = ServerTLS(cert_file=mine.cert, key_file=mine.key, client_ca_file=junk)
    with pytest.raises(ConfigError, match="holds no PEM certificate") as refused:
        server_credentials(AuthSettings(tls=server))
    assert refused.value.field == "auth.tls.client_ca_file"

    run = CliRunner().invoke(
        ctl_cli, ["--server", "127.0.0.1:1", "--ca-file", str(junk), "get", "nodes"]
    )
    assert isinstance(run.exception, ConfigError), run.output  # was: UNAVAILABLE, exit 4
    assert exit_code_for(run.exception) == ExitCode.USAGE
    assert one_line(run.exception).startswith("error: ca_file: ")


def test_tls_files_grpc_accepts_are_not_refused(tmp_path: Path) -> None:
    """The PEM checks refuse what gRPC refuses, no more: a CA bundle with UTF-8 labels between
    its certificates (p11-kit's) was refused as not ASCII, and an RSA-1024 key (OpenSSL's level 2
    rejects it, as it does SHA-1 signatures; gRPC serves and verifies both) as not the key of its
    certificate."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    from tests.security.pki import TestCA

    ca = TestCA(tmp_path / "pki")
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes("# Főtanúsítvány\n".encode() + ca.cert.read_bytes())
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "old")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "old.crt", tmp_path / "old.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    check_credentials(ClientCredentials(ca_file=bundle, cert_file=cert_file, key_file=key_file))
    other = ca.issue("b")
    with pytest.raises(ConfigError, match="is not the unencrypted private key of"):
        check_credentials(
            ClientCredentials(ca_file=bundle, cert_file=cert_file, key_file=other.key)
        )


def test_rule_table_defaults_fail_closed() -> None:
    rules = Authorizer(AuthSettings(token_file=Path("/unused")), None)
    assert rules.allowed("/grpc.health.v1.Health/Check") is None
    assert rules.allowed("/crossflow.v1.LeaseService/Connect") == {Role.NODE}
    assert rules.allowed("/crossflow.v1.AdmissionService/Release") == {Role.ROUTER, Role.ADMIN}
    # A new RPC of a known service falls to its service's default, never open.
    assert rules.allowed("/crossflow.v1.AdminService/DeleteNode") == {Role.ADMIN}
    assert rules.allowed("/crossflow.v1.AdminService/ListNodes") == {Role.ADMIN, Role.ROUTER}
    assert rules.allowed("/crossflow.v1.AdminService/ListReservations") == {Role.ADMIN}
    assert rules.allowed("/some.Other/Thing") == frozenset()


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1:0") and is_loopback("localhost:50051")
    assert is_loopback("[::1]:50051")
    assert not is_loopback("0.0.0.0:50051") and not is_loopback("10.0.0.5:50051")
