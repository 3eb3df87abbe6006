"""DESIGN.md §5.7: bad input is refused with a status naming the field, and nothing changes.

(The store's own refusals are proved by the store contract suite; these go through the wire.)
"""

from __future__ import annotations

import math
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossflow_ctl.api.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    lease_pb2,
)
from crossflow_ctl.client import AdminClient, AdmissionClient
from crossflow_ctl.domain.admission import Decision, Reason
from crossflow_ctl.domain.errors import FailedPrecondition, InvalidArgument, NotFound
from crossflow_ctl.domain.models import MAX_BYTES, MAX_SLOTS, MAX_TOKENS
from tests.broker.agents import FakeAgent, lease_msg
from tests.broker.conftest import target


@pytest.fixture
async def node(cluster, agents) -> tuple[Any, FakeAgent]:
    server = await cluster.start()
    agent = await agents(server, "d1")
    assert (await agent.send_lease()).result == lease_pb2.LEASE_RESULT_ACCEPTED
    return server, agent


async def _stored_version(server: Any) -> tuple[int, int]:
    async with AdminClient(target(server)) as admin:
        lease = (await admin.get_node("d1")).node.state.lease
        assert lease is not None
        return lease.lease.version, lease.lease.credits.compute_tokens


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"credits": {"compute_tokens": -1}}, "lease.credits.compute_tokens"),
        ({"credits": {"kv_tokens": MAX_TOKENS + 1}}, "lease.credits.kv_tokens"),
        ({"credits": {"kv_transfer_bytes": 2**62}}, "lease.credits.kv_transfer_bytes"),
        ({"credits": {"slots": -5}}, "lease.credits.slots"),
        ({"queue_wait_ms": math.nan}, "lease.queue_wait_ms"),
        ({"borrowed_prefill_rate_tps": math.inf}, "lease.borrowed_prefill_rate_tps"),
        ({"prefill_s_per_token": -1e-6}, "lease.prefill_s_per_token"),
        ({"prefill_s_per_token": math.nan}, "lease.prefill_s_per_token"),
        ({"prefill_s_per_token": 2.0}, "lease.prefill_s_per_token"),
        ({"prefill_s_per_token_context": math.inf}, "lease.prefill_s_per_token_context"),
        ({"prefill_s_per_token_context": 0.5}, "lease.prefill_s_per_token_context"),
        ({"ttl_ms": 0}, "lease.ttl_ms"),
        ({"ttl_ms": -10}, "lease.ttl_ms"),
    ],
)
async def test_bad_lease_is_acked_invalid_and_stream_stays_up(node, fields, named) -> None:
    server, agent = node
    before = await _stored_version(server)
    ack = await agent.send_lease(lease_msg("d1", 1, 99, **fields))
    assert ack.result == lease_pb2.LEASE_RESULT_INVALID
    assert ack.message.startswith(named), ack.message
    assert await _stored_version(server) == before
    # The stream is still up: the next good lease is accepted.
    assert (await agent.send_lease()).result == lease_pb2.LEASE_RESULT_ACCEPTED


async def test_lease_for_another_node_or_empty_id_is_invalid(node) -> None:
    server, agent = node
    ack = await agent.send_lease(lease_msg("d2", 1, 50))
    assert ack.result == lease_pb2.LEASE_RESULT_INVALID and "lease.node_id" in ack.message
    ack = await agent.send_lease(lease_msg("", 1, 50))
    assert ack.result == lease_pb2.LEASE_RESULT_INVALID and "lease.node_id" in ack.message
    assert (await _stored_version(server))[0] == 1


async def test_version_regression_is_stale_with_stored_version(node) -> None:
    server, agent = node
    ack = await agent.send_lease(lease_msg("d1", 1, 1, credits={"compute_tokens": 5}))
    assert ack.result == lease_pb2.LEASE_RESULT_STALE
    assert (ack.stored_epoch, ack.stored_version) == (1, 1)
    assert "lease.version" in ack.message
    assert await _stored_version(server) == (1, 8_000)


