"""The real crossflowctl binary against a real broker process on loopback."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from pathlib import Path

import yaml

from crossflow_ctl.client import AdmissionClient
from crossflow_ctl.domain.admission import Decision
from tests.broker.agents import FakeAgent
from tests.cli.conftest import Ctl, Fleet


async def test_get_nodes_table_json_yaml(ctl: Ctl, fleet: Fleet) -> None:
    table = await ctl("get", "nodes")
    assert table.rc == 0, table.err
    lines = table.out.splitlines()
    assert lines[0].split()[:4] == ["NAME", "ROLE", "STATUS", "LEASE"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["decode-1"][1:3] == ["decode", "Ready"]
    # a prefill node sends load reports, not leases: its status says whether one is live
    assert rows["prefill-1"][1:3] == ["prefill", "Reporting"]

    as_json = await ctl("get", "nodes", "-o", "json")
    assert as_json.rc == 0
    items = {i["name"]: i for i in json.loads(as_json.out)["items"]}
    assert items["decode-2"]["labels"] == {"zone": "b"}
    # borrow_share 0.5 of the fake lease's 8000 compute tokens, nothing debited yet
    assert items["decode-1"]["compute_tokens"] == 4000
    assert items["decode-1"]["latest_lease"]["credits"]["compute_tokens"] == 8000

    as_yaml = await ctl("get", "nodes", "-o", "yaml", "-l", "zone=a")
    assert as_yaml.rc == 0
    doc = yaml.safe_load(as_yaml.out)
    assert doc["kind"] == "NodeList"
    assert [i["name"] for i in doc["items"]] == ["decode-1"]

    # one selector grammar, applied by the broker (not a second copy in the CLI)
    not_a = await ctl("get", "nodes", "-o", "json", "-l", "zone!=a", "--role", "decode")
    assert not_a.rc == 0, not_a.err
    names = sorted(i["name"] for i in json.loads(not_a.out)["items"])
    assert "decode-1" not in names and "decode-2" in names
    in_set = await ctl("get", "nodes", "-o", "json", "-l", "zone in (a,b)")
    assert sorted(i["name"] for i in json.loads(in_set.out)["items"])[:2] == [
        "decode-1",
        "decode-2",
    ]
    bad = await ctl("get", "nodes", "-l", "zone=(a")
    assert bad.rc == 2, (bad.rc, bad.out, bad.err)
    assert "selector" in bad.err

    wide = await ctl("get", "nodes", "-o", "wide", "--role", "decode")
    assert "LABELS" in wide.out.splitlines()[0]
    assert "prefill-1" not in wide.out

    pools = await ctl("get", "pools", "-o", "json")
    (pool,) = json.loads(pools.out)["items"]
    assert pool["outstanding_uncached_tokens"] == 200_000
    assert pool["estimated_wait_ms"] == 10_000.0


async def test_get_takes_names_as_kubectl_does(ctl: Ctl, fleet: Fleet) -> None:
    """`crossflowctl get nodes decode-2` was a usage error: get took no name."""
    one = await ctl("get", "nodes", "decode-2")
    assert one.rc == 0, one.err
    assert [line.split()[0] for line in one.out.splitlines()] == ["NAME", "decode-2"]
    two = await ctl("get", "leases", "decode-2", "decode-1", "-o", "json")
    assert [i["name"] for i in json.loads(two.out)["items"]] == ["decode-2", "decode-1"]
    # found rows first, then one line naming what was not found, exit 3
    partly = await ctl("get", "nodes", "decode-1", "nope", "gone")
    assert partly.rc == 3, partly
    assert [line.split()[0] for line in partly.out.splitlines()] == ["NAME", "decode-1"]
    assert partly.err == (
        "error: nodes not found: 'nope', 'gone' (`crossflowctl get nodes` lists them)\n"
    )
    none = await ctl("get", "nodes", "nope", "-o", "json")
    assert (none.rc, none.out) == (3, ""), none
    no_lease = await ctl("get", "leases", "prefill-1")  # a prefill node sends no leases
    assert no_lease.rc == 3 and no_lease.err.startswith("error: leases not found: 'prefill-1'")
    both = await ctl("get", "nodes", "decode-1", "-l", "zone=a")
    assert both.rc == 2 and "not both" in both.err
    pool = await ctl("get", "pools", "default", "-o", "json")
    assert [p["name"] for p in json.loads(pool.out)["items"]] == ["default"]
    assert (await ctl("get", "pools", "other")).rc == 3
    assert (await ctl("get", "reservations", "r-nope")).rc == 3


async def test_node_and_lease_columns_say_which_credit_they_show(ctl: Ctl, fleet: Fleet) -> None:
    """`get nodes` showed COMPUTE/SLOTS as lease x share - debits and `get leases` the raw
    credits under the same headers."""
    nodes = (await ctl("get", "nodes", "-o", "wide", "decode-1")).out.splitlines()
    cells = dict(zip(nodes[0].split(), nodes[1].split(), strict=False))
    assert cells["AVAIL-COMPUTE"] == "4000" and "AVAIL-OUTPUT" in cells  # share 0.5 of 8000
    leases = (await ctl("get", "leases", "decode-1")).out.splitlines()
    cells = dict(zip(leases[0].split(), leases[1].split(), strict=False))
    assert cells["COMPUTE"] == "8000"
    said = (await ctl("get", "nodes", "--help")).out
    assert "AVAIL-COMPUTE" in said and "borrow share" in said


async def test_age_is_the_nodes_own_not_its_latest_leases(ctl: Ctl) -> None:
    """AGE was the age of the latest lease, refreshed every period: always 0s. It is the time
    since the node registered, which its agent reconnecting does not reset."""
    agent = FakeAgent(ctl.server, "decode-7")
    await agent.connect()
    try:
        await agent.send_lease()
        first = json.loads((await ctl("get", "nodes", "decode-7", "-o", "json")).out)["items"][0]
        await agent.close()
        agent = FakeAgent(ctl.server, "decode-7")
        await agent.connect()  # a new session, a new Hello
        await agent.send_lease()
        again = json.loads((await ctl("get", "nodes", "decode-7", "-o", "json")).out)["items"][0]
        table = (await ctl("get", "nodes", "decode-7")).out.splitlines()
        described = (await ctl("describe", "node", "decode-7")).out
    finally:
        await agent.close()
    registered = first["registered_at_ms"]
    assert registered and again["registered_at_ms"] == registered
    assert registered <= first["latest_lease"]["received_at_ms"]
    assert again["age_s"] is not None and again["age_s"] >= first["age_s"]
    age = dict(zip(table[0].split(), table[1].split(), strict=False))["AGE"]
    assert age[:-1].isdigit() and age[-1] in "smhd", table
    assert "Registered:" in described and " ago" in described


async def test_admit_explains_each_condition(ctl: Ctl, fleet: Fleet) -> None:
    res = await ctl(
        "admit", "--uncached", "2000", "--cached", "0", "--output-tokens", "100", "--dry-run",
        "--explain",
    )  # fmt: skip
    assert res.rc == 0, res.err
    # --output is the output format here too (it was the output tokens on admit alone, and
    # `admit --uncached 4000 --output json` failed)
    as_json = await ctl("admit", "--uncached", "4000", "--output", "json", "--dry-run")
    assert as_json.rc == 0 and json.loads(as_json.out)["decision"] == "normal", as_json.err
    tokens = await ctl("admit", "--uncached", "2000", "--output", "100", "--dry-run")
    assert tokens.rc == 2 and "'100' is not one of 'table', 'wide', 'json'" in tokens.err, tokens
    assert "would BORROW on decode-" in res.out
    # the prompt's own threshold: 1 x its 100 ms prefill (2,000 tokens at 20,000 tokens/s)
    assert "1. Demand   holds  prefill wait 10000.0 ms > threshold 100.0 ms" in res.out
    assert "2. Benefit  holds" in res.out
    assert "3. Safety   holds" in res.out
    data = json.loads((await ctl("admit", "--uncached", "2000", "--dry-run", "-o", "json")).out)
    assert (data["decision"], data["reason"], data["would_borrow"]) == ("normal", "dry_run", True)
    assert data["reservation_id"] == ""  # dry run: nothing debited
    too_big = await ctl("admit", "--uncached", "9000", "--dry-run", "--explain")
    assert "NORMAL" in too_big.out
    assert "3. Safety   fails" in too_big.out and "compute_tokens" in too_big.out
    # 40,000 tokens held ahead at the pool's 20,000 tokens/s: 2 s more on the normal path.
    held = await ctl(
        "admit", "--uncached", "2000", "--held-ahead", "40000", "--dry-run", "--explain"
    )
    assert "held behind the router's queue 2000.0 + wait 10000.0" in held.out, held.out
    assert (await ctl("admit", "--uncached", "1", "--held-ahead", "-1")).rc == 2


async def test_admit_refusals_name_the_flag_not_the_request_field(ctl: Ctl) -> None:
    """They named AdmissionRequest's fields ("uncached_prompt_tokens: Input should be less
    than or equal to 1000000000", "candidate_node_ids.0: ..."), which no flag is called."""
    cases = {
        ("--uncached", "99999999999"): "error: --uncached: Input should be less than or equal",
        ("--uncached", "1", "--cached", "2000000000"): "error: --cached: ",
        ("--uncached", "1", "--output-tokens", "2000000000"): "error: --output-tokens: ",
        ("--uncached", "1", "--held-ahead", "2000000000"): "error: --held-ahead: ",
        ("--uncached", "1", "--node", "decode-1", "--node", "a b"): "error: --node: ",
        ("--uncached", "1", "--prefix-node", ""): "error: --prefix-node: ",
        ("--uncached", "1", "--pool", "a/b"): "error: --pool: ",
    }
    for args, said in cases.items():
        res = await ctl("admit", *args, "--dry-run")
        assert res.rc == 2 and res.err.startswith(said), (args, res)


