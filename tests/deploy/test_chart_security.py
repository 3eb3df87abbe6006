"""The chart is secure by default (issue 29): mutual TLS with certificates from cert-manager when
the cluster serves it, else made by Helm; bearer tokens the chart makes for an admin, routers and
each agent node; a NetworkPolicy that admits only labelled agents and gateways; a generated
password for bundled Redis. The credentials it makes are checked against a real broker over real
gRPC. (Keeping them across upgrades uses ``lookup``, which ``helm template`` cannot exercise.)"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from crossflow_ctl.api.v1 import lease_pb2
from crossflow_ctl.broker.auth import check_startup
from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.client import AdminClient, AdmissionClient
from crossflow_ctl.domain.clock import SystemClock
from crossflow_ctl.domain.errors import Unauthenticated, Unavailable
from crossflow_ctl.security import ClientCredentials
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.memory import MemoryStore
from tests.broker.agents import FakeAgent
from tests.deploy.test_helm_chart import CHART, env_of, find, helm, kinds, needs_helm, render

CERT_MANAGER_API = "cert-manager.io/v1"
SERVER_NAME = "cf-crossflow-broker.serving.svc"


def sets(*settings: str) -> tuple[str, ...]:
    return tuple(a for s in settings for a in ("--set", s))


def secret_data(docs: tuple[dict[str, Any], ...], name: str) -> dict[str, bytes]:
    data = find(docs, "Secret", name).get("data") or {}
    return {k: base64.b64decode(v) for k, v in data.items()}


def broker_config(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    cm = find(docs, "ConfigMap", "cf-crossflow-broker")
    return dict(yaml.safe_load(cm["data"]["broker.yaml"]))


@needs_helm
async def test_the_credentials_the_chart_makes_work_with_a_real_broker(tmp_path: Path) -> None:
    docs = render(*sets("security.generated.agentNodes={gpu-1}", "security.generated.routers={gw}"))
    files: dict[str, Path] = {}
    for secret in ("cf-crossflow-broker-tls", "cf-crossflow-client-tls"):
        for key, value in secret_data(docs, secret).items():
            files[f"{secret}/{key}"] = path = tmp_path / f"{secret}-{key}"
            path.write_bytes(value)
    tokens = secret_data(docs, "cf-crossflow-tokens")["tokens"]
    (tmp_path / "tokens").write_bytes(tokens)
    for secret, key in (
        ("cf-crossflow-admin-token", "token"),
        ("cf-crossflow-router-tokens", "gw"),
        ("cf-crossflow-agent-tokens", "gpu-1"),
    ):
        files[key] = tmp_path / f"token-{key}"
        files[key].write_bytes(secret_data(docs, secret)[key])

    # The rendered broker.yaml, its mounted paths pointed at the files, beyond loopback: the
    # broker starts (it authenticates callers) and has nothing to warn about.
    config = broker_config(docs)
    config["auth"]["tls"] = {
        "cert_file": files["cf-crossflow-broker-tls/tls.crt"],
        "key_file": files["cf-crossflow-broker-tls/tls.key"],
        "client_ca_file": files["cf-crossflow-broker-tls/ca.crt"],
    }
    config["auth"]["token_file"] = tmp_path / "tokens"
    config.update(listen="0.0.0.0:0", redis_url=None, metrics_listen=None, stream_grace_s=0.5)
    server = BrokerServer(BrokerSettings(**config), MemoryStore(), SystemClock())
    await server.start()
    assert server.broker.warnings == ()
    address = f"127.0.0.1:{server.port}"

    def creds(token: str | None, cert: bool = True) -> ClientCredentials:
        return ClientCredentials(
            ca_file=files["cf-crossflow-client-tls/ca.crt"],
            cert_file=files["cf-crossflow-client-tls/tls.crt"] if cert else None,
            key_file=files["cf-crossflow-client-tls/tls.key"] if cert else None,
            server_name=SERVER_NAME,
            token_file=files[token] if token else None,
        )

    agent = FakeAgent(address, "gpu-1", credentials=creds("gpu-1"))
    try:
        await agent.connect()  # the client certificate for mTLS, the node's token for who
        ack = await agent.send_lease()
        assert ack.result == lease_pb2.LEASE_RESULT_ACCEPTED
        impostor = FakeAgent(address, "gpu-2", credentials=creds("gpu-1"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await impostor.connect()
        await impostor.close()
        assert refused.value.code() in (
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.INTERNAL,  # grpc/grpc#36066, see tests/security/test_broker_auth
        )
        async with AdminClient(address, timeout_s=5, credentials=creds("token")) as admin:
            assert [n.state.info.node_id for n in await admin.list_nodes()] == ["gpu-1"]
            assert admin.broker_warnings == ()
            await admin.set_policy({"shadow_mode": "true"})
        async with AdmissionClient(address, timeout_s=5, credentials=creds("gw")) as router:
            await router.admit(uncached_prompt_tokens=1_000)
        async with AdminClient(address, timeout_s=5, credentials=creds(None)) as nobody:
            with pytest.raises(Unauthenticated):  # a certificate that names no one
                await nobody.list_nodes()
        no_cert = creds("token", cert=False)
        async with AdminClient(address, timeout_s=5, credentials=no_cert) as admin:
            with pytest.raises(Unavailable):  # mutual TLS: no certificate, no handshake
                await admin.list_nodes()
    finally:
        await agent.close()
        await server.stop(grace_s=0.5)


@needs_helm
def test_generated_tokens_hash_to_their_identities() -> None:
    docs = render(
        *sets(
            "security.generated.agentNodes={gpu-2,gpu-1}",
            "security.generated.routers={gw}",
            "broker.config.auth.trust_domain=acme",
        )
    )
    lines = secret_data(docs, "cf-crossflow-tokens")["tokens"].decode().splitlines()
    table = dict(line.split() for line in lines if not line.startswith("#"))

    def hashed(token: bytes) -> str:
        return "sha256:" + hashlib.sha256(token).hexdigest()

    admin = secret_data(docs, "cf-crossflow-admin-token")["token"]
    agents = secret_data(docs, "cf-crossflow-agent-tokens")
    assert len(admin) == 48 and admin.isalnum()
    assert table == {
        hashed(admin): "spiffe://acme/admin/chart-admin",
        hashed(secret_data(docs, "cf-crossflow-router-tokens")["gw"]): "spiffe://acme/router/gw",
        hashed(agents["gpu-1"]): "spiffe://acme/node/gpu-1",
        hashed(agents["gpu-2"]): "spiffe://acme/node/gpu-2",
    }

    # The broker reads its token file at start: a new identity rolls its replicas.
    def identities(*settings: str) -> str:
        deploy = find(render(*sets(*settings)), "Deployment")
        return str(deploy["spec"]["template"]["metadata"]["annotations"]["checksum/identities"])

    one = identities("security.generated.agentNodes={gpu-1}")
    assert one == identities("security.generated.agentNodes={gpu-1}")
    assert one != identities("security.generated.agentNodes={gpu-1,gpu-2}")


@needs_helm
def test_cert_manager_is_used_when_the_cluster_serves_it() -> None:
    docs = render("--api-versions", CERT_MANAGER_API)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {
        ("Issuer", "cf-crossflow-selfsigned"), ("Certificate", "cf-crossflow-ca"),
        ("Issuer", "cf-crossflow-ca"), ("Certificate", "cf-crossflow-broker-tls"),
        ("Certificate", "cf-crossflow-client-tls"),
    } <= names  # fmt: skip
    assert ("Secret", "cf-crossflow-ca") not in names  # cert-manager makes the Secrets
    assert ("Secret", "cf-crossflow-broker-tls") not in names
    ca = find(docs, "Certificate", "cf-crossflow-ca")["spec"]
    assert ca["isCA"] is True and ca["issuerRef"]["name"] == "cf-crossflow-selfsigned"
    assert find(docs, "Issuer", "cf-crossflow-ca")["spec"]["ca"]["secretName"] == "cf-crossflow-ca"
    for name in ("cf-crossflow-broker-tls", "cf-crossflow-client-tls"):
        ref = find(docs, "Certificate", name)["spec"]["issuerRef"]
        assert ref == {"name": "cf-crossflow-ca", "kind": "Issuer", "group": "cert-manager.io"}
    client = find(docs, "Certificate", "cf-crossflow-client-tls")["spec"]
    assert "uris" not in client and client["usages"] == ["client auth"]  # it names no one

    # An issuer of the operator's own: no CA of the chart's.
    own = render(
        "--api-versions",
        CERT_MANAGER_API,
        *sets(
            "security.certManager.issuerRef.name=corp",
            "security.certManager.issuerRef.kind=ClusterIssuer",
        ),
    )
    assert "Issuer" not in kinds(own)
    assert (
        find(own, "Certificate", "cf-crossflow-broker-tls")["spec"]["issuerRef"]["name"] == "corp"
    )
    # Told not to, or a cluster without it: Helm makes them.
    for docs in (
        render("--api-versions", CERT_MANAGER_API, *sets("security.certManager.enabled=false")),
        render(),
    ):
        assert "Certificate" not in kinds(docs)
        ca_crt = secret_data(docs, "cf-crossflow-ca")["tls.crt"]
        assert secret_data(docs, "cf-crossflow-broker-tls")["ca.crt"] == ca_crt
        assert secret_data(docs, "cf-crossflow-client-tls")["ca.crt"] == ca_crt


@needs_helm
def test_network_policy_admits_labelled_agents_and_gateways() -> None:
    policy = find(render(), "NetworkPolicy", "cf-crossflow-broker")
    grpc_rule, _metrics = policy["spec"]["ingress"]
    assert grpc_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert grpc_rule["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "cf",
                                         "crossflow.io/agent": "true"}}},
        {"podSelector": {"matchLabels": {"crossflow.io/gateway": "true"}}},
    ]  # fmt: skip
    # the agents carry the label the policy selects
    ds = find(render(), "DaemonSet", "cf-crossflow-agent-decode")
    assert ds["spec"]["template"]["metadata"]["labels"]["crossflow.io/agent"] == "true"
    extra = find(
        render("--set-json", 'networkPolicy.grpcFrom=[{"ipBlock":{"cidr":"10.0.0.0/16"}}]'),
        "NetworkPolicy",
        "cf-crossflow-broker",
    )
    assert extra["spec"]["ingress"][0]["from"][2] == {"ipBlock": {"cidr": "10.0.0.0/16"}}


@needs_helm
def test_bundled_redis_gets_a_generated_password() -> None:
    docs = render()
    password = secret_data(docs, "cf-crossflow-redis-auth")["password"]
    assert len(password) == 32 and password.isalnum()
    [redis] = find(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    assert '--requirepass "$REDIS_PASSWORD"' in redis["args"][0]
    assert env_of(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == (
        "cf-crossflow-redis-auth"
    )
    [broker] = find(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = env_of(broker)
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "cf-crossflow-redis-auth"
    # External Redis without a Secret: none made (its password is the operator's)
    external = render(*sets("redis.mode=external", "redis.external.url=redis://r:6379/0"))
    assert "cf-crossflow-redis-auth" not in [d["metadata"]["name"] for d in external]


@needs_helm
@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (("security.tls.mutual=false", "security.generated.tokens=false"), "security.insecure"),
        (("security.tls.enabled=false", "security.tls.mutual=false"), "plaintext"),
    ],
    ids=["no-identity", "tokens-over-plaintext"],
)
def test_what_the_broker_would_refuse_needs_insecure(settings: tuple[str, ...], named: str) -> None:
    result = helm("template", "cf", str(CHART), *sets(*settings))
    assert result.returncode != 0, f"{settings} rendered"
    assert named in result.stderr, result.stderr
    config = broker_config(render(*sets(*settings, "security.insecure=true")))
    assert config["auth"]["insecure"] is True
    # and the broker, given that config, starts with a warning rather than refusing
    auth = BrokerSettings(**{**config, "redis_url": None}).auth
    [warning] = check_startup(auth, config["listen"])
    assert warning.startswith("INSECURE: ")


@needs_helm
def test_the_secure_defaults_start_without_a_warning() -> None:
    config = broker_config(render())
    settings = BrokerSettings(**{**config, "redis_url": None})
    assert settings.listen == "0.0.0.0:50051"
    assert check_startup(settings.auth, settings.listen) == ()


@needs_helm
def test_agent_credentials_under_the_defaults() -> None:
    ds = find(render(), "DaemonSet", "cf-crossflow-agent-decode")["spec"]["template"]["spec"]
    env = env_of(ds["containers"][0])
    assert env["CROSSFLOW_AGENT_BROKER_AUTH__CERT_FILE"]["value"] == (
        "/var/run/crossflow/client-tls/tls.crt"
    )
    assert env["CROSSFLOW_AGENT_BROKER_AUTH__TOKEN_FILE"]["value"] == (
        "/var/run/crossflow/agent-token/$(NODE_NAME)"
    )
    volumes = {v["name"]: v for v in ds["volumes"]}
    assert volumes["agent-token"]["secret"]["secretName"] == "cf-crossflow-agent-tokens"
    assert volumes["client-tls"]["secret"]["secretName"] == "cf-crossflow-client-tls"
    # agents never mount the CA's key, the broker's key, or the admin's token
    mounted = {v.get("secret", {}).get("secretName") for v in ds["volumes"]}
    assert not mounted & {"cf-crossflow-ca", "cf-crossflow-admin-token", "cf-crossflow-tokens"}
    assert volumes["broker-ca"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