async def test_hello_must_come_first(cluster) -> None:
    server = await cluster.start()
    async with grpc.aio.insecure_channel(target(server)) as channel:
        from crossflow_ctl.api.v1 import lease_pb2_grpc

        call = lease_pb2_grpc.LeaseServiceStub(channel).Connect()
        await call.write(lease_pb2.ConnectRequest(lease=lease_msg("d1", 1, 1)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "hello" in (err.value.details() or "")

        call = lease_pb2_grpc.LeaseServiceStub(channel).Connect()
        await call.write(lease_pb2.ConnectRequest(hello=lease_pb2.Hello(node_id="bad id!")))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith("hello.node_id")
    async with AdminClient(target(server)) as admin:
        assert await admin.list_nodes() == []


async def test_admit_bad_input_is_invalid_argument(cluster) -> None:
    server = await cluster.start()
    async with grpc.aio.insecure_channel(target(server)) as channel:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        for request, named in [
            (admission_pb2.AdmitRequest(uncached_prompt_tokens=-1), "uncached_prompt_tokens"),
            (
                admission_pb2.AdmitRequest(uncached_prompt_tokens=MAX_TOKENS + 1),
                "uncached_prompt_tokens",
            ),
            (
                admission_pb2.AdmitRequest(
                    uncached_prompt_tokens=1, candidate_node_ids=["x" * 200]
                ),
                "candidate_node_ids.0",
            ),
            (admission_pb2.AdmitRequest(uncached_prompt_tokens=1, pool="no spaces"), "pool"),
            (
                admission_pb2.AdmitRequest(uncached_prompt_tokens=1, held_ahead_tokens=-1),
                "held_ahead_tokens",
            ),
            (
                admission_pb2.AdmitRequest(
                    uncached_prompt_tokens=1, held_ahead_tokens=MAX_TOKENS + 1
                ),
                "held_ahead_tokens",
            ),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Admit(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (err.value.details() or "").startswith(named), err.value.details()


async def test_oversized_message_is_refused(cluster) -> None:
    server = await cluster.start(max_message_bytes=64 * 1024)
    async with AdmissionClient(target(server), timeout_s=5) as client:
        with pytest.raises(InvalidArgument):
            await client.admit(
                request_id="",
                uncached_prompt_tokens=1,
                candidate_node_ids=[f"n{i:0100d}" for i in range(1000)],
            )


async def test_reservation_and_node_errors(node) -> None:
    server, _ = node
    async with (
        AdmissionClient(target(server), timeout_s=5) as client,
        AdminClient(target(server)) as admin,
    ):
        with pytest.raises(NotFound):
            await client.commit("0" * 32 + "@d1")
        with pytest.raises(NotFound):
            await client.release("0" * 32 + "@d1")
        with pytest.raises(InvalidArgument) as bad:
            await client.commit("")
        assert bad.value.field == "reservation_id"
        with pytest.raises(InvalidArgument) as bad:
            await client.release("r" * 300)
        assert bad.value.field == "reservation_id"
        with pytest.raises(NotFound):
            await admin.get_node("nobody")
        with pytest.raises(NotFound):
            await admin.cordon("nobody")
        for node_id in ("", "x" * 129, "bad id"):
            with pytest.raises(InvalidArgument) as bad:
                await admin.get_node(node_id)
            assert bad.value.field == "node_id"
        with pytest.raises(InvalidArgument) as bad:
            await admin.list_nodes(selector="=novalue")
        assert bad.value.field == "selector"
        assert await admin.list_reservations() == []


async def test_bad_policy_update_is_refused_and_policy_unchanged(cluster) -> None:
    server = await cluster.start()
    async with AdminClient(target(server)) as admin:
        before = await admin.get_policy()
        for updates, named in [
            ({"borrow_share": 1.5}, "borrow_share"),
            ({"borrow_share": "NaN"}, "borrow_share"),
            ({"borrow_kv_share": -0.1}, "borrow_kv_share"),
            ({"no_such_knob": 1}, "no_such_knob"),
            ({"commit_ttl_ms": 10}, ""),
        ]:
            with pytest.raises(InvalidArgument) as bad:
                await admin.set_policy(updates)
            if named:
                assert bad.value.field is not None and named in bad.value.field, bad.value
        assert await admin.get_policy() == before
        after = await admin.set_policy({"borrow_share": 0.25, "shadow_mode": True})
        assert after.policy.borrow_share == 0.25 and after.policy.shadow_mode


async def test_commit_after_release_fails_precondition(node, agents) -> None:
    server, _ = node
    prefill = await agents(server, "p1", role=common_pb2.NODE_ROLE_PREFILL)
    await prefill.send_pool_load()
    await prefill.sync()
    async with AdmissionClient(target(server), timeout_s=5) as client:
        adm = await client.admit(uncached_prompt_tokens=100)
        assert adm.reservation_id, adm.message
        await client.release(adm.reservation_id)
        await client.release(adm.reservation_id)  # idempotent
        with pytest.raises(FailedPrecondition):
            await client.commit(adm.reservation_id)


credit_values = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([MAX_TOKENS, MAX_TOKENS + 1, MAX_BYTES, MAX_SLOTS + 1]),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    credits=st.fixed_dictionaries(
        {
            "compute_tokens": credit_values,
            "kv_tokens": credit_values,
            "kv_transfer_bytes": credit_values,
            "output_tokens": credit_values,
            "slots": credit_values,
        }
    )
)
async def test_any_credit_is_stored_iff_valid(node, credits: dict[str, int]) -> None:
    server, agent = node
    limits = {
        "compute_tokens": MAX_TOKENS,
        "kv_tokens": MAX_TOKENS,
        "output_tokens": MAX_TOKENS,
        "kv_transfer_bytes": MAX_BYTES,
        "slots": MAX_SLOTS,
    }
    bad = [k for k, v in credits.items() if not 0 <= v <= limits[k]]
    before = await _stored_version(server)
    # No rate: compute is stored as sent, not capped to the horizon (test_policy_horizon).
    ack = await agent.send_lease(credits=credits, borrowed_prefill_rate_tps=0.0)
    if bad:
        assert ack.result == lease_pb2.LEASE_RESULT_INVALID
        assert ack.message.startswith(f"lease.credits.{bad[0]}") or any(
            ack.message.startswith(f"lease.credits.{b}") for b in bad
        )
        assert await _stored_version(server) == before
    else:
        assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED
        assert await _stored_version(server) == (agent.version, credits["compute_tokens"])


# -- issue 12: nothing reaches a caller as UNKNOWN; refusals carry google.rpc details ------------
def _bad_request_fields(err: grpc.aio.AioRpcError) -> list[str]:
    """The fields named by the google.rpc.BadRequest in the call's trailers."""
    status = rpc_status.from_call(err)
    assert status is not None, "no google.rpc.Status in the trailers"
    assert status.code == err.code().value[0]
    fields = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        assert detail.Unpack(bad), detail.type_url
        fields += [v.field for v in bad.field_violations]
    return fields


async def test_release_with_unknown_outcome_names_the_field(node) -> None:
    server, _ = node
    async with grpc.aio.insecure_channel(target(server)) as channel:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        request = admission_pb2.ReleaseRequest(reservation_id="0" * 32 + "@d1", outcome=99)  # type: ignore[arg-type]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Release(request, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("outcome:")
    assert _bad_request_fields(err.value) == ["outcome"]


@pytest.mark.parametrize(
    "method",
    [
        "/crossflow.v1.AdmissionService/Admit",
        "/crossflow.v1.AdmissionService/Release",
        "/crossflow.v1.AdminService/SetPolicy",
        "/crossflow.v1.AdminService/GetNode",
    ],
)
async def test_corrupt_protobuf_bytes_are_invalid_argument(node, method: str) -> None:
    server, _ = node
    before = await _stored_version(server)
    async with grpc.aio.insecure_channel(target(server)) as channel:
        call = channel.unary_unary(method)  # raw bytes in and out, no (de)serializer
        for junk in (b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x08" + b"\x80" * 11):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(junk, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert _bad_request_fields(err.value) == ["request"]
    assert await _stored_version(server) == before


async def test_corrupt_bytes_on_the_agent_stream_end_it_invalid(node) -> None:
    server, _ = node
    hello = lease_pb2.ConnectRequest(hello=lease_pb2.Hello(node_id="d9")).SerializeToString()
    async with grpc.aio.insecure_channel(target(server)) as channel:
        for first in ([], [hello]):  # junk instead of the Hello, and junk after it
            call = channel.stream_stream("/crossflow.v1.LeaseService/Connect")()
            for data in first:
                await call.write(data)
            await call.write(b"\xff\xff\xff")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while True:
                    await call.read()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (err.value.details() or "").startswith("request:")


async def test_corrupt_bytes_on_admit_stream_end_it_invalid_after_answering_the_rest(
    node,
) -> None:
    server, _ = node
    good = admission_pb2.AdmitStreamRequest(
        items=[
            admission_pb2.AdmitStreamItem(
                id=7, request=admission_pb2.AdmitRequest(uncached_prompt_tokens=100)
            )
        ]
    ).SerializeToString()
    async with grpc.aio.insecure_channel(target(server)) as channel:
        call = channel.stream_stream("/crossflow.v1.AdmissionService/AdmitStream")()
        await call.write(good)
        answered = admission_pb2.AdmitStreamResponse.FromString(await call.read())
        assert [r.id for r in answered.results] == [7]
        await call.write(b"\xff\xff\xff")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                await call.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert (err.value.details() or "").startswith("request:")


async def test_huge_or_nested_policy_values_name_the_key(cluster) -> None:
    server = await cluster.start()
    async with grpc.aio.insecure_channel(target(server)) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        before = await stub.GetPolicy(admin_pb2.GetPolicyRequest(), timeout=5)
        cases = [
            ({"borrow_share": "[" * 100_000 + "]" * 100_000}, "updates.borrow_share"),
            ({"borrow_share": '{"a":' * 50 + "1" + "}" * 50}, "updates.borrow_share"),
            ({"hold_ttl_ms": "9" * 5_000}, "updates.hold_ttl_ms"),
            ({"hold_ttl_ms": "1e999999"}, "hold_ttl_ms"),
            ({f"k{i}": "1" for i in range(1_000)}, "updates"),
        ]
        for updates, named in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SetPolicy(admin_pb2.SetPolicyRequest(updates=updates), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert _bad_request_fields(err.value)[0].startswith(named), err.value.details()
        after = await stub.GetPolicy(admin_pb2.GetPolicyRequest(), timeout=5)
        assert after == before


async def test_unexpected_exception_is_internal_and_logged(cluster, monkeypatch) -> None:
    server = await cluster.start()

    async def broken() -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.broker, "list_pools", broken)
    async with grpc.aio.insecure_channel(target(server)) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListPools(admin_pb2.ListPoolsRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "a bug" not in (err.value.details() or "")  # no internals leak to callers


async def test_empty_admit_never_borrows(node, agents) -> None:
    server, _ = node
    prefill = await agents(server, "p1", role=common_pb2.NODE_ROLE_PREFILL)
    await prefill.send_pool_load()
    await prefill.sync()
    async with AdmissionClient(target(server), timeout_s=5) as client:
        assert (await client.admit(uncached_prompt_tokens=100)).reservation_id  # room exists
        for fields in ({}, {"cached_prefix_tokens": 5_000, "expected_output_tokens": 10}):
            adm = await client.admit(uncached_prompt_tokens=0, **fields)
            assert adm.decision is Decision.NORMAL and not adm.reservation_id, adm
            assert adm.reason is Reason.NO_BENEFIT
        assert len(await AdminClient(target(server)).list_reservations()) == 1
