"""AdmitStream: many admissions on one bidirectional stream, decided in batches.

A reader task takes request messages off the stream into a small bounded queue (so a fast
client meets gRPC flow control, not unbounded memory); the handler takes every item queued so
far, up to ``MAX_BATCH``, decides them with ONE ``Broker.admit_many`` call (their debits go to
the store together: one Redis pipeline per round), and writes one response message with a
result per item. While a batch is decided the next one queues, so the batch grows with load.

Per item: a bad request gets an error result naming the field (INVALID_ARGUMENT) and the rest
of its batch is decided as usual; a store error or timeout gives NORMAL decisions (fail closed).
The stream itself stays up until the client half-closes or cancels it; a message that is not a
valid request (undecodable bytes) ends it with INVALID_ARGUMENT naming ``request``, after every
item before it was answered.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import grpc

from crossflow_ctl.api.v1 import admission_pb2
from crossflow_ctl.domain.admission import AdmissionRequest
from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.service.broker import Broker
from crossflow_ctl.wire.convert_admission import (
    admission_into_proto,
    admit_request_from_proto,
    explains,
)

MAX_BATCH = 64
"""Items decided together: small enough that planning them (CPU) stays well inside the
policy's ``admit_timeout_ms``, large enough that one round trip serves many."""
QUEUED_MESSAGES = 64
"""Request messages read ahead of the batch being decided."""

_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


async def decide(
    broker: Broker, items: Sequence[admission_pb2.AdmitStreamItem], owner: str = ""
) -> admission_pb2.AdmitStreamResponse:
    """One result per item: a decision, or an error for an item that is not a valid request
    (the errors first, then the decisions in item order). Results are written into the
    response in place (:func:`admission_into_proto`)."""
    response = admission_pb2.AdmitStreamResponse()
    add = response.results.add
    ids: list[int] = []
    requests: list[AdmissionRequest] = []
    for item in items:
        try:
            requests.append(admit_request_from_proto(item.request))
        except InvalidArgument as exc:
            add(id=item.id, error=admission_pb2.AdmitStreamError(code=_INVALID, message=str(exc)))
        else:
            ids.append(item.id)
    answers = await broker.admit_many(requests, owner)
    for item_id, request, answer in zip(ids, requests, answers, strict=True):
        admission_into_proto(answer, add(id=item_id).decision, explain=explains(request))
    return response


async def answer_stream(
    broker: Broker, requests: AsyncIterator[admission_pb2.AdmitStreamRequest], owner: str = ""
) -> AsyncIterator[admission_pb2.AdmitStreamResponse]:
    """Responses for the stream's requests, batch by batch, until the client half-closes.
    Grants record ``owner`` (the caller's identity, "" without authentication)."""
    queue: asyncio.Queue[admission_pb2.AdmitStreamRequest | None] = asyncio.Queue(QUEUED_MESSAGES)

    done = asyncio.Event()
    refused: list[InvalidArgument] = []

    async def read() -> None:
        try:
            async for message in requests:
                await queue.put(message)
        except InvalidArgument as exc:  # bytes that are not a request message (decoding.py)
            refused.append(exc)
        finally:
            done.set()
            with contextlib.suppress(asyncio.QueueFull):  # full: the loop sees ``done``
                queue.put_nowait(None)

    reader = asyncio.create_task(read(), name="admit-stream-reader")
    items: list[admission_pb2.AdmitStreamItem] = []
    try:
        while True:
            if not items:
                if queue.empty() and done.is_set():
                    break
                message = await queue.get()
                if message is None:
                    break
                items.extend(message.items)
            while len(items) < MAX_BATCH and not queue.empty():
                message = queue.get_nowait()
                if message is None:
                    break
                items.extend(message.items)
            batch, items = items[:MAX_BATCH], items[MAX_BATCH:]
            if batch:
                yield await decide(broker, batch, owner)
        if refused:  # what came before it was answered; the stream ends naming the field
            raise refused[0]
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
