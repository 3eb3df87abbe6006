"""``AdmissionStream``: Admit over one AdmitStream, for routers that admit thousands a second.

    async with AdmissionStream("broker:50051") as stream:
        answer = await stream.admit(uncached_prompt_tokens=4000, expected_output_tokens=300)

Concurrent ``admit`` calls share the stream: whatever is waiting when the writer runs goes out
as one message (up to ``max_batch`` items), and the broker answers each batch with one message,
so the per-request cost is a fraction of a unary call's. Each request carries an id of this
client's choosing, and its decision is matched back by that id.

Fails closed per request, like ``AdmissionClient(fail_closed=True)``: a decision not back within
``timeout_s`` is NORMAL with reason TIMEOUT, and a broken stream (broker not reached, gone or
failing) answers every waiting request NORMAL with reason BROKER_UNAVAILABLE (the next ``admit``
opens a new stream); the broker's own answers keep theirs (STORE_UNAVAILABLE when its store is
down). A request the
broker refuses as malformed raises :class:`InvalidArgument` for that request alone. A BORROW
that arrives after its request gave up is released at once (outcome cancelled), so the credit
is not held until the reservation expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import grpc

from crossflow_ctl.api.v1 import admission_pb2, admission_pb2_grpc
from crossflow_ctl.client.base import BrokerClient
from crossflow_ctl.client.errors import error_from_status
from crossflow_ctl.domain.admission import Admission, AdmissionRequest, Decision, Reason
from crossflow_ctl.domain.models import validated
from crossflow_ctl.security import ClientCredentials
from crossflow_ctl.wire.convert_admission import admission_from_proto, admit_request_to_proto


class AdmissionStream(BrokerClient):
    """One AdmitStream to ``target`` (or over ``channel``), reopened after a failure;
    ``credentials`` secure the channel it opens (as for ``AdmissionClient``)."""

    def __init__(
        self,
        target: str = "",
        *,
        timeout_s: float = 0.25,
        max_batch: int = 256,
        channel: grpc.aio.Channel | None = None,
        credentials: ClientCredentials | None = None,
    ) -> None:
        super().__init__(target, timeout_s=timeout_s, channel=channel, credentials=credentials)
        self.max_batch = max_batch
        self._stub = admission_pb2_grpc.AdmissionServiceStub(self._channel)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Admission]] = {}
        self._outbox: list[admission_pb2.AdmitStreamItem] = []
        self._wake = asyncio.Event()
        self._stream: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._releases: set[asyncio.Task[Any]] = set()

    async def admit(self, request: AdmissionRequest | None = None, **fields: Any) -> Admission:
        """Admit one request (an AdmissionRequest, or its fields as keywords); never raises for
        transport or broker trouble (NORMAL instead), raises InvalidArgument for a bad request."""
        req = request if request is not None else validated(AdmissionRequest, **fields)
        if self._stream is None:
            self._open()
        item_id = next(self._ids)
        future: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        self._pending[item_id] = future
        self._outbox.append(
            admission_pb2.AdmitStreamItem(id=item_id, request=admit_request_to_proto(req))
        )
        self._wake.set()
        try:
            async with asyncio.timeout(self.timeout_s):
                return await future
        except TimeoutError:
            return Admission.normal(
                Reason.TIMEOUT, f"no decision from the broker within {self.timeout_s:g} s"
            )
        finally:
            self._pending.pop(item_id, None)

    def _open(self) -> None:
        call = self._stub.AdmitStream()
        self._stream = call
        self._tasks = [
            asyncio.create_task(self._write(call), name="admission-stream-writer"),
            asyncio.create_task(self._read(call), name="admission-stream-reader"),
        ]

    async def _write(self, call: Any) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._outbox:
                    items = self._outbox[: self.max_batch]
                    del self._outbox[: self.max_batch]
                    await call.write(admission_pb2.AdmitStreamRequest(items=items))
        except Exception as exc:  # any write failure: the stream is gone, fail closed
            self._broken(call, await _write_failure(call, exc))

    async def _read(self, call: Any) -> None:
        reason = "broker closed the stream"
        try:
            async for response in call:
                for result in response.results:
                    self._resolve(result)
        except grpc.aio.AioRpcError as exc:
            reason = f"broker stream failed ({exc.code().name}): {exc.details()}"
        self._broken(call, reason)

    def _resolve(self, result: admission_pb2.AdmitStreamResult) -> None:
        future = self._pending.get(result.id)
        if result.HasField("error"):
            if future is not None and not future.done():
                future.set_exception(error_from_status(result.error.code, result.error.message))
            return
        answer = admission_from_proto(result.decision)
        if future is not None and not future.done():
            future.set_result(answer)
        elif answer.decision is Decision.BORROW:  # its request gave up: give the credit back
            self._release_late(answer.reservation_id)

    def _release_late(self, reservation_id: str) -> None:
        request = admission_pb2.ReleaseRequest(
            reservation_id=reservation_id,
            outcome=admission_pb2.RELEASE_OUTCOME_CANCELLED,
        )

        async def release() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._stub.Release(request, timeout=max(1.0, self.timeout_s))

        task = asyncio.create_task(release(), name="admission-stream-late-release")
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def _broken(self, call: Any, reason: str) -> None:
        """Fail every waiting request closed; the next admit opens a new stream."""
        if self._stream is not call:
            return  # an older stream's task: its requests were failed when it broke
        self._stream = None
        call.cancel()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        for future in self._pending.values():
            if not future.done():
                future.set_result(Admission.normal(Reason.BROKER_UNAVAILABLE, reason))
        self._outbox.clear()

    async def close(self) -> None:
        call, self._stream = self._stream, None
        if call is not None:
            with contextlib.suppress(Exception):  # half-close if the stream still works
                async with asyncio.timeout(1.0):
                    await call.done_writing()
            call.cancel()
        for task in [*self._tasks, *self._releases]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._releases, return_exceptions=True)
        self._tasks = []
        await super().close()


async def _write_failure(call: Any, exc: Exception) -> str:
    """Why a write failed. A write fails when the broker has already ended the stream (e.g.
    PERMISSION_DENIED for a caller whose role may not admit), and grpc then raises its internal
    "execute_batch" error; the call's final status, usually in at once, says what happened."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            code = await call.code()
            if code is not grpc.StatusCode.OK:
                return f"broker stream failed ({code.name}): {await call.details()}"
    return f"broker stream failed: {exc!r}"
