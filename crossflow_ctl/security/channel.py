"""The one way callers (client library, agent, CLI) open a channel to the broker.

``open_channel(target, creds, options)``: plaintext without a CA bundle; TLS with one (mutual
TLS when a certificate and key are given; ``server_name`` overrides the name checked); a bearer
token, when ``token_file`` is set, rides on every call as ``authorization: Bearer <token>``
metadata, added by a client interceptor so it works over plaintext too (a mesh sidecar that
terminates TLS). Unreadable files raise ConfigError naming the setting.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from crossflow_ctl.domain.errors import ConfigError
from crossflow_ctl.security.settings import ClientCredentials

MAX_TOKEN_BYTES = 4096


def read_secret(path: Path, field: str) -> bytes:
    try:
        return path.expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", field=field) from None


_CERT_MARK = b"-----BEGIN CERTIFICATE-----"
_KEY_MARK = b"PRIVATE KEY-----"
_CERT_BLOCK = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)


def _checking_context() -> ssl.SSLContext:
    """A context that checks what gRPC checks (PEM, a key that fits its certificate) and nothing
    more: OpenSSL security level 0, as Python's default level 2 refuses RSA-1024 keys and SHA-1
    signatures that gRPC serves and verifies."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    return ctx


def read_ca_bundle(path: Path, field: str) -> bytes:
    """A PEM CA bundle; ConfigError naming ``field`` when it holds no certificate (gRPC would
    only fail each connection, as if the peer could not be reached)."""
    data = read_secret(path, field)
    if _CERT_MARK not in data:
        raise ConfigError(f"{path} holds no PEM certificate (a CA bundle)", field=field)
    # Only the certificate blocks: bundles carry comments and labels (p11-kit's, in UTF-8) that
    # gRPC skips.
    blocks = b"\n".join(_CERT_BLOCK.findall(data))
    try:
        _checking_context().load_verify_locations(cadata=blocks.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError, ValueError) as exc:
        raise ConfigError(
            f"{path} is not a PEM CA bundle: {_ssl_reason(exc)}", field=field
        ) from None
    return data


def read_key_pair(cert: Path, key: Path, fields: tuple[str, str]) -> tuple[bytes, bytes]:
    """A PEM certificate (chain) and its unencrypted private key; ConfigError naming the field
    of the file at fault (the certificate's when the key is not its key)."""
    cert_pem, key_pem = read_secret(cert, fields[0]), read_secret(key, fields[1])
    if _CERT_MARK not in cert_pem:
        raise ConfigError(f"{cert} holds no PEM certificate", field=fields[0])
    if _KEY_MARK not in key_pem:
        raise ConfigError(f"{key} holds no PEM private key", field=fields[1])
    try:
        _checking_context().load_cert_chain(
            cert.expanduser(), key.expanduser(), password=lambda: b""
        )
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(
            f"{key} is not the unencrypted private key of {cert}, or one of them is not valid "
            f"PEM: {_ssl_reason(exc)}",
            field=fields[0],
        ) from None
    return cert_pem, key_pem


def _ssl_reason(exc: Exception) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason).lower().replace("_", " ") if reason else str(exc)


def read_token(path: Path, field: str = "token_file") -> str:
    """The bearer token in ``path`` (surrounding whitespace dropped); ConfigError if unusable."""
    raw = read_secret(path, field)
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{path} must hold an ASCII token", field=field) from None
    if not token or len(token) > MAX_TOKEN_BYTES or any(ch.isspace() for ch in token):
        raise ConfigError(
            f"{path} must hold one token of 1..{MAX_TOKEN_BYTES} visible characters",
            field=field,
        )
    return token


def _with_token(details: Any, token: str) -> Any:
    metadata = list(details.metadata or ())
    metadata.append(("authorization", f"Bearer {token}"))
    return details._replace(metadata=grpc.aio.Metadata(*metadata))


# grpc.aio files an interceptor under the first call kind it matches, so each kind gets its own.
class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self._token), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self._token), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_token(details, self._token), requests)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_token(details, self._token), requests)


def bearer_interceptors(token: str) -> list[Any]:
    """Interceptors adding ``authorization: Bearer <token>`` to every call of a channel."""
    return [cls(token) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


def channel_credentials(creds: ClientCredentials) -> grpc.ChannelCredentials:
    """TLS credentials from ``creds`` (which must have a CA bundle)."""
    assert creds.ca_file is not None
    cert = key = None
    if creds.cert_file is not None and creds.key_file is not None:
        cert, key = read_key_pair(creds.cert_file, creds.key_file, ("cert_file", "key_file"))
    return grpc.ssl_channel_credentials(
        root_certificates=read_ca_bundle(creds.ca_file, "ca_file"),
        private_key=key,
        certificate_chain=cert,
    )


def check_credentials(creds: ClientCredentials) -> ClientCredentials:
    """``creds`` once every file it names has been read and parsed; ConfigError otherwise."""
    if creds.token_file is not None:
        read_token(creds.token_file)
    if creds.tls:
        channel_credentials(creds)
    return creds


def open_channel(
    target: str,
    creds: ClientCredentials | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """A channel to ``target`` secured as ``creds`` says (module docstring)."""
    creds = creds or ClientCredentials()
    opts = list(options)
    interceptors = []
    if creds.token_file is not None:
        interceptors = bearer_interceptors(read_token(creds.token_file))
    if not creds.tls:
        return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)
    if creds.server_name:
        opts.append(("grpc.ssl_target_name_override", creds.server_name))
    return grpc.aio.secure_channel(
        target, channel_credentials(creds), options=opts, interceptors=interceptors
    )
