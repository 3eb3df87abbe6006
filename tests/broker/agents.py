"""A fake node agent speaking the proto contract directly (as the real agent does)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc

from crossflow_ctl.api.v1 import common_pb2, lease_pb2, lease_pb2_grpc
from crossflow_ctl.security import ClientCredentials
from crossflow_ctl.security.channel import open_channel

DEFAULT_CREDITS = {
    "compute_tokens": 8_000,
    "kv_tokens": 100_000,
    "kv_transfer_bytes": 10**9,
    "output_tokens": 8_000,
    "slots": 4,
}


def lease_msg(node_id: str, epoch: int, version: int, **kw: Any) -> common_pb2.Lease:
    credits = {**DEFAULT_CREDITS, **kw.pop("credits", {})}
    fields: dict[str, Any] = {
        "ttl_ms": 2_000,
        "queue_wait_ms": 5.0,
        "borrowed_prefill_rate_tps": 20_000.0,
        "itl_ms": 20.0,
        "itl_slo_ms": 50.0,
    }
    fields.update(kw)
    return common_pb2.Lease(
        node_id=node_id,
        epoch=epoch,
        version=version,
        credits=common_pb2.Credits(**credits),
        **fields,
    )


class FakeAgent:
    """One Connect stream: Hello, then leases / pool load; collects acks and notices."""

    def __init__(
        self,
        target: str,
        node_id: str,
        *,
        role: int = common_pb2.NODE_ROLE_DECODE,
        epoch: int = 1,
        pool: str = "default",
        labels: dict[str, str] | None = None,
        last_notice_seq: int = 0,
        credentials: ClientCredentials | None = None,
        notice_batches: bool = False,
        refusal_acks: bool = False,
        own_connection: bool = False,
    ) -> None:
        """``own_connection``: a TCP connection of its own, not the one gRPC shares between
        channels to the same target (so streams spread over the workers of one port)."""
        self.node_id = node_id
        self.epoch = epoch
        self.version = 0
        self._hello = lease_pb2.Hello(
            node_id=node_id,
            role=role,  # type: ignore[arg-type]
            epoch=epoch,
            pool=pool,
            labels=labels or {},
            last_notice_seq=last_notice_seq,
            notice_batches=notice_batches,
            refusal_acks=refusal_acks,
        )
        options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
        self._channel = open_channel(target, credentials, options)
        self._stub = lease_pb2_grpc.LeaseServiceStub(self._channel)
        self.acks: asyncio.Queue[lease_pb2.LeaseAck] = asyncio.Queue()
        self.heartbeats: asyncio.Queue[lease_pb2.Heartbeat] = asyncio.Queue()
        self.notices: list[lease_pb2.Notice] = []
        self.batches = 0
        """Messages that carried notices together (``notice_batches``)."""
        self._notice_event = asyncio.Event()
        self.welcome: lease_pb2.Welcome | None = None
        self.settings: list[lease_pb2.SessionSettings] = []
        """SessionSettings pushed after the Welcome, in order."""
        self.ended: grpc.StatusCode | None = None
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None

    @property
    def last_notice_seq(self) -> int:
        return self.notices[-1].seq if self.notices else self._hello.last_notice_seq

    async def connect(self) -> lease_pb2.Welcome:
        self._call = self._stub.Connect()
        await self._call.write(lease_pb2.ConnectRequest(hello=self._hello))
        first = await self._call.read()
        assert first.WhichOneof("body") == "welcome", first
        self.welcome = first.welcome
        self._reader = asyncio.create_task(self._read())
        return self.welcome

    async def _read(self) -> None:
        try:
            while True:
                msg = await self._call.read()
                if msg is grpc.aio.EOF:
                    self.ended = grpc.StatusCode.OK
                    return
                body = msg.WhichOneof("body")
                if body == "lease_ack":
                    self.acks.put_nowait(msg.lease_ack)
                elif body == "heartbeat":
                    self.heartbeats.put_nowait(msg.heartbeat)
                elif body == "notice":
                    self.notices.append(msg.notice)
                    self._notice_event.set()
                elif body == "settings":
                    self.settings.append(msg.settings)
                    self._notice_event.set()
                elif body == "notices":
                    self.notices.extend(msg.notices.notices)
                    self.batches += 1
                    self._notice_event.set()
        except grpc.aio.AioRpcError as exc:
            self.ended = exc.code()
        finally:
            self._notice_event.set()

    async def send_lease(
        self, msg: common_pb2.Lease | None = None, **kw: Any
    ) -> lease_pb2.LeaseAck:
        if msg is None:
            self.version += 1
            kw.setdefault("last_notice_seq", self.last_notice_seq)
            msg = lease_msg(self.node_id, self.epoch, self.version, **kw)
        await self._call.write(lease_pb2.ConnectRequest(lease=msg))
        async with asyncio.timeout(5):
            return await self.acks.get()

    async def write_lease(self, **kw: Any) -> None:
        """The next version, without waiting for its ack (it lands in ``acks``)."""
        self.version += 1
        msg = lease_msg(self.node_id, self.epoch, self.version, **kw)
        await self._call.write(lease_pb2.ConnectRequest(lease=msg))

    async def write_heartbeat(self) -> None:
        """A heartbeat, without waiting for its echo (it lands in ``heartbeats``)."""
        await self._call.write(lease_pb2.ConnectRequest(heartbeat=lease_pb2.Heartbeat()))

    async def send_pool_load(
        self,
        outstanding: int = 200_000,
        rate_tps: float = 20_000.0,
        pool: str = "default",
        ttl_ms: int = 5_000,
    ) -> None:
        await self._call.write(
            lease_pb2.ConnectRequest(
                pool_load=common_pb2.PoolLoad(
                    pool=pool,
                    node_id=self.node_id,
                    outstanding_uncached_tokens=outstanding,
                    processing_rate_tps=rate_tps,
                    prefill_rate_tps=rate_tps,
                    ttl_ms=ttl_ms,
                )
            )
        )

    async def sync(self) -> None:
        """Heartbeat and wait for its echo: everything sent before it has been handled."""
        await self._call.write(lease_pb2.ConnectRequest(heartbeat=lease_pb2.Heartbeat()))
        async with asyncio.timeout(5):
            await self.heartbeats.get()

    async def wait_notice(self, predicate: Any, timeout_s: float = 5.0) -> lease_pb2.Notice:
        async with asyncio.timeout(timeout_s):
            while True:
                for n in self.notices:
                    if predicate(n):
                        return n
                if self.ended is not None:
                    raise AssertionError(f"stream ended ({self.ended}) before the notice came")
                self._notice_event.clear()
                await self._notice_event.wait()

    async def wait_settings(
        self, count: int, timeout_s: float = 5.0
    ) -> list[lease_pb2.SessionSettings]:
        """The pushed SessionSettings once there are ``count``."""
        async with asyncio.timeout(timeout_s):
            while len(self.settings) < count:
                if self.ended is not None:
                    raise AssertionError(f"stream ended ({self.ended}) before the settings came")
                self._notice_event.clear()
                await self._notice_event.wait()
        return self.settings

    async def close(self) -> None:
        if self._call is not None:
            with contextlib.suppress(Exception):
                await self._call.done_writing()
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._channel.close()
