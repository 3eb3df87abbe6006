"""The agent's gRPC stream to a broker (LeaseService.Connect), with reconnects.

Channels are secured by ``credentials`` (TLS, mutual TLS with the node's certificate, or a bearer
token: crossflow_ctl.security). One session at a time: Hello (node, role, epoch, last notice seq
seen) -> Welcome, then a writer drains the outbox (leases / pool load / heartbeats, newest kept
when the outbox is full) while a reader takes acks and notices. A session ends when the broker
closes the stream, the call fails, or nothing has come back for ``stall_timeout_s`` while writes
went unanswered. The agent asks for refusal-only acks (``Hello.refusal_acks``): the broker acks a
refused lease at once and answers each heartbeat with the newest lease it accepted, so a session
with writes unanswered for a third of ``stall_timeout_s`` sends a heartbeat (one in flight at a
time), whose answer is both the liveness check and the cumulative ack of the leases before it (a
broker that predates the flag acks every lease; both are understood). Then the next endpoint of
the list is tried after a jittered exponential backoff; a session that had a lease accepted resets
the backoff (one that is welcomed and then fails at once, say on a broken store, keeps backing
off).

What the broker tells the agent is kept in :class:`StreamState`: the highest notice sequence
seen (DESIGN.md §5.4; the lease loop reads it *before* each scrape), the open reservations the
grant/release/expire notices describe (so the lease does not subtract borrowed work the broker
already counts), the cordon directive, the broker's borrow horizon and KV bytes per token (from
its Welcome, then from each ``SessionSettings`` it pushes when its policy changes them: the
lease's credits are sized over the horizon from the next lease on, and a push wakes the loop),
and the (epoch, version) a STALE ack reported, so the loop can move past it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from crossflow_ctl.aio import cancel_and_wait
from crossflow_ctl.api.v1 import lease_pb2, lease_pb2_grpc
from crossflow_ctl.domain.lending import OpenDebits
from crossflow_ctl.domain.models import NoticeKind
from crossflow_ctl.domain.session import SessionSettings
from crossflow_ctl.observability import AgentMetrics
from crossflow_ctl.security import ClientCredentials
from crossflow_ctl.security.channel import check_credentials, open_channel
from crossflow_ctl.wire.convert import session_settings_from_proto

log = structlog.get_logger()

OUTBOX_SIZE = 32
_DEBIT_KINDS = {
    lease_pb2.NOTICE_KIND_GRANT: NoticeKind.GRANT,
    lease_pb2.NOTICE_KIND_RELEASE: NoticeKind.RELEASE,
    lease_pb2.NOTICE_KIND_EXPIRE: NoticeKind.EXPIRE,
}


_HEARTBEAT = lease_pb2.ConnectRequest(heartbeat=lease_pb2.Heartbeat())


class SessionError(Exception):
    """A session that ended for a reason other than a gRPC status."""


@dataclass
class StreamState:
    last_notice_seq: int = 0
    """Highest notice sequence received (on any session)."""
    open_debits: OpenDebits = field(default_factory=OpenDebits)
    """Reservations the broker still counts against this node, from the notices up to
    ``last_notice_seq``."""
    cordoned: bool = False
    connected: bool = False
    broker_id: str = ""
    endpoint: str = ""
    max_lease_ttl_ms: int = 0
    borrow_horizon_ms: int = 0
    """The broker's borrow horizon, from its Welcome or its latest SessionSettings (0: not
    welcomed yet, or the broker sent none). The lease sizes its credits over it: see
    :meth:`Agent.lease_settings`."""
    policy_version: int = 0
    """The broker policy version of the latest SessionSettings (0: only the Welcome's)."""
    stale_epoch: int = 0
    stale_version: int = 0
    """The stored (epoch, version) of the last STALE ack."""
    acked: int = 0
    """Leases accepted (and, for prefill agents, heartbeats echoed)."""
    refused: int = 0
    sessions: int = 0
    """Sessions welcomed by a broker."""
    attempts: int = 0
    """Sessions tried (welcomed or not)."""
    last_delay_s: float = 0.0
    """The jittered backoff before the latest retry."""

    def adopt(self, settings: SessionSettings) -> None:
        """The broker's policy-derived settings (a Welcome's, version 0, or a push's)."""
        self.max_lease_ttl_ms = settings.max_lease_ttl_ms
        self.borrow_horizon_ms = settings.borrow_horizon_ms
        self.open_debits.kv_bytes_per_token = settings.kv_bytes_per_token
        self.policy_version = settings.policy_version


FAILURE_REPEAT = 30
"""A still-failing stream warns again after this many failed sessions (about a minute at the
2 s backoff cap)."""


class LeaseStream:
    def __init__(
        self,
        *,
        endpoints: list[str],
        hello: Callable[[int], lease_pb2.ConnectRequest],
        metrics: AgentMetrics,
        connect_timeout_s: float = 1.0,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 2.0,
        stall_timeout_s: float = 3.0,
        max_message_bytes: int = 4 * 1024 * 1024,
        on_change: Callable[[], None] | None = None,
        on_ack: Callable[[int, int, bool], None] | None = None,
        rng: random.Random | None = None,
        credentials: ClientCredentials | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one broker endpoint is needed")
        # Unreadable files stop the start here (ConfigError); each session reads them again,
        # so rotated certificates and tokens are picked up at the next reconnect.
        self._credentials = check_credentials(credentials or ClientCredentials())
        self.endpoints = list(endpoints)
        self.state = StreamState()
        self._hello = hello
        self._metrics = metrics
        self._connect_timeout_s = connect_timeout_s
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._stall_s = stall_timeout_s
        self._options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.enable_retries", 0),
        ]
        self._on_change = on_change or (lambda: None)
        self._on_ack = on_ack or (lambda epoch, version, accepted: None)
        """Told of every lease ack: (epoch, version, accepted by the broker)."""
        self._rng = rng or random.Random()
        self._outbox: asyncio.Queue[lease_pb2.ConnectRequest] | None = None
        self._closing = asyncio.Event()
        self._unanswered_since: float | None = None
        self._beat_pending = False
        """A heartbeat this stream sent for liveness is not answered yet."""
        self._cumulative: tuple[int, int] = (0, 0)
        """The newest (epoch, version) a heartbeat answer acked on this session."""
        self._await_ack: tuple[int, int] | None = None
        self._acked = asyncio.Event()
        self._failures = 0
        """Failed sessions in a row (since the last that had a lease accepted)."""

    # -- API for the lease loop ----------------------------------------------------------------

    def send(self, request: lease_pb2.ConnectRequest) -> bool:
        """Queue ``request`` on the live session; False (dropped) when there is none."""
        box = self._outbox
        if box is None:
            return False
        if box.full():  # keep the newest: an old lease is worth less than a fresh one
            box.get_nowait()
        box.put_nowait(request)
        return True

    async def close(self, final: lease_pb2.ConnectRequest | None, grace_s: float) -> bool:
        """Send ``final`` (if connected), wait up to ``grace_s`` for its ack, end the session.

        True when the final message was acknowledged.
        """
        acked = False
        if final is not None and final.WhichOneof("body") == "lease":
            self._await_ack = (final.lease.epoch, final.lease.version)
            self._acked.clear()
            if self.send(final) and self.send(_HEARTBEAT):  # its answer acks the final lease
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(grace_s):
                        await self._acked.wait()
                    acked = True
        self._closing.set()
        return acked

    # -- sessions ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Keep a session up until :meth:`close`; cancel-safe."""
        index = 0
        backoff = self._backoff[0]
        while not self._closing.is_set():
            target = self.endpoints[index % len(self.endpoints)]
            welcomed = False
            acked_before = self.state.acked
            error: str | None = None
            try:
                welcomed = await self._session(target)
            except (grpc.aio.AioRpcError, TimeoutError, SessionError, OSError) as exc:
                error = _brief(exc)
            except Exception:  # never let the stream die: reconnect after the backoff
                log.exception("stream.session_crashed", endpoint=target)
            if self._closing.is_set():
                break
            if welcomed:
                self._metrics.stream_disconnected(reconnecting=True)
            if self.state.acked > acked_before:  # it worked for a while: start over quickly
                backoff = self._backoff[0]
            index += 1
            delay = backoff * self._rng.uniform(0.5, 1.0)
            backoff = min(self._backoff[1], backoff * 2)
            if error is not None:
                self._session_failed(target, error, delay, reset=self.state.acked > acked_before)
            self.state.attempts += 1
            self.state.last_delay_s = delay
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._closing.wait()

    def _session_failed(self, target: str, error: str, retry_in_s: float, reset: bool) -> None:
        """A warning once a retry failed too, and every ``FAILURE_REPEAT``-th failure after (it
        retries every few seconds at most, so a broker that is not there, or refuses the node,
        is said at the default log level without a line per retry); info otherwise: one failure
        after a working session is a routine reconnect (a broker restarting, say)."""
        self._failures = 1 if reset else self._failures + 1
        say = log.warning if self._failures % FAILURE_REPEAT == 2 else log.info
        say(
            "stream.session_failed",
            endpoint=target,
            error=error,
            failures=self._failures,
            retry_in_s=round(retry_in_s, 2),
            effect="no lease reaches a broker: the node lends nothing until one answers",
        )

    async def _session(self, target: str) -> bool:
        """One connection to ``target``; True once it had been welcomed."""
        channel = open_channel(target, self._credentials, self._options)
        call = lease_pb2_grpc.LeaseServiceStub(channel).Connect()
        welcomed = False
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await call.write(self._hello(self.state.last_notice_seq))
                first = await call.read()
            if first is grpc.aio.EOF or first.WhichOneof("body") != "welcome":
                raise SessionError("no welcome from the broker")
            self._welcome(first.welcome, target)
            welcomed = True
            await self._pump(call)
        finally:
            self._outbox = None
            if self.state.connected:
                self.state.connected = False
                log.info("stream.disconnected", endpoint=target)
                self._on_change()
            call.cancel()
            await channel.close(grace=None)
        return welcomed

    def _welcome(self, welcome: lease_pb2.Welcome, target: str) -> None:
        s = self.state
        s.connected, s.endpoint, s.broker_id = True, target, welcome.broker_id
        s.adopt(
            SessionSettings.trusted(
                max_lease_ttl_ms=welcome.max_lease_ttl_ms,
                borrow_horizon_ms=welcome.borrow_horizon_ms,
                kv_bytes_per_token=welcome.kv_bytes_per_token,
                policy_version=0,
            )
        )
        s.cordoned = welcome.cordoned
        if welcome.notice_seq < s.last_notice_seq:
            # The broker's sequence went back: the node was deleted and registered anew. Seen
            # sequences of the old node must not vouch for the new one's releases (§5.4).
            s.last_notice_seq = welcome.notice_seq
        s.sessions += 1
        self._unanswered_since = None
        self._beat_pending = False
        self._cumulative = (0, 0)
        self._outbox = asyncio.Queue(maxsize=OUTBOX_SIZE)
        self._metrics.stream_connected()
        log.info(
            "stream.connected",
            endpoint=target,
            broker_id=welcome.broker_id,
            cordoned=welcome.cordoned,
            borrow_horizon_ms=welcome.borrow_horizon_ms,
            notice_seq=welcome.notice_seq,
            resume_after=s.last_notice_seq,
        )
        self._on_change()

    async def _pump(self, call: grpc.aio.StreamStreamCall) -> None:
        box = self._outbox
        assert box is not None
        tasks = {
            asyncio.create_task(self._write(call, box), name="stream-write"),
            asyncio.create_task(self._read(call), name="stream-read"),
            asyncio.create_task(self._watchdog(), name="stream-watchdog"),
            asyncio.create_task(self._closing.wait(), name="stream-closing"),
        }
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(tasks)
        if self._closing.is_set():
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                async with asyncio.timeout(0.5):
                    await call.done_writing()
            return
        for task in done:
            task.result()  # re-raise what ended the session

    async def _write(
        self, call: grpc.aio.StreamStreamCall, box: asyncio.Queue[lease_pb2.ConnectRequest]
    ) -> None:
        while True:
            request = await box.get()
            await call.write(request)
            if self._unanswered_since is None:
                self._unanswered_since = time.monotonic()

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                raise SessionError("the broker ended the stream")
            self._unanswered_since = None
            body = response.WhichOneof("body")
            if body == "notices":
                for notice in response.notices.notices:
                    self._notice(notice)
            elif body == "notice":
                self._notice(response.notice)
            elif body == "lease_ack":
                self._ack(response.lease_ack)
            elif body == "settings":
                self._settings(response.settings)
            elif body == "heartbeat":
                self._heartbeat(response.heartbeat)

    async def _watchdog(self) -> None:
        """Ends a session whose writes went unanswered for ``stall_timeout_s``; after a third
        of it, asks with a heartbeat (accepted leases get no ack of their own)."""
        while True:
            await asyncio.sleep(self._stall_s / 8)
            since = self._unanswered_since
            if since is None:
                continue
            waited = time.monotonic() - since
            if waited > self._stall_s:
                raise SessionError(f"no answer from the broker for {self._stall_s:g} s")
            if waited >= self._stall_s / 3 and not self._beat_pending:
                self._beat_pending = self.send(_HEARTBEAT)

    def _heartbeat(self, beat: lease_pb2.Heartbeat) -> None:
        """A heartbeat answered; with refusal acks it acks every lease accepted before it."""
        self._beat_pending = False
        self.state.acked += 1
        acked = (beat.acked_epoch, beat.acked_version)
        if acked <= self._cumulative:
            return
        self._cumulative = acked
        self._on_ack(acked[0], acked[1], True)
        if self._await_ack is not None and acked >= self._await_ack:
            self._acked.set()

    def _notice(self, notice: lease_pb2.Notice) -> None:
        s = self.state
        if notice.seq > s.last_notice_seq:
            s.last_notice_seq = notice.seq
            kind = _DEBIT_KINDS.get(notice.kind)
            if kind is not None:
                d = notice.debit
                s.open_debits.record(
                    kind,
                    notice.reservation_id,
                    d.kv_tokens,
                    d.output_tokens,
                    d.kv_transfer_bytes,
                    notice.pulled_tokens if notice.HasField("pulled_tokens") else None,
                )
        if notice.kind == lease_pb2.NOTICE_KIND_CORDON:
            if not s.cordoned:
                log.warning("stream.cordoned", seq=notice.seq)
            s.cordoned = True
            self._on_change()
        elif notice.kind == lease_pb2.NOTICE_KIND_UNCORDON:
            if s.cordoned:
                log.info("stream.uncordoned", seq=notice.seq)
            s.cordoned = False
            self._on_change()

    def _settings(self, msg: lease_pb2.SessionSettings) -> None:
        """The broker's policy changed them: the next lease (woken now) is sized with them."""
        settings = session_settings_from_proto(msg)
        self.state.adopt(settings)
        log.info(
            "stream.settings",
            policy_version=settings.policy_version,
            borrow_horizon_ms=settings.borrow_horizon_ms,
            kv_bytes_per_token=settings.kv_bytes_per_token,
        )
        self._on_change()

    def _ack(self, ack: lease_pb2.LeaseAck) -> None:
        s = self.state
        if ack.result == lease_pb2.LEASE_RESULT_ACCEPTED:
            s.acked += 1
        else:
            s.refused += 1
            if ack.result == lease_pb2.LEASE_RESULT_STALE:
                s.stale_epoch, s.stale_version = ack.stored_epoch, ack.stored_version
            log.warning(
                "lease.refused",
                result=lease_pb2.LeaseResult.Name(ack.result),
                epoch=ack.epoch,
                version=ack.version,
                stored_epoch=ack.stored_epoch,
                stored_version=ack.stored_version,
                message=ack.message,
            )
        self._on_ack(ack.epoch, ack.version, ack.result == lease_pb2.LEASE_RESULT_ACCEPTED)
        if self._await_ack == (ack.epoch, ack.version):
            self._acked.set()


def _brief(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
