"""Fuzzing every RPC of the broker over real gRPC (issue 12): shared by tests/broker/test_fuzz.py
(a few hundred cases in CI) and benchmarks/fuzz.py (>= 10,000 cases, histogram printed).

A case is one RPC (every method of every ``crossflow.v1`` service, found from the descriptors,
so a new RPC is fuzzed without a change here) with a request built field by field from the
message descriptor: extreme and random numbers, NaN and infinities, unknown enum numbers, odd,
huge and almost-valid strings and ids, nested messages, maps, and a share of raw bytes that are
not a valid message at all (random, or a valid encoding with bytes flipped or cut). For the agent
stream a case is a Hello, then a lease or pool load, each possibly corrupt.

:func:`run_case` sends it and returns what came back; :class:`Snapshot` reads every key of the
store's namespace (DUMP per key) so a caller can check that a refusal changed nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st
from redis.asyncio import Redis

from crossflow_ctl.api.v1 import admin_pb2, admission_pb2, common_pb2, lease_pb2
from crossflow_ctl.domain.policy import PolicySettings

FORBIDDEN = ("UNKNOWN", "INTERNAL")
"""Status codes the broker must never answer: a Python exception escaped, or a bug."""
STREAM_TIMEOUT_S = 5.0

_MODULES = (admission_pb2, admin_pb2, lease_pb2)
METHODS: tuple[MethodDescriptor, ...] = tuple(
    method
    for module in _MODULES
    for service in module.DESCRIPTOR.services_by_name.values()
    for method in service.methods
)
CONNECT = lease_pb2.DESCRIPTOR.services_by_name["LeaseService"].methods_by_name["Connect"]


def _path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


SERVER_STREAMING = {_path(m) for m in METHODS if m.server_streaming and not m.client_streaming}
CLIENT_STREAMING = {_path(m) for m in METHODS if m.client_streaming and m is not CONNECT}

IDS = ("d1", "d2", "p1", "", "bad id", "x" * 200, "d1\x00", "-lead", "ü", "0" * 32 + "@d1")
POLICY_KEYS = (*PolicySettings.model_fields, "no_such_knob", "", "{")
EDGE_INTS = (0, 1, -1, 2**31 - 1, -(2**31), 2**53 + 1, 2**63 - 1, -(2**63), 10**9 + 1, 10**15)
EDGE_FLOATS = (0.0, -0.0, -1.0, 1e308, -1e308, 5e-324, math.nan, math.inf, -math.inf)
JSONISH = ("true", "false", "0.3", "-1", "NaN", "1e999", "[" * 500, '{"a":1}', "null", '"x"')


def _text(name: str) -> st.SearchStrategy[str]:
    if name.endswith("node_id") or name in ("pool", "selector", "reservation_id"):
        return st.sampled_from(IDS) | st.text(max_size=12)
    return st.sampled_from(("", "x" * 5_000, "\x00\n", "ok")) | st.text(max_size=40)


def _ints(field: FieldDescriptor) -> st.SearchStrategy[int]:
    bits = 32 if field.type in _INT32 else 64
    lo = 0 if field.type in _UNSIGNED else -(2 ** (bits - 1))
    hi = 2**bits - 1 if field.type in _UNSIGNED else 2 ** (bits - 1) - 1
    edges = [v for v in EDGE_INTS if lo <= v <= hi]
    plausible = st.integers(min_value=max(lo, 0), max_value=5_000)
    return plausible | st.sampled_from(edges) | st.integers(min_value=lo, max_value=hi)


_T = FieldDescriptor
_INT32 = {_T.TYPE_INT32, _T.TYPE_UINT32, _T.TYPE_SINT32, _T.TYPE_FIXED32, _T.TYPE_SFIXED32}
_UNSIGNED = {_T.TYPE_UINT32, _T.TYPE_UINT64, _T.TYPE_FIXED32, _T.TYPE_FIXED64}
_INTS = _INT32 | {_T.TYPE_INT64, _T.TYPE_UINT64, _T.TYPE_SINT64, _T.TYPE_FIXED64, _T.TYPE_SFIXED64}


def _scalar(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == _T.TYPE_STRING:
        return _text(field.name)
    if field.type in _INTS:
        return _ints(field)
    if field.type in (_T.TYPE_DOUBLE, _T.TYPE_FLOAT):
        plausible = st.floats(min_value=0.0, max_value=10_000.0)
        return plausible | st.sampled_from(EDGE_FLOATS) | st.floats()
    if field.type == _T.TYPE_BOOL:
        return st.booleans()
    if field.type == _T.TYPE_ENUM:
        return st.integers(min_value=-3, max_value=16)
    if field.type == _T.TYPE_BYTES:
        return st.binary(max_size=32)
    if field.type == _T.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    raise AssertionError(f"no strategy for {field.full_name} (type {field.type})")


def _map_entries(field: FieldDescriptor, depth: int) -> st.SearchStrategy[dict[str, Any]]:
    keys = st.sampled_from(POLICY_KEYS) if field.name == "updates" else st.text(max_size=20)
    value = field.message_type.fields_by_name["value"]
    values: st.SearchStrategy[Any] = (
        st.sampled_from(JSONISH) | st.text(max_size=30)
        if value.type == _T.TYPE_STRING
        else _scalar(value, depth)
    )
    return st.dictionaries(keys, values, max_size=6)


def _field(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return _map_entries(field, depth)
    if field.is_repeated:
        return st.lists(_scalar(field, depth), max_size=4)
    return _scalar(field, depth)


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor`` with every field absent or random (nesting bounded)."""
    cls = GetMessageClass(descriptor)
    if depth > 2:
        return st.just(cls())
    parts = {field.name: st.none() | _field(field, depth) for field in descriptor.fields}

    def build(values: dict[str, Any]) -> Message:
        msg = cls()
        for name, value in values.items():
            if value is None:
                continue
            field = descriptor.fields_by_name[name]
            target = getattr(msg, name) if field.is_repeated else None
            if isinstance(value, dict):
                getattr(msg, name).update(value)
            elif isinstance(value, list) and field.message_type is not None:
                for item in value:
                    target.add().CopyFrom(item)  # type: ignore[union-attr]
            elif isinstance(value, list):
                target.extend(value)  # type: ignore[union-attr]
            elif isinstance(value, Message):
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg  # of several oneof members set, the last one won, as on the wire

    return st.fixed_dictionaries(parts).map(build)