async def test_cordon_stops_borrowing_and_uncordon_restores(ctl: Ctl, fleet: Fleet) -> None:
    res = await ctl("cordon", "decode-1", "--reason", "maintenance")
    assert (res.rc, res.out.strip()) == (0, "node/decode-1 cordoned")
    again = await ctl("cordon", "decode-1", "--reason", "maintenance")
    assert (again.rc, again.out.strip()) == (0, "node/decode-1 already cordoned")
    nodes = {
        i["name"]: i for i in json.loads((await ctl("get", "nodes", "-o", "json")).out)["items"]
    }
    assert nodes["decode-1"]["status"] == "Cordoned"
    assert nodes["decode-1"]["compute_tokens"] == 0
    admit = await ctl(
        "admit", "--uncached", "1000", "--node", "decode-1", "--dry-run", "-o", "json"
    )
    assert json.loads(admit.out)["would_borrow"] is False
    described = await ctl("describe", "node", "decode-1")
    assert "Cordoned:" in described.out and "yes (maintenance)" in described.out

    res = await ctl("uncordon", "decode-1")
    assert (res.rc, res.out.strip()) == (0, "node/decode-1 uncordoned")
    again = await ctl("uncordon", "decode-1")
    assert (again.rc, again.out.strip()) == (0, "node/decode-1 already uncordoned")
    admit = await ctl(
        "admit", "--uncached", "1000", "--node", "decode-1", "--dry-run", "-o", "json"
    )
    assert json.loads(admit.out)["would_borrow"] is True


