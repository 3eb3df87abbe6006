"""The one way callers (client library, agent, CLI) open a channel to the broker.

``open_channel(target, creds, options)``: plaintext without a CA bundle; TLS with one (mutual
TLS when a certificate and key are given; ``server_name`` overrides the name checked); a bearer
token, when ``token_file`` is set, rides on every call as ``authorization: Bearer <token>``
metadata, added by a client interceptor so it works over plaintext too (a mesh sidecar that
terminates TLS). Unreadable files raise ConfigError naming the setting.
"""

from __future__ import annotations

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
    key = read_secret(creds.key_file, "key_file") if creds.key_file else None
    cert = read_secret(creds.cert_file, "cert_file") if creds.cert_file else None
    return grpc.ssl_channel_credentials(
        root_certificates=read_secret(creds.ca_file, "ca_file"),
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