def wire_bytes(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """A valid encoding (most cases), a corrupted one, or junk."""
    valid = messages(descriptor).map(lambda m: m.SerializeToString())

    def corrupt(data: bytes, at: int, byte: int, cut: bool) -> bytes:
        if not data:
            return bytes([byte])
        i = at % len(data)
        return data[:i] if cut else data[:i] + bytes([byte]) + data[i + 1 :]

    corrupted = st.builds(
        corrupt, valid, st.integers(0, 10_000), st.integers(0, 255), st.booleans()
    )
    return st.one_of(valid, valid, valid, corrupted, st.binary(min_size=1, max_size=64))


@dataclass(frozen=True)
class Case:
    method: str
    """``/package.Service/Method``."""
    payload: tuple[bytes, ...]
    """One request (unary), or the stream's messages in order."""


def _hello() -> st.SearchStrategy[bytes]:
    good = st.builds(
        lambda node, role: lease_pb2.ConnectRequest(
            hello=lease_pb2.Hello(node_id=node, role=role, epoch=1)
        ).SerializeToString(),
        st.sampled_from(("d1", "d2", "p1")),
        st.sampled_from((common_pb2.NODE_ROLE_DECODE, common_pb2.NODE_ROLE_PREFILL)),
    )
    return st.one_of(good, good, good, wire_bytes(lease_pb2.ConnectRequest.DESCRIPTOR))


def _stream_body() -> st.SearchStrategy[bytes]:
    """A lease or pool load with random fields (most of them), or any ConnectRequest bytes."""
    lease = messages(common_pb2.Lease.DESCRIPTOR).map(
        lambda m: lease_pb2.ConnectRequest(lease=m).SerializeToString()
    )
    load = messages(common_pb2.PoolLoad.DESCRIPTOR).map(
        lambda m: lease_pb2.ConnectRequest(pool_load=m).SerializeToString()
    )
    return st.one_of(lease, lease, load, wire_bytes(lease_pb2.ConnectRequest.DESCRIPTOR))


def _case_of(path: str) -> Any:
    return lambda payload: Case(path, payload)


def cases() -> st.SearchStrategy[Case]:
    """Any RPC with any request (the stream: a Hello, then one or two messages)."""
    options = []
    for method in METHODS:
        body = wire_bytes(method.input_type)
        if method is CONNECT:
            more = _stream_body()
            payload = st.tuples(_hello(), more) | st.tuples(_hello(), more, more)
        elif method.client_streaming:
            payload = st.lists(body, min_size=1, max_size=3).map(tuple)
        else:
            payload = body.map(lambda b: (b,))
        options.append(payload.map(_case_of(_path(method))))
    return st.one_of(options)


class Snapshot:
    """Every key of one namespace with its DUMP (values compared byte for byte, not TTLs)."""

    def __init__(self, client: Redis, namespace: str) -> None:
        self._r = client
        self._match = f"{namespace}*"

    async def take(self) -> dict[bytes, bytes]:
        keys = sorted([k async for k in self._r.scan_iter(match=self._match, count=1000)])
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.dump(key)
        return dict(zip(keys, await pipe.execute(), strict=True))


@dataclass(frozen=True)
class Outcome:
    code: str
    """Status code name, or ``OK``; for the stream ``OK`` with the lease ack result."""
    refused: bool
    """True when the call (or the stream's last message) was refused: nothing may change."""
    detail: str = ""


_HEARTBEAT = lease_pb2.ConnectRequest(heartbeat=lease_pb2.Heartbeat()).SerializeToString()


def _ends_stream(message: bytes) -> bool:
    """Whether the broker ends the stream on ``message`` (undecodable, or a second Hello)."""
    try:
        return lease_pb2.ConnectRequest.FromString(message).WhichOneof("body") == "hello"
    except Exception:  # DecodeError, or a RuntimeWarning turned error by the test settings
        return True


def _ack_refused(ack: lease_pb2.LeaseAck) -> bool:
    return ack.result in (lease_pb2.LEASE_RESULT_INVALID, lease_pb2.LEASE_RESULT_STALE)


async def run_case(channel: grpc.aio.Channel, case: Case, snapshot: Snapshot) -> list[str]:
    """Send ``case``; return what went wrong (empty when the broker behaved)."""
    if case.method == _path(CONNECT):
        return await _run_stream(channel, case, snapshot)
    before = await snapshot.take()
    call: Any = None
    try:
        if case.method in SERVER_STREAMING:  # the first answer (or the refusal) is enough
            call = channel.unary_stream(case.method)(case.payload[0], timeout=STREAM_TIMEOUT_S)
            await call.read()
        elif case.method in CLIENT_STREAMING:
            call = channel.stream_stream(case.method)(timeout=STREAM_TIMEOUT_S)
            await _write_until_undecodable(call, case)
            while await call.read() is not grpc.aio.EOF:
                pass
        else:
            await channel.unary_unary(case.method)(case.payload[0], timeout=STREAM_TIMEOUT_S)
        outcome = Outcome("OK", refused=False)
    except grpc.aio.AioRpcError as exc:
        outcome = Outcome(exc.code().name, refused=True, detail=exc.details() or "")
    finally:
        if call is not None:
            call.cancel()
    return _judge(case, outcome, before, await snapshot.take(), [])


INPUT_TYPES = {_path(m): GetMessageClass(m.input_type) for m in METHODS}


async def _write_until_undecodable(call: Any, case: Case) -> None:
    """Write the stream's messages, stopping after one the broker cannot decode (it ends the
    call then, and a later write of ours would fail on the client side, not the broker's)."""
    parse = INPUT_TYPES[case.method].FromString
    for message in case.payload:
        await call.write(message)
        try:
            parse(message)
        except Exception:  # DecodeError, or a RuntimeWarning turned error by the test settings
            return
    await call.done_writing()


async def _sync(call: Any) -> Outcome:
    """Send a heartbeat and read up to its echo (it follows whatever the messages before it
    caused); the lease ack met on the way, if any, is the outcome."""
    await call.write(_HEARTBEAT)
    outcome = Outcome("OK/NO_ACK", refused=False)  # pool load: no ack, judged by code only
    while (reply := await call.read()) is not grpc.aio.EOF:
        msg = lease_pb2.ConnectResponse.FromString(reply)
        if msg.WhichOneof("body") == "lease_ack":
            result = lease_pb2.LeaseResult.Name(msg.lease_ack.result)
            outcome = Outcome(f"OK/{result}", _ack_refused(msg.lease_ack))
        elif msg.WhichOneof("body") == "heartbeat":
            return outcome
    return Outcome("EOF", refused=True)


async def _run_stream(channel: grpc.aio.Channel, case: Case, snapshot: Snapshot) -> list[str]:
    call = channel.stream_stream(case.method)(timeout=STREAM_TIMEOUT_S)
    problems: list[str] = []
    try:
        before = await snapshot.take()
        await call.write(case.payload[0])
        first = await call.read()
        if first is grpc.aio.EOF:
            return _judge(case, Outcome("EOF", True), before, await snapshot.take(), problems)
        welcome = lease_pb2.ConnectResponse.FromString(first)
        if welcome.WhichOneof("body") != "welcome":
            return [f"{case.method}: first reply is not a Welcome: {welcome}"]
        for message in case.payload[1:]:
            await _sync(call)  # whatever the Hello or the last message set off has settled
            before = await snapshot.take()
            await call.write(message)
            if _ends_stream(message):  # writing more would race the broker closing the call
                while await call.read() is not grpc.aio.EOF:
                    pass
                return _judge(case, Outcome("EOF", True), before, await snapshot.take(), problems)
            _judge(case, await _sync(call), before, await snapshot.take(), problems)
        return problems
    except grpc.aio.AioRpcError as exc:
        outcome = Outcome(exc.code().name, refused=True, detail=exc.details() or "")
        return _judge(case, outcome, before, await snapshot.take(), problems)
    finally:
        call.cancel()


HISTOGRAM: dict[str, int] = {}
"""Outcomes seen by this process, ``method code`` -> count (benchmarks/fuzz.py prints it)."""


def _judge(
    case: Case,
    outcome: Outcome,
    before: dict[bytes, bytes],
    after: dict[bytes, bytes],
    problems: list[str],
) -> list[str]:
    name = case.method.rsplit("/", 1)[-1]
    HISTOGRAM[f"{name} {outcome.code}"] = HISTOGRAM.get(f"{name} {outcome.code}", 0) + 1
    if outcome.code in FORBIDDEN or outcome.code == "DEADLINE_EXCEEDED":
        problems.append(f"{name}: {outcome.code} {outcome.detail!r} for {case.payload!r}"[:600])
    if outcome.refused and before != after:
        changed = sorted(set(before.items()) ^ set(after.items()))[:3]
        problems.append(f"{name}: refused ({outcome.code}) yet the store changed: {changed}"[:600])
    return problems