async def test_drain_waits_for_open_reservations(ctl: Ctl, fleet: Fleet) -> None:
    async with AdmissionClient(ctl.server, timeout_s=5) as client:
        granted = await client.admit(uncached_prompt_tokens=1000, candidate_node_ids=("decode-2",))
        assert granted.decision is Decision.BORROW and granted.node_id == "decode-2"
        await client.commit(granted.reservation_id)

        proc = await ctl.start("drain", "decode-2", "--timeout", "20", "--interval", "0.1")
        # The drain has cordoned the node and is waiting on the committed reservation.
        for _ in range(100):
            described = json.loads((await ctl("describe", "node", "decode-2", "-o", "json")).out)
            if described["cordoned"]:
                break
            await asyncio.sleep(0.1)
        assert described["cordoned"] and len(described["reservations"]) == 1
        assert proc.returncode is None
        await client.release(granted.reservation_id)
        async with asyncio.timeout(20):
            out, err = await proc.communicate()
    assert proc.returncode == 0, err
    assert out.decode().splitlines() == ["node/decode-2 cordoned", "node/decode-2 drained"]
    reservations = await ctl("get", "reservations", "--node", "decode-2", "-o", "json")
    assert json.loads(reservations.out)["items"] == []


async def test_drain_keeps_an_earlier_cordon_and_its_reason(ctl: Ctl, fleet: Fleet) -> None:
    """drain cordoned again with reason "drain", overwriting the operator's, and said
    "cordoned" of a node that already was."""
    assert (await ctl("cordon", "decode-1", "--reason", "disk swap, ticket 4711")).rc == 0
    res = await ctl("drain", "decode-1", "--timeout", "5")
    assert (res.rc, res.out.splitlines()) == (
        0, ["node/decode-1 already cordoned", "node/decode-1 drained"]
    ), res  # fmt: skip
    described = (await ctl("describe", "node", "decode-1")).out
    assert "Cordoned:   yes (disk swap, ticket 4711)" in described, described
    # -o json says it too (the reason did not cross the wire: "cordon_reason": "")
    data = json.loads((await ctl("describe", "node", "decode-1", "-o", "json")).out)
    assert data["cordon_reason"] == "disk swap, ticket 4711", data
    nodes = json.loads((await ctl("get", "nodes", "-o", "json")).out)["items"]
    assert {n["name"]: n["cordon_reason"] for n in nodes}["decode-1"] == "disk swap, ticket 4711"
    # a plain cordon of a cordoned node keeps the reason too (it wrote its default over it)
    again = await ctl("cordon", "decode-1")
    assert (again.rc, again.out.strip()) == (0, "node/decode-1 already cordoned"), again
    data = json.loads((await ctl("describe", "node", "decode-1", "-o", "json")).out)
    assert data["cordon_reason"] == "disk swap, ticket 4711", data
    # a new --reason replaces it, as before
    assert (await ctl("cordon", "decode-1", "--reason", "ticket 4712")).rc == 0
    data = json.loads((await ctl("describe", "node", "decode-1", "-o", "json")).out)
    assert data["cordon_reason"] == "ticket 4712", data


