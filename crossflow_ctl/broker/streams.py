"""LeaseService.Connect: one bidirectional stream per node agent.

Hello first (INVALID_ARGUMENT otherwise); when the broker authenticates callers, Hello.node_id
must be the node named by the caller's identity (PERMISSION_DENIED otherwise, nothing stored), and
every lease and pool load on the stream must name that same node. The node is registered and
answered with a Welcome.
Then, concurrently: a reader acks each lease (ACCEPTED, STALE with the stored epoch/version, or
INVALID naming the field; the stream stays up), stores pool load and echoes heartbeats. An agent
that said ``Hello.refusal_acks`` gets acks for refused leases only (it acts on nothing else) and
each heartbeat's answer names the newest lease accepted on the stream: a cumulative ack, which
keeps liveness and lets the agent say when a lease took, at one message per heartbeat instead of
one per lease; a
relay reads the node's notices from the STORE (after the agent's ``last_notice_seq``) and sends
them down, so a notice written by any replica reaches the agent wherever it streams (§6): one
message per read to an agent that set ``Hello.notice_batches``, one per notice otherwise; and a
pusher sends ``SessionSettings`` when the policy version this replica holds changes what the
Welcome (or the last push) said (the broker caps each lease it stores to its horizon:
:meth:`~crossflow_ctl.service.broker.Broker.ingest_lease`).
Both write straight to the call (``context.write``), one write at a time (:class:`_Out`): an
ack passes no queue, no task switch and no generator layer of the handler or its wrappers.
The handler waits for the stream's end; :class:`StreamRegistry` lets shutdown end every stream
cleanly.
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
from crossflow_ctl.domain.session import SessionSettings
from crossflow_ctl.observability import span, spans_recorded
from crossflow_ctl.service.broker import Broker
from crossflow_ctl.wire import convert as c

log = structlog.get_logger()

RELAY_RETRY_S = 0.2


class _End:
    """How a stream ends: OK, or with a status (``code`` set)."""

    def __init__(self, code: grpc.StatusCode | None = None, message: str = "") -> None:
        self.code = code
        self.message = message


class _Out:
    """One stream's way out: ``send`` writes to the call, one write at a time (gRPC takes one
    message in flight per call; the reader's acks and the relay's notices share it); ``end``
    settles how the stream ends (the first end wins), which the handler waits for."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._lock = asyncio.Lock()
        self.ended: asyncio.Future[_End] = asyncio.get_running_loop().create_future()

    async def send(self, message: lease_pb2.ConnectResponse) -> None:
        async with self._lock:
            await self._context.write(message)

    def end(self, how: _End) -> None:
        if not self.ended.done():
            self.ended.set_result(how)


class _Accepted:
    """The newest (epoch, version) accepted on one stream: what a heartbeat's answer acks."""

    __slots__ = ("epoch", "version")

    def __init__(self) -> None:
        self.epoch = 0
        self.version = 0


