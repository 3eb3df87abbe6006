"""A decode agent's online calibration reaches ``crossflowctl describe node`` (issue 31 item 2).

The agent sends its step model on the lease stream (``ConnectRequest.step_model``); the broker
keeps the latest per node in the store and serves it with GetNode; describe prints fitted
against prior constants and the fit's error. Runs on the memory store and on Redis.
"""

from __future__ import annotations

from crossflow_ctl.api.v1 import common_pb2, lease_pb2
from crossflow_ctl.cli.cmd_node import describe_text, detail_data
from crossflow_ctl.client import AdminClient
from crossflow_ctl.domain.models import NodeRole
from crossflow_ctl.domain.online_calibration import StepModelReport, Using
from crossflow_ctl.domain.step_fit import FitStatus
from crossflow_ctl.wire.convert import step_model_to_proto
from tests.broker.conftest import target

REPORT = StepModelReport(
    using=Using.MOVING,
    fit_status=FitStatus.FITTED,
    fit_error=0.031,
    prior_error=0.84,
    windows=12,
    periods=15,
    prior_name="h200",
    prior={"flops_per_s": 7.0e14, "host_step_s": 0.002},
    fitted={"flops_per_s": 2.5e14, "host_step_s": 0.004},
    active={"flops_per_s": 3.5e14, "host_step_s": 0.004},
    at_unix_ms=1_000,
)


async def test_the_step_model_an_agent_sends_is_described(cluster, agents) -> None:
    server = await cluster.start()
    agent = await agents(server, "d1")
    async with AdminClient(target(server)) as admin:
        assert (await admin.get_node("d1")).step_model is None
        text = describe_text(await admin.get_node("d1"), at=2_000)
        assert "Step model:  <none>" in text
        await agent._call.write(lease_pb2.ConnectRequest(step_model=step_model_to_proto(REPORT)))
        await agent.sync()  # handled in order: it is stored
        detail = await admin.get_node("d1")
    assert detail.step_model == REPORT
    text = describe_text(detail, at=2_000)
    section = text[text.index("Step model:") : text.index("Credits:")]
    assert "moving" in section and "h200" in section
    assert "3.1% (prior's 84.0%)" in section
    assert "12 / 15" in section
    flops = next(line for line in section.splitlines() if "flops_per_s" in line).split()
    assert flops == ["flops_per_s", "7e+14", "2.5e+14", "3.5e+14", "0.357x"]
    assert detail_data(detail, 2_000)["step_model"]["fitted"]["host_step_s"] == 0.004


async def test_a_bad_step_model_changes_nothing_and_the_stream_stays(cluster, agents) -> None:
    server = await cluster.start()
    agent = await agents(server, "d1")
    good = step_model_to_proto(REPORT)
    await agent._call.write(lease_pb2.ConnectRequest(step_model=good))
    bad = common_pb2.StepModel()
    bad.CopyFrom(good)
    bad.fitted["warp_speed"] = 9.0
    await agent._call.write(lease_pb2.ConnectRequest(step_model=bad))
    negative = common_pb2.StepModel(using="fitted", fit_error=-1.0)
    await agent._call.write(lease_pb2.ConnectRequest(step_model=negative))
    await agent.sync()
    assert agent.ended is None, "a refused report does not end the stream"
    async with AdminClient(target(server)) as admin:
        assert (await admin.get_node("d1")).step_model == REPORT


async def test_the_step_model_goes_with_the_node(cluster, agents) -> None:
    server = await cluster.start()
    agent = await agents(server, "d1")
    await agent._call.write(lease_pb2.ConnectRequest(step_model=step_model_to_proto(REPORT)))
    await agent.sync()
    await agent.close()
    await server.broker.delete_node("d1", force=True)
    await server.broker.register("d1", NodeRole.DECODE, "default", {})
    async with AdminClient(target(server)) as admin:
        assert (await admin.get_node("d1")).step_model is None