async def test_drain_timeout_exits_5_with_one_line(ctl: Ctl, fleet: Fleet) -> None:
    async with AdmissionClient(ctl.server, timeout_s=5) as client:
        granted = await client.admit(uncached_prompt_tokens=500, candidate_node_ids=("decode-1",))
        await client.commit(granted.reservation_id)
        res = await ctl("drain", "decode-1", "--timeout", "0.3", "--interval", "0.1")
        await client.release(granted.reservation_id)
    assert res.rc == 5
    assert res.err.splitlines() == [
        "error: node/decode-1 still has 1 open reservation(s) after 0.3 s"
    ]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_wrong_server_one_clear_line_exit_4(ctl: Ctl) -> None:
    ctl.server = f"127.0.0.1:{_closed_port()}"
    res = await ctl("get", "nodes")
    assert res.rc == 4
    assert res.out == ""
    (line,) = res.err.splitlines()
    assert line.startswith(f"error: cannot reach the broker at {ctl.server}: ")
    assert "store" not in line
    assert line.endswith("(is a broker serving there? pass --server HOST:PORT, or see "
                         "`crossflowctl config view`)")  # fmt: skip


async def test_exit_codes_not_found_and_usage(ctl: Ctl, fleet: Fleet) -> None:
    missing = await ctl("describe", "node", "nope")
    assert (missing.rc, missing.err.strip()) == (
        3,
        "error: node_id: unknown node 'nope' (`crossflowctl get nodes` lists them)",
    )
    assert (await ctl("cordon", "nope")).rc == 3
    bad_format = await ctl("get", "nodes", "-o", "xml")
    assert bad_format.rc == 2 and len(bad_format.err.splitlines()) == 1
    bad_value = await ctl("policy", "set", "borrow_share=2")
    assert bad_value.rc == 2
    assert bad_value.err.startswith("error: borrow_share: ")
    unknown = await ctl("policy", "set", "nonsense=1")
    assert unknown.rc == 2
    assert unknown.err.startswith(
        "error: nonsense: unknown policy setting 'nonsense' (settings: enabled, shadow_mode, "
    ), unknown.err
    assert len(unknown.err.splitlines()) == 1
    # both lowered together would be valid, but the commit TTL alone below the horizon is not:
    # it says what to do, without pydantic's "Value error, " prefix
    below = await ctl("policy", "set", "commit_ttl_ms=3000")
    assert below.rc == 2 and "Value error" not in below.err, below.err
    assert "(raise commit_ttl_ms, or lower borrow_horizon_ms)" in below.err
    assert (await ctl("policy", "set", "novalue")).rc == 2
    policy = json.loads((await ctl("policy", "get", "-o", "json")).out)
    assert policy["borrow_share"] == 0.5  # nothing changed
    changed = await ctl(
        "policy", "set", "borrow_share=0.25", "demand_threshold_ms=150", "-o", "yaml"
    )
    assert changed.rc == 0
    assert yaml.safe_load(changed.out)["borrow_share"] == 0.25
    assert yaml.safe_load(changed.out)["version"] == policy["version"] + 1
    again = await ctl("policy", "set", "borrow_share=0.25", "-o", "json")
    assert again.rc == 0 and "policy unchanged" in again.err
    assert json.loads(again.out)["version"] == policy["version"] + 1  # no new version
    stale = await ctl("policy", "set", "borrow_share=0.9", "--expected-version", "1")
    assert stale.rc == 1 and "policy changed meanwhile" in stale.err, stale
    assert json.loads((await ctl("policy", "get", "-o", "json")).out)["borrow_share"] == 0.25
    assert policy["borrow_kv_share"] == 1.0  # KV is lent whole unless set lower
    kv = await ctl("policy", "set", "borrow_kv_share=0.8", "-o", "json")
    assert kv.rc == 0 and json.loads(kv.out)["borrow_kv_share"] == 0.8
    assert (await ctl("policy", "set", "borrow_kv_share=1.5")).err.startswith(
        "error: borrow_kv_share: "
    )


