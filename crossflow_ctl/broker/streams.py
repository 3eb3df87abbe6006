"""LeaseService.Connect: one bidirectional stream per node agent.

Hello first (INVALID_ARGUMENT otherwise); when the broker authenticates callers, Hello.node_id
must be the node named by the caller's identity (PERMISSION_DENIED otherwise, nothing stored), and
every lease and pool load on the stream must name that same node. The node is registered and
answered with a Welcome.
Then, concurrently: a reader acks each lease (ACCEPTED, STALE with the stored epoch/version, or
INVALID naming the field; the stream stays up), stores pool load and echoes heartbeats; and a
relay reads the node's notices from the STORE (after the agent's ``last_notice_seq``) and sends
them down, so a notice written by any replica reaches the agent wherever it streams (§6): one
message per read to an agent that set ``Hello.notice_batches``, one per notice otherwise.
One writer (the handler) drains a queue both feed. :class:`StreamRegistry` lets shutdown end
every stream cleanly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from crossflow_ctl.aio import cancel_and_wait
from crossflow_ctl.api.v1 import lease_pb2, lease_pb2_grpc
from crossflow_ctl.broker.auth import caller
from crossflow_ctl.broker.servicers import abort_with, status_message
from crossflow_ctl.domain.errors import (
    CrossflowError,
    FailedPrecondition,
    InvalidArgument,
    StaleLease,
    StoreUnavailable,
)
from crossflow_ctl.domain.models import NodeInfo, NodeRole
from crossflow_ctl.observability import span, tracing_installed
from crossflow_ctl.service.broker import Broker
from crossflow_ctl.wire import convert as c

log = structlog.get_logger()

RELAY_RETRY_S = 0.2


class _End:
    """Queue sentinel: the stream is over (``error`` set when it ends with a status)."""

    def __init__(self, code: grpc.StatusCode | None = None, message: str = "") -> None:
        self.code = code
        self.message = message


class StreamRegistry:
    """The live agent streams of this replica, so shutdown can end them and wait."""

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.closing = False

    def add(self, queue: asyncio.Queue[Any]) -> None:
        self._queues.add(queue)
        self._idle.clear()

    def discard(self, queue: asyncio.Queue[Any]) -> None:
        self._queues.discard(queue)
        if not self._queues:
            self._idle.set()

    def __len__(self) -> int:
        return len(self._queues)

    def close_all(self) -> None:
        """Ask every stream to end with OK (agents reconnect to another replica)."""
        self.closing = True
        for queue in self._queues:
            queue.put_nowait(_End())

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True


class LeaseStreamServicer(lease_pb2_grpc.LeaseServiceServicer):
    def __init__(self, broker: Broker, registry: StreamRegistry) -> None:
        self._broker = broker
        self._registry = registry

    async def Connect(
        self,
        request_iterator: AsyncIterator[lease_pb2.ConnectRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[lease_pb2.ConnectResponse]:
        if self._registry.closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "broker is shutting down")
        try:
            first = await anext(aiter(request_iterator), None)
        except InvalidArgument as exc:  # undecodable bytes (broker.decoding)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        if first is None or first.WhichOneof("body") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "hello: must be sent first")
            return
        hello = first.hello
        who = caller()
        if who is not None and who.uri_path != f"node/{hello.node_id}":
            log.info("stream.denied", identity=who.uri_path, node_id=hello.node_id[:128])
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"hello.node_id: {who.uri_path} may not publish for node {hello.node_id[:128]!r}",
            )
            return
        try:
            role = c.role_from_proto(hello.role, "hello.role") or NodeRole.DECODE
            info = await self._broker.register(
                hello.node_id, role, hello.pool or "default", dict(hello.labels)
            )
        except CrossflowError as exc:
            await abort_with(context, exc)
            return
        node_id = info.node_id
        policy = self._broker.policy
        yield lease_pb2.ConnectResponse(
            welcome=lease_pb2.Welcome(
                broker_id=self._broker.broker_id,
                max_lease_ttl_ms=policy.max_lease_ttl_ms,
                borrow_horizon_ms=policy.borrow_horizon_ms,
                cordoned=info.cordoned,
                notice_seq=info.notice_seq,
            )
        )
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._registry.add(queue)
        self._broker.metrics.stream_opened()
        after = min(hello.last_notice_seq, info.notice_seq)
        with structlog.contextvars.bound_contextvars(node_id=node_id):
            log.info("stream.open", epoch=hello.epoch, resume_after=after)
            reader = asyncio.create_task(self._read(request_iterator, info, queue))
            relay = asyncio.create_task(
                self._relay(node_id, after, queue, batches=hello.notice_batches)
            )
            try:
                while True:
                    item = await queue.get()
                    if isinstance(item, _End):
                        if item.code is not None:
                            await context.abort(item.code, item.message)
                        return
                    yield item
            finally:
                await cancel_and_wait((reader, relay))
                self._registry.discard(queue)
                self._broker.metrics.stream_closed()
                log.info("stream.closed")

    async def _read(
        self,
        requests: AsyncIterator[lease_pb2.ConnectRequest],
        info: NodeInfo,
        queue: asyncio.Queue[Any],
    ) -> None:
        node_id = info.node_id
        traced = tracing_installed()  # without an SDK a span per lease would make nothing
        try:
            async for req in requests:
                body = req.WhichOneof("body")
                if body == "lease":
                    if traced:
                        with span("crossflow.lease_batch", {"crossflow.node_id": node_id}):
                            queue.put_nowait(await self._ack(req.lease, info))
                    else:
                        queue.put_nowait(await self._ack(req.lease, info))
                elif body == "pool_load":
                    await self._pool_load(req.pool_load, info)
                elif body == "heartbeat":
                    now = self._broker.clock.now_ms()
                    hb = lease_pb2.Heartbeat(sent_unix_ms=now)
                    queue.put_nowait(lease_pb2.ConnectResponse(heartbeat=hb))
                elif body == "hello":
                    code, msg = grpc.StatusCode.INVALID_ARGUMENT, "hello: sent twice"
                    queue.put_nowait(_End(code, msg))
                    return
            queue.put_nowait(_End())
        except StoreUnavailable as exc:
            queue.put_nowait(_End(grpc.StatusCode.UNAVAILABLE, status_message(exc)))
        except InvalidArgument as exc:  # undecodable bytes (broker.decoding)
            queue.put_nowait(_End(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
        except FailedPrecondition:  # deleted (by hand or expiry) while the agent streamed
            msg = f"node {node_id!r} is no longer registered; reconnect to register it again"
            queue.put_nowait(_End(grpc.StatusCode.NOT_FOUND, msg))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the agent went away mid-read
            log.info("stream.read_ended", error=repr(exc))
            queue.put_nowait(_End())

    async def _ack(self, msg: Any, info: NodeInfo) -> lease_pb2.ConnectResponse:
        response = lease_pb2.ConnectResponse()
        ack = response.lease_ack  # filled in place: no message built and then copied in
        ack.epoch, ack.version = msg.epoch, msg.version
        try:
            lease = c.lease_from_proto(msg)
            if lease.node_id != info.node_id:
                raise InvalidArgument(
                    f"{lease.node_id!r} is not this stream's node {info.node_id!r}",
                    field="lease.node_id",
                )
            outcome = await self._broker.ingest_lease(lease, info.role)
            self._broker.metrics.record_lease("accepted", lease.zero_reason)
            ack.result = lease_pb2.LEASE_RESULT_ACCEPTED
            ack.stored_epoch, ack.stored_version = outcome.stored_epoch, outcome.stored_version
        except StaleLease as exc:
            self._broker.metrics.record_lease("stale")
            ack.result = lease_pb2.LEASE_RESULT_STALE
            ack.stored_epoch, ack.stored_version = exc.stored_epoch, exc.stored_version
            ack.message = str(exc)
        except StoreUnavailable:
            raise
        except CrossflowError as exc:
            if isinstance(exc, FailedPrecondition) and exc.field == "node_id":
                raise  # the node is not registered (any more): _read ends the stream
            self._broker.metrics.record_lease("invalid")
            ack.result = lease_pb2.LEASE_RESULT_INVALID
            ack.message = str(exc)
            log.warning("lease.invalid", error=str(exc))
        return response

    async def _pool_load(self, msg: Any, info: NodeInfo) -> None:
        """Store a pool load report; a refused one is logged (pool load has no ack)."""
        try:
            load = c.pool_load_from_proto(msg)
            if load.node_id != info.node_id:
                raise InvalidArgument(
                    f"{load.node_id!r} is not this stream's node", field="pool_load.node_id"
                )
            await self._broker.ingest_pool_load(load, info.role, info.pool)
        except StoreUnavailable:
            raise
        except CrossflowError as exc:
            log.warning("pool_load.refused", error=str(exc))

    async def _relay(
        self, node_id: str, after_seq: int, queue: asyncio.Queue[Any], batches: bool = False
    ) -> None:
        """Notices from the store, in order, resuming after ``after_seq``; retries on errors.
        With ``batches`` (the agent said ``Hello.notice_batches``) what one read found goes
        down as ONE message (one write however many grants a batch of admissions made).
        After notices, the next read waits ``notice_linger_ms``, so a busy node's notices go
        in few reads (the first after a quiet spell goes at once)."""
        block_ms = self._broker.settings.notice_block_ms
        linger_s = self._broker.settings.notice_linger_ms / 1000.0
        while True:
            try:
                notices = await self._broker.read_notices(node_id, after_seq, block_ms)
            except CrossflowError as exc:
                log.warning("relay.read_failed", error=str(exc))
                await asyncio.sleep(RELAY_RETRY_S)
                continue
            if not notices:
                continue
            after_seq = notices[-1].seq
            if batches:
                batch = lease_pb2.NoticeBatch(notices=[c.notice_to_proto(n) for n in notices])
                queue.put_nowait(lease_pb2.ConnectResponse(notices=batch))
            else:
                for notice in notices:
                    queue.put_nowait(lease_pb2.ConnectResponse(notice=c.notice_to_proto(notice)))
            if linger_s > 0:
                await asyncio.sleep(linger_s)
