"""Key layout and script hygiene: what keeps the Redis store Cluster-compatible by construction."""

from __future__ import annotations

from importlib import resources

import pytest
from redis.crc import key_slot

from crossflow_ctl.domain.errors import InvalidArgument
from crossflow_ctl.domain.models import NodeInfo, is_node_id
from crossflow_ctl.security.identity import parse_identity_uri
from crossflow_ctl.service.checks import check_node_id
from crossflow_ctl.store.base import check_owner
from crossflow_ctl.store.keys import (
    INDEX_BUCKETS,
    Keys,
    new_reservation_id,
    node_of_reservation,
)
from crossflow_ctl.store.redis_scripts import PER_NODE, STANDALONE


def slots(*keys: str) -> set[int]:
    return {key_slot(k.encode()) for k in keys}


@pytest.mark.parametrize("node_id", ["d1", "decode-7.rack_3", "x" * 128])
def test_a_nodes_keys_share_one_slot(node_id: str) -> None:
    k = Keys("cf").node(node_id)
    keys = [k.info, k.lease, k.reservations, k.notices, k.history, k.events, k.expiries]
    assert len(set(keys)) == len(keys)
    assert len(slots(*keys)) == 1
    assert all(key.startswith("cf:") for key in keys)  # prefix scans find a namespace


def test_nodes_spread_and_pool_keys_share_a_slot() -> None:
    keys = Keys("cf")
    node_slots = slots(*(keys.node(f"d{i}").info for i in range(64)))
    assert len(node_slots) > 32  # nodes spread over the cluster, not one hot slot
    pool_keys = (keys.pool("default"), keys.pool_expiries("default"), keys.pool_seq("default"))
    assert len(set(pool_keys)) == 3 and len(slots(*pool_keys)) == 1
    assert Keys("a").node("d1").info != Keys("b").node("d1").info


def test_global_indexes_are_buckets_spread_over_slots() -> None:
    keys = Keys("cf")
    buckets = {keys.bucket(f"decode-{i}") for i in range(1_000)}
    assert buckets == set(range(INDEX_BUCKETS))  # every bucket used: no hot one
    assert len(slots(*(keys.nodes(b) for b in buckets))) == INDEX_BUCKETS
    assert len(slots(*(keys.lenders(b) for b in buckets))) == INDEX_BUCKETS
    assert keys.bucket("decode-7") == Keys("other").bucket("decode-7")  # stable, not hash()


def test_reservation_ids_name_their_node() -> None:
    rid = new_reservation_id("d-1.x", 2**128 - 1)
    assert rid == "f" * 32 + "@d-1.x"
    assert node_of_reservation(rid) == "d-1.x"
    assert node_of_reservation(new_reservation_id("d1", 5)) == "d1"
    for bad in ("", "@d1", "g" * 32 + "@d1", "0" * 31 + "@d1", "0" * 32 + "@-d1", "0" * 32):
        with pytest.raises(InvalidArgument):
            node_of_reservation(bad)
    with pytest.raises(InvalidArgument):
        node_of_reservation("0" * 32 + "@" + "x" * 129)
    assert is_node_id("d1") and not is_node_id("d 1") and not is_node_id("{d1}")


@pytest.mark.parametrize("name", [*PER_NODE, *STANDALONE, "_lib"])
def test_every_script_states_its_keys_args_and_return(name: str) -> None:
    text = resources.files("crossflow_ctl.store").joinpath(f"lua/{name}.lua").read_text()
    header = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        header.append(line)
    joined = "\n".join(header)
    assert header and "KEYS" in joined and "ARGV" in joined and "Returns" in joined


@pytest.mark.parametrize("name", [*PER_NODE, *STANDALONE, "_lib"])
def test_scripts_touch_only_the_keys_they_are_given(name: str) -> None:
    """Cluster routes a script by its KEYS; a key name built inside Lua could cross slots."""
    text = resources.files("crossflow_ctl.store").joinpath(f"lua/{name}.lua").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    assert "KEYS[" in code or name == "_lib"
    for call in code.split("redis.call(")[1:]:
        args = call.split(")")[0]
        assert "'" in args.split(",")[0], f"command name must be a literal: {args}"
        if args.startswith("'PUBLISH'"):
            continue  # a channel, not a key: classic pub/sub is not slot-bound
        key = args.split(",")[1].strip() if "," in args else ""
        assert ".." not in key and ":" not in key, f"{name}: key built in Lua: {args}"


@pytest.mark.parametrize("trailing", ["\n", "\r\n", " "])
def test_ids_with_a_trailing_newline_are_refused_where_the_models_refuse_them(
    trailing: str,
) -> None:
    """Python's ``$`` matches before a final newline: each hand-written id check must refuse
    what the models' pattern refuses (pydantic matches the whole string)."""
    bad = "d1" + trailing
    with pytest.raises(ValueError):
        NodeInfo(node_id=bad)
    assert not is_node_id(bad)
    with pytest.raises(InvalidArgument):
        check_node_id(bad)
    with pytest.raises(InvalidArgument):
        node_of_reservation(new_reservation_id("d1", 5) + trailing)
    with pytest.raises(InvalidArgument):
        check_owner("router/r1" + trailing)
    assert parse_identity_uri("spiffe://crossflow/router/r1" + trailing, "crossflow") is None
    assert parse_identity_uri("spiffe://crossflow/router/r1", "crossflow") is not None