async def test_describe_node_shows_credits_debits_history(ctl: Ctl, fleet: Fleet) -> None:
    async with AdmissionClient(ctl.server, timeout_s=5) as client:
        granted = await client.admit(uncached_prompt_tokens=1500, candidate_node_ids=("decode-1",))
        assert granted.decision is Decision.BORROW
        await client.commit(granted.reservation_id)  # outlives slow CLI starts on a busy machine
        text = (await ctl("describe", "node", "decode-1")).out
        data = json.loads((await ctl("describe", "node", "decode-1", "-o", "json")).out)
        await client.release(granted.reservation_id)
    for section in ("Latest lease:", "Credits:", "Open reservations:", "Recent leases:", "Events:"):
        assert section in text
    credits = {c["credit"]: c for c in data["credits"]}
    assert credits["compute_tokens"] == {
        "credit": "compute_tokens",
        "lease": 8000,
        "debits": 1500,
        "available": 2500,
    }
    assert [r["id"] for r in data["reservations"]] == [granted.reservation_id]
    assert data["recent_leases"], "lease history is shown"


async def test_describe_pool_shows_servers_load_and_borrowing(ctl: Ctl, fleet: Fleet) -> None:
    """There was no describe pool."""
    async with AdmissionClient(ctl.server, timeout_s=5) as client:
        granted = await client.admit(uncached_prompt_tokens=1500, candidate_node_ids=("decode-1",))
        assert granted.decision is Decision.BORROW
        await client.commit(granted.reservation_id)
        text = await ctl("describe", "pool")
        data = json.loads((await ctl("describe", "pool", "default", "-o", "json")).out)
        await client.release(granted.reservation_id)
    assert text.rc == 0, text.err
    lines = [" ".join(line.split()) for line in text.out.splitlines()]
    for said in (
        "Name: default",
        "Prefill servers: 1, 1 reporting",
        "Outstanding: 200000 uncached tokens",
        "Processing rate: 20000 tokens/s",
        "Estimated wait: 10000 ms",
        "Borrow share: 0.5 of compute, output, slots; 1 of kv, kv_transfer (policy v1)",
        "Lent now: 1500 of 16000 leased compute tokens (9.4%), 1 open reservations on 2 decode"
        " nodes",
        "prefill-1 Reporting 200000 0 20000.0 20000.0 <none>",
        "decode-1 Ready 8000 1500 2500 1",
    ):
        assert said in lines, text.out
    (server,) = data["servers"]
    assert (server["name"], server["status"]) == ("prefill-1", "Reporting")
    assert server["outstanding_uncached_tokens"] == 200_000
    lenders = {n["name"]: n for n in data["lenders"]}
    assert lenders["decode-1"]["debited_compute_tokens"] == 1500
    assert lenders["decode-1"]["compute_tokens"] == 2500  # 8000 x 0.5 - 1500
    assert data["borrowing"]["shares"]["kv_tokens"] == 1.0
    missing = await ctl("describe", "pool", "nope")
    assert missing.rc == 3 and missing.err.startswith("error: pool 'nope' not found"), missing


