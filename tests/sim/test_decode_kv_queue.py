"""A decode node gives KV room to both kinds of arrival in one queue, in arrival order.

A transferred request (normal path) and a borrowed prompt both need KV on the node and an
engine admits them with one scheduler, so on a full node neither may take room ahead of the
other: the simulator must not flatter whichever policy borrows most.
"""

from __future__ import annotations

from crossflow_ctl.domain.lease_credits import compute_capacity
from crossflow_ctl.sim.agents import DecodeAgent
from crossflow_ctl.sim.config import SimConfig
from crossflow_ctl.sim.servers import DecodeServer, EventQueue, Req, StepModel

CFG = SimConfig()


def _server(kv_capacity: int) -> tuple[DecodeServer, EventQueue]:
    events = EventQueue()
    server = DecodeServer(
        0,
        StepModel(CFG.model_spec, CFG.node_profile),
        events,
        kv_capacity=kv_capacity,
        max_batch=CFG.max_batch,
        max_macro=CFG.max_macro_steps,
        borrow_chunk=CFG.borrow_chunk_tokens,
    )
    return server, events


def _run(server: DecodeServer, events: EventQueue) -> None:
    while len(events):
        t, _, _, gen = events.pop()
        server.step_end(t, gen)  # type: ignore[arg-type]


def _req(rid: int, prompt: int, output: int, borrowed: bool = False) -> Req:
    return Req(rid, prompt, output, 0, 0.0, measured=True, borrowed=borrowed)


def test_borrowed_prompt_waits_behind_an_earlier_transferred_request_on_a_full_node() -> None:
    server, events = _server(kv_capacity=10_000)
    server.arrive_normal(_req(0, 7_000, 1_000), 0.0)  # holds 8,000 of 10,000
    transferred = _req(1, 2_500, 500)  # needs 3,000: waits for room
    server.arrive_normal(transferred, 0.001)
    borrowed = _req(2, 1_000, 500, borrowed=True)  # needs 1,500: would fit now
    server.arrive_borrowed(borrowed, 0.002)
    assert server.kv_used == 8_000
    _run(server, events)
    assert transferred.first_token_s > 0.0
    assert borrowed.start_s >= transferred.first_token_s
    assert server.borrow_kv_waits == 1


def test_transferred_request_waits_behind_an_earlier_borrowed_prompt_on_a_full_node() -> None:
    server, events = _server(kv_capacity=10_000)
    server.arrive_normal(_req(0, 7_000, 1_000), 0.0)
    borrowed = _req(1, 2_500, 500, borrowed=True)  # needs 3,000: waits for room
    server.arrive_borrowed(borrowed, 0.001)
    transferred = _req(2, 1_000, 500)  # needs 1,500: would fit now
    server.arrive_normal(transferred, 0.002)
    _run(server, events)
    assert borrowed.start_s > 0.0
    assert transferred.first_token_s >= borrowed.start_s


def test_borrowed_prompts_hold_their_kv_and_prefill_in_arrival_order() -> None:
    server, events = _server(kv_capacity=100_000)
    first, second = _req(0, 4_000, 10, borrowed=True), _req(1, 3_000, 10, borrowed=True)
    server.arrive_borrowed(first, 0.0)
    server.arrive_borrowed(second, 0.0)
    _run(server, events)
    assert server.borrow_kv_waits == 0
    assert 0.0 <= first.start_s < first.first_token_s <= second.start_s < second.first_token_s
    assert server.kv_used == 0 and server.borrowed_kv == 0 and server.borrowed_outstanding == 0


def test_the_agent_reports_the_kv_promised_to_waiting_transferred_requests() -> None:
    server, events = _server(kv_capacity=100_000)
    server.arrive_normal(_req(0, 90_000, 1_000), 0.0)  # holds 91,000 of 100,000
    server.arrive_normal(_req(1, 20_000, 500), 0.001)  # needs 20,500: waits for room
    server.arrive_borrowed(_req(2, 1_000, 500, borrowed=True), 0.002)  # the broker counts it
    lease = CFG.lease.model_copy(update={"kv_reserve_fraction": 0.0})
    agent = DecodeAgent(server, "d0", CFG.model_spec, CFG.node_profile, lease, 0.2, 600)
    snap = agent.snapshot(0.003, 3)
    assert (snap.kv_waiting_requests, snap.kv_waiting_tokens) == (1, 20_500)
    cap = compute_capacity(snap, CFG.model_spec, CFG.node_profile, lease)
    assert cap.kv_free_tokens == 9_000 and cap.credits.kv_tokens == 0  # all of it promised
    _run(server, events)
    assert (server.promised_requests, server.promised_kv) == (0, 0)
    assert agent.snapshot(server.t0, 4).kv_waiting_requests == 0
