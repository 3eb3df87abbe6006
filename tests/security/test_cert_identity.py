"""A client certificate names its caller by exactly one SPIFFE URI SAN, never by its common name.

Real certificates signed by the test CA, over real gRPC with mutual TLS (issue 29: a certificate
with no SAN and ``CN=spiffe://crossflow/admin/cn`` was accepted as admin, and one with several
SPIFFE URIs got the role of the first).
"""

from __future__ import annotations

import pytest

from crossflow_ctl.client import AdminClient, AdmissionClient
from crossflow_ctl.domain.errors import PermissionDenied, Unauthenticated
from crossflow_ctl.security import ClientCredentials
from crossflow_ctl.security.identity import (
    CertificateRefused,
    Identity,
    Role,
    certificate_identity,
)
from tests.security.conftest import POLICY, Brokers, target
from tests.security.pki import Pair

pytestmark = pytest.mark.timeout(60)


def _creds(brokers: Brokers, pair: Pair) -> ClientCredentials:
    return ClientCredentials(
        ca_file=brokers.ca.cert, cert_file=pair.cert, key_file=pair.key, server_name="localhost"
    )


async def _refused_set_policy(brokers: Brokers, pair: Pair) -> str:
    """The UNAUTHENTICATED message a SetPolicy with ``pair`` gets; the policy is unchanged."""
    server = brokers.servers[0]
    async with AdminClient(target(server), timeout_s=5, credentials=_creds(brokers, pair)) as c:
        with pytest.raises(Unauthenticated) as refused:
            await c.set_policy({"borrow_share": "0.5"})
    assert (await server.broker.get_policy()).policy == POLICY
    return str(refused.value)


async def test_the_common_name_is_never_an_identity(brokers: Brokers) -> None:
    await brokers.start(brokers.mtls())
    no_san = brokers.ca.issue("cn-admin", common_name="spiffe://crossflow/admin/cn")
    why = await _refused_set_policy(brokers, no_san)
    assert "no SPIFFE URI SAN" in why and "common name is not read" in why
    # a SAN without a URI (a DNS name) does not make the CN count either
    dns_only = brokers.ca.issue(
        "cn-admin-dns", dns=("admin.example",), common_name="spiffe://crossflow/admin/cn"
    )
    assert "no SPIFFE URI SAN" in await _refused_set_policy(brokers, dns_only)


@pytest.mark.parametrize(
    "uris",
    [
        ("spiffe://crossflow/admin/a", "spiffe://crossflow/router/b"),
        ("spiffe://crossflow/router/b", "spiffe://crossflow/admin/a"),
        ("spiffe://crossflow/admin/a", "spiffe://crossflow/admin/a"),
        ("spiffe://crossflow/router/b", "SPIFFE://crossflow/admin/a"),
    ],
    ids=["admin-first", "router-first", "same-twice", "scheme-case"],
)
async def test_several_spiffe_uris_are_refused(brokers: Brokers, uris: tuple[str, ...]) -> None:
    await brokers.start(brokers.mtls())
    pair = brokers.ca.issue("several", uris=uris)
    why = await _refused_set_policy(brokers, pair)
    assert "2 SPIFFE URI SANs" in why and "exactly one" in why
    async with AdmissionClient(
        target(brokers.servers[0]), timeout_s=5, credentials=_creds(brokers, pair)
    ) as router:
        with pytest.raises(Unauthenticated):
            await router.admit(uncached_prompt_tokens=1_000)


@pytest.mark.parametrize(
    "uri",
    ["spiffe://elsewhere/admin/a", "spiffe://crossflow/root/a", "spiffe://crossflow/admin/"],
)
async def test_a_spiffe_uri_naming_no_identity_here_is_refused(brokers: Brokers, uri: str) -> None:
    await brokers.start(brokers.mtls())
    why = await _refused_set_policy(brokers, brokers.ca.issue("foreign", uris=(uri,)))
    assert uri in why and "spiffe://crossflow/<node|router|admin>/<name>" in why


async def test_one_spiffe_uri_among_other_sans_names_the_caller(brokers: Brokers) -> None:
    server = await brokers.start(brokers.mtls())
    pair = brokers.ca.issue(
        "router-mixed",
        uris=("https://router.example/a", "spiffe://crossflow/router/a"),
        dns=("router.example",),
        common_name="spiffe://crossflow/admin/cn",
    )
    async with AdminClient(target(server), timeout_s=5, credentials=_creds(brokers, pair)) as c:
        with pytest.raises(PermissionDenied) as denied:  # a router, not the CN's admin
            await c.set_policy({"borrow_share": "0.5"})
        assert "router/a" in str(denied.value)
        assert await c.list_nodes() == []  # routers may read
    assert (await server.broker.get_policy()).policy == POLICY


@pytest.mark.parametrize(
    ("uris", "expected"),
    [
        ((), None),
        (("https://x.example/a", "urn:x"), None),
        (("spiffe://crossflow/node/d1",), Identity(role=Role.NODE, name="d1")),
        (("https://x", "spiffe://crossflow/admin/ops"), Identity(role=Role.ADMIN, name="ops")),
    ],
)
def test_certificate_identity(uris: tuple[str, ...], expected: Identity | None) -> None:
    assert certificate_identity(uris, "crossflow") == expected


@pytest.mark.parametrize(
    "uris",
    [
        ("spiffe://crossflow/node/d1", "spiffe://crossflow/node/d2"),
        ("Spiffe://crossflow/node/d1", "spiffe://crossflow/node/d1"),
        ("spiffe://other/node/d1",),
        ("spiffe://crossflow/node/d1/extra",),
    ],
)
def test_certificate_identity_refusals(uris: tuple[str, ...]) -> None:
    with pytest.raises(CertificateRefused):
        certificate_identity(uris, "crossflow")