async def test_describe_node_does_not_show_an_unmeasured_itl_as_0_ms(ctl: Ctl) -> None:
    """An idle decode node's lease says ITL 0 (no step measured, ``ItlGuard``); describe
    printed "ITL / SLO: 0.0 / 50.0 ms", a node faster than any engine."""
    agent = FakeAgent(ctl.server, "decode-8")
    await agent.connect()
    try:
        await agent.send_lease(itl_ms=0.0)
        idle = (await ctl("describe", "node", "decode-8")).out
        await agent.send_lease(itl_ms=21.5)
        busy = (await ctl("describe", "node", "decode-8")).out
    finally:
        await agent.close()
    assert "ITL / SLO:             none measured (idle) / 50.0 ms" in idle, idle
    assert "ITL / SLO:             21.5 / 50.0 ms" in busy, busy


async def test_describe_prefill_node_shows_its_load_report(ctl: Ctl, fleet: Fleet) -> None:
    text = (await ctl("describe", "node", "prefill-1")).out
    data = json.loads((await ctl("describe", "node", "prefill-1", "-o", "json")).out)
    assert "Status:" in text and "Reporting" in text
    assert "Load report:" in text and "200000 uncached tokens" in text
    assert "Latest lease:" not in text and "Credits:" not in text  # a lease is a decode thing
    assert data["status"] == "Reporting"
    assert data["load_report"]["outstanding_uncached_tokens"] == 200_000
    decode = json.loads((await ctl("describe", "node", "decode-1", "-o", "json")).out)
    assert decode["load_report"] is None and decode["status"] == "Ready"


async def test_contexts_file_drives_the_server(ctl: Ctl, fleet: Fleet) -> None:
    res = await ctl(
        "config",
        "set-context",
        "local",
        "--server",
        ctl.server,
        "--default-output",
        "json",
        "--use",
        server=False,
    )
    assert res.rc == 0, res.err
    nodes = await ctl("get", "nodes", server=False)  # server and -o json come from the context
    assert {i["name"] for i in json.loads(nodes.out)["items"]} >= {"decode-1", "decode-2"}
    view = yaml.safe_load((await ctl("config", "view", server=False)).out)
    assert view["current-context"] == "local"
    assert view["contexts"]["local"]["server"] == ctl.server
    assert (await ctl("config", "use-context", "missing", server=False)).rc == 3
    assert (await ctl("config", "use-context", "default", server=False)).rc == 0
    contexts = (await ctl("config", "get-contexts", server=False)).out
    assert any(line.startswith("*") and "default" in line for line in contexts.splitlines())
    # the other context's CURRENT is blank, as kubectl's (it said "<none>")
    assert [line.split()[0] for line in contexts.splitlines()[1:]] == ["*", "local"], contexts
    # --server still wins over the context
    assert (await ctl("--context", "local", "get", "nodes", server=False)).rc == 0


async def test_a_missing_config_file_or_context_is_said_with_what_exists(
    ctl: Ctl, tmp_path: Path
) -> None:
    """A mistyped --config silently fell back to the default context (127.0.0.1:50051);
    use-context did not say which contexts exist; a bad --server said pydantic's "Value
    error, "."""
    missing = tmp_path / "typo.yaml"
    res = await ctl("--config", str(missing), "get", "nodes")
    assert res.rc == 2, res
    assert res.err.startswith(f"error: --config: no such file {missing} ("), res.err
    assert (await ctl("config", "set-context", "a", "--server", ctl.server, server=False)).rc == 0
    unknown = await ctl("config", "use-context", "b", server=False)
    assert unknown.rc == 3 and unknown.err.rstrip().endswith("(known: a, default)"), unknown
    bad = await ctl("config", "set-context", "c", "--server", "nohost", server=False)
    assert (bad.rc, bad.err.strip()) == (2, "error: --server: must be host:port, got 'nohost'")


async def test_watch_refreshes_and_ctrl_c_exits_0(ctl: Ctl, fleet: Fleet) -> None:
    alone = await ctl("get", "leases", "--watch-count", "2")
    assert alone.rc == 2 and "add -w/--watch" in alone.err, alone
    res = await ctl("get", "leases", "--watch", "--interval", "0.1", "--watch-count", "2")
    assert res.rc == 0
    assert res.out.count("EPOCH/VERSION") == 2
    proc = await ctl.start("get", "nodes", "--watch", "--interval", "0.1")
    assert proc.stdout is not None
    async with asyncio.timeout(20):
        assert (await proc.stdout.readline()).startswith(b"NAME")
    proc.send_signal(signal.SIGINT)
    async with asyncio.timeout(20):
        _, err = await proc.communicate()
    assert proc.returncode == 0, err


