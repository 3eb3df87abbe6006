"""What every broker client shares: the channel it opens (or is given) and closes, and the
unary call that turns a gRPC failure into a domain error."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self

import grpc

from crossflow_ctl.client.errors import error_from_rpc
from crossflow_ctl.domain.errors import BrokerUnavailable
from crossflow_ctl.security import ClientCredentials
from crossflow_ctl.security.channel import open_channel


def channel_options(max_message_bytes: int = 4 * 1024 * 1024) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


class BrokerClient:
    """``credentials`` secure the channel the client opens to ``target`` (TLS, mTLS, bearer
    token: see crossflow_ctl.security.channel); a supplied ``channel`` is used as it is, and
    left open on close."""

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float,
        channel: grpc.aio.Channel | None = None,
        credentials: ClientCredentials | None = None,
    ) -> None:
        if channel is None and not target:
            raise ValueError("give a target or a channel")
        self.target = target
        self.timeout_s = timeout_s
        self._own_channel = channel is None
        self._channel = channel or open_channel(target, credentials, channel_options())

    async def close(self) -> None:
        if self._own_channel:
            await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        except grpc.RpcError as exc:  # pragma: no cover - aio raises AioRpcError
            raise BrokerUnavailable(str(exc)) from None