class StreamRegistry:
    """The live agent streams of this replica, so shutdown can end them and wait."""

    def __init__(self) -> None:
        self._streams: set[_Out] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.closing = False

    def add(self, out: _Out) -> None:
        self._streams.add(out)
        self._idle.clear()

    def discard(self, out: _Out) -> None:
        self._streams.discard(out)
        if not self._streams:
            self._idle.set()

    def __len__(self) -> int:
        return len(self._streams)

    def close_all(self) -> None:
        """Ask every stream to end with OK (agents reconnect to another replica)."""
        self.closing = True
        for out in self._streams:
            out.end(_End())

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

    async def Connect(  # type: ignore[override]  # grpc.aio's writer form, not in the stubs
        self,
        request_iterator: AsyncIterator[lease_pb2.ConnectRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
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
        announced = SessionSettings.of(self._broker.versioned_policy)
        await context.write(
            lease_pb2.ConnectResponse(
                welcome=lease_pb2.Welcome(
                    broker_id=self._broker.broker_id,
                    max_lease_ttl_ms=announced.max_lease_ttl_ms,
                    borrow_horizon_ms=announced.borrow_horizon_ms,
                    kv_bytes_per_token=announced.kv_bytes_per_token,
                    cordoned=info.cordoned,
                    notice_seq=info.notice_seq,
                )
            )
        )
        out = _Out(context)
        self._registry.add(out)
        self._broker.metrics.stream_opened()
        after = min(hello.last_notice_seq, info.notice_seq)
        with structlog.contextvars.bound_contextvars(node_id=node_id):
            log.info("stream.open", epoch=hello.epoch, resume_after=after)
            reader = asyncio.create_task(
                self._read(request_iterator, info, out, refusal_acks=hello.refusal_acks)
            )
            relay = asyncio.create_task(
                self._relay(node_id, after, out, batches=hello.notice_batches)
            )
            pusher = asyncio.create_task(self._push_settings(announced, out))
            try:
                end = await out.ended
                if end.code is not None:
                    await context.abort(end.code, end.message)
            finally:
                try:
                    await cancel_and_wait((reader, relay, pusher))
                finally:  # even when gRPC cancels the handler again while it waits
                    reader.cancel()  # cancelled anew: one may have swallowed the first cancel
                    relay.cancel()
                    pusher.cancel()
                    self._registry.discard(out)
                    self._broker.metrics.stream_closed()
                    log.info("stream.closed")

    async def _read(
        self,
        requests: AsyncIterator[lease_pb2.ConnectRequest],
        info: NodeInfo,
        out: _Out,
        refusal_acks: bool = False,
    ) -> None:
        """Acks each lease, or with ``refusal_acks`` (the agent said ``Hello.refusal_acks``)
        only the refused ones, and answers each heartbeat with the newest lease accepted on
        this stream so far: requests are handled in order, so that answer acks every lease
        sent before the heartbeat and not refused (a cumulative ack)."""
        node_id = info.node_id
        attrs = {"crossflow.node_id": node_id}
        traced = spans_recorded()  # once per stream, not per lease (see spans_recorded)
        accepted = _Accepted()
        try:
            async for req in requests:
                body = req.WhichOneof("body")
                if body == "lease":
                    if traced:
                        with span("crossflow.lease_batch", attrs):
                            await self._lease(req.lease, info, out, accepted, refusal_acks)
                    else:
                        await self._lease(req.lease, info, out, accepted, refusal_acks)
                elif body in ("pool_load", "step_model"):
                    await self._report(req, info)
                elif body == "heartbeat":
                    now = self._broker.clock.now_ms()
                    hb = lease_pb2.Heartbeat(
                        sent_unix_ms=now, acked_epoch=accepted.epoch, acked_version=accepted.version
                    )
                    await out.send(lease_pb2.ConnectResponse(heartbeat=hb))
                elif body == "hello":
                    out.end(_End(grpc.StatusCode.INVALID_ARGUMENT, "hello: sent twice"))
                    return
            out.end(_End())
        except StoreUnavailable as exc:
            out.end(_End(grpc.StatusCode.UNAVAILABLE, status_message(exc)))
        except InvalidArgument as exc:  # undecodable bytes (broker.decoding)
            out.end(_End(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
        except FailedPrecondition:  # deleted (by hand or expiry) while the agent streamed
            msg = f"node {node_id!r} is no longer registered; reconnect to register it again"
            out.end(_End(grpc.StatusCode.NOT_FOUND, msg))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the agent went away mid-read or mid-write
            log.info("stream.read_ended", error=repr(exc))
            out.end(_End())

    async def _lease(
        self,
        msg: Any,
        info: NodeInfo,
        out: _Out,
        accepted: _Accepted,
        refusal_acks: bool,
    ) -> None:
        response = await self._ack(msg, info)
        ack = response.lease_ack
        if ack.result == lease_pb2.LEASE_RESULT_ACCEPTED:
            accepted.epoch, accepted.version = ack.epoch, ack.version
            if refusal_acks:
                return
        await out.send(response)

    async def _ack(self, msg: Any, info: NodeInfo) -> lease_pb2.ConnectResponse:
        """The lease's ack."""
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
            if _node_gone(exc):
                raise  # _read ends the stream
            self._broker.metrics.record_lease("invalid")
            ack.result = lease_pb2.LEASE_RESULT_INVALID
            ack.message = str(exc)
            log.warning("lease.invalid", error=str(exc))
        return response

    async def _report(self, req: lease_pb2.ConnectRequest, info: NodeInfo) -> None:
        """A message with no ack (a prefill node's load, a decode agent's step model): stored,
        or refused with a log line; a node deleted meanwhile ends the stream (``_read``) so the
        agent says Hello again and the node is listed, as a decode node's next lease does."""
        body = req.WhichOneof("body")
        try:
            if body == "pool_load":
                stored = await self._pool_load(req.pool_load, info)
            else:
                report = c.step_model_from_proto(req.step_model)
                stored = await self._broker.ingest_step_model(info.node_id, report)
            if not stored:
                raise FailedPrecondition(
                    f"node {info.node_id!r} is not registered", field="node_id"
                )
        except StoreUnavailable:
            raise
        except CrossflowError as exc:
            if _node_gone(exc):
                raise  # _read ends the stream
            log.warning(f"{body}.refused", error=str(exc))

    async def _pool_load(self, msg: Any, info: NodeInfo) -> bool:
        """Store a pool load report (False: the node is not registered)."""
        load = c.pool_load_from_proto(msg)
        if load.node_id != info.node_id:
            raise InvalidArgument(
                f"{load.node_id!r} is not this stream's node", field="pool_load.node_id"
            )
        return await self._broker.ingest_pool_load(load, info.role, info.pool)

    async def _push_settings(self, announced: SessionSettings, out: _Out) -> None:
        """Send the policy-derived settings again each time the policy version this replica
        holds changes them (the agent adopts them on its next lease)."""
        try:
            while True:
                versioned = await self._broker.policy_changed_after(announced.policy_version)
                settings = SessionSettings.of(versioned)
                if settings.differs_from(announced):
                    message = c.session_settings_to_proto(settings)
                    await out.send(lease_pb2.ConnectResponse(settings=message))
                    log.info(
                        "stream.settings_pushed",
                        policy_version=settings.policy_version,
                        borrow_horizon_ms=settings.borrow_horizon_ms,
                    )
                announced = settings
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a write failed: the agent went away
            log.info("stream.settings_ended", error=repr(exc))
            out.end(_End())

    async def _relay(self, node_id: str, after_seq: int, out: _Out, batches: bool = False) -> None:
        """Notices from the store, in order, resuming after ``after_seq``; retries on errors.
        With ``batches`` (the agent said ``Hello.notice_batches``) what one read found goes
        down as ONE message (one write however many grants a batch of admissions made).
        After notices, the next read waits ``notice_linger_ms``, so a busy node's notices go
        in few reads (the first after a quiet spell goes at once)."""
        try:
            await self._relay_notices(node_id, after_seq, out, batches)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a write failed: the agent went away
            log.info("stream.relay_ended", error=repr(exc))
            out.end(_End())

    async def _relay_notices(self, node_id: str, after_seq: int, out: _Out, batches: bool) -> None:
        block_ms = self._broker.settings.notice_block_ms
        linger_s = self._broker.settings.notice_linger_ms / 1000.0
        while True:
            try:
                rows = await self._broker.read_notice_rows(node_id, after_seq, block_ms)
            except CrossflowError as exc:
                log.warning("relay.read_failed", error=str(exc))
                await asyncio.sleep(RELAY_RETRY_S)
                continue
            if not rows:
                continue
            after_seq = rows[-1].seq
            batch = c.notice_rows_to_proto(rows)
            if batches:
                await out.send(_batch_response(batch))
            else:
                for notice in batch.notices:
                    await out.send(lease_pb2.ConnectResponse(notice=notice))
            if linger_s > 0:
                await asyncio.sleep(linger_s)


def _batch_response(batch: lease_pb2.NoticeBatch) -> lease_pb2.ConnectResponse:
    """``ConnectResponse(notices=batch)``, the batch copied in by ``CopyFrom`` (the same
    message; the keyword's copy of a batch took about three times as long)."""
    response = lease_pb2.ConnectResponse()
    response.notices.CopyFrom(batch)
    return response


def _node_gone(exc: CrossflowError) -> bool:
    """Whether ``exc`` says the stream's node is not registered (any more: deleted by hand or
    expired while its agent streamed), the one refusal that ends a stream so the agent says
    Hello again, from a lease or a load report alike."""
    return isinstance(exc, FailedPrecondition) and exc.field == "node_id"