async def test_completion_scripts(ctl: Ctl) -> None:
    for shell, marker in (("bash", "complete -o"), ("zsh", "compdef"), ("fish", "complete")):
        res = await ctl("completion", shell, server=False)
        assert res.rc == 0 and "_CROSSFLOWCTL_COMPLETE" in res.out and marker in res.out


async def test_node_names_complete_from_the_broker(ctl: Ctl, fleet: Fleet) -> None:
    words = f"crossflowctl --server {ctl.server} cordon decode-"
    env = {"_CROSSFLOWCTL_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": "4"}
    res = await ctl(server=False, env=env)
    assert res.out.split() == ["plain,decode-1", "plain,decode-2"]
    # the node-valued options too (they completed nothing)
    for tail in ("admit --node decode-", "admit --prefix-node decode-",
                 "get reservations --node decode-"):  # fmt: skip
        words = f"crossflowctl --server {ctl.server} {tail}"
        cword = str(len(words.split()) - 1)
        env = {"_CROSSFLOWCTL_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": cword}
        res = await ctl(server=False, env=env)
        assert res.out.split() == ["plain,decode-1", "plain,decode-2"], (tail, res)


async def test_context_names_complete_from_the_config_file(ctl: Ctl) -> None:
    """use-context, set-context and --context completed nothing."""
    assert (await ctl("config", "set-context", "prod", "--server", "b:1", server=False)).rc == 0
    for words in ("crossflowctl config use-context p", "crossflowctl config set-context p",
                  "crossflowctl --context p"):  # fmt: skip
        cword = str(len(words.split()) - 1)
        env = {"_CROSSFLOWCTL_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": cword}
        res = await ctl(server=False, env=env)
        assert res.out.split() == ["plain,prod"], (words, res)


async def test_tls_context_with_unreadable_ca_is_a_usage_error(ctl: Ctl, tmp_path: Path) -> None:
    missing = tmp_path / "missing-ca.pem"
    res = await ctl(
        "config",
        "set-context",
        "tls",
        "--server",
        ctl.server,
        "--ca-file",
        str(missing),
        "--use",
        server=False,
    )
    assert res.rc == 0
    view = yaml.safe_load((await ctl("config", "view", server=False)).out)
    assert view["contexts"]["tls"]["ca-file"] == str(missing)
    res = await ctl("get", "nodes", server=False)
    assert res.rc == 2
    assert res.err.splitlines() == [
        f"error: ca_file: cannot read {missing}: No such file or directory"
    ]


async def test_server_without_a_port_is_refused_not_sent_to_443(ctl: Ctl) -> None:
    ctl.server = "localhost"
    res = await ctl("get", "nodes")
    assert res.rc == 2, (res.out, res.err)
    (line,) = res.err.splitlines()
    assert "--server must be host:port" in line and "localhost:50051" in line
    # a bad port is replaced in the example, not kept with :50051 after it
    for bad, example in (("127.0.0.1:99999", "127.0.0.1:50051"), (":50051", "127.0.0.1:50051")):
        ctl.server = bad
        res = await ctl("get", "nodes")
        assert res.rc == 2 and res.err.rstrip().endswith(f"(e.g. {example})"), res.err


async def test_a_lone_client_certificate_names_the_flags(ctl: Ctl, tmp_path: Path) -> None:
    """It said "credentials: Value error, cert_file and key_file must be given together"."""
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    res = await ctl("--cert-file", str(cert), "get", "nodes")
    assert (res.rc, res.err.strip()) == (
        2, "error: credentials: --cert-file and --key-file must be given together"
    ), res  # fmt: skip


async def test_a_commit_ttl_below_a_just_lowered_horizon_says_to_retry_later(ctl: Ctl) -> None:
    """After lowering the horizon first, as told, the refusal still said "lower the horizon
    first, then the commit TTL": it now says the write must wait, and how long."""
    assert (await ctl("policy", "set", "borrow_horizon_ms=4000")).rc == 0
    refused = await ctl("policy", "set", "commit_ttl_ms=4000")
    assert refused.rc == 1, refused
    (line,) = refused.err.splitlines()
    assert line.startswith(
        "error: commit_ttl_ms: commit_ttl_ms (4000) must stay at least 8000 for "
    )
    assert "retry the commit TTL then" in line and "lower the horizon first, then" not in line
