"""The chart deploys crossflow-gateway (issue 27): off by default; on, with engines listed
(tests/deploy/values/gateway-static.yaml) or discovered by their pods' labels
(gateway-discovery.yaml). Its gateway.yaml loads with the gateway's own settings model, the chart
refuses what those settings (or the broker) would refuse, and the router token it makes for the
gateway is accepted by a real broker over real gRPC. (Lint and offline validation of every
manifest run over these values files in test_helm_chart.py.)"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from crossflow_ctl.broker.server import BrokerServer
from crossflow_ctl.client import AdmissionClient
from crossflow_ctl.domain.clock import SystemClock
from crossflow_ctl.domain.errors import Unauthenticated
from crossflow_ctl.gateway.settings import GatewaySettings, load_settings
from crossflow_ctl.service.config import BrokerSettings
from crossflow_ctl.store.memory import MemoryStore
from tests.deploy.test_chart_security import broker_config, secret_data, sets
from tests.deploy.test_helm_chart import (
    CHART,
    SERVICE_MONITOR_API,
    env_of,
    find,
    helm,
    kinds,
    needs_helm,
    notes,
    render,
    values_args,
)

STATIC = "gateway-static.yaml"
DISCOVERY = "gateway-discovery.yaml"
GATEWAY = "cf-crossflow-gateway"
ENGINES = (
    "gateway.config.prefill[0].node_id=p1",
    "gateway.config.prefill[0].url=http://10.0.0.1:8000",
    "gateway.config.decode[0].node_id=gpu-1",
    "gateway.config.decode[0].url=http://10.0.1.1:8000",
)
# A gateway with the chart's other values at their defaults (secure: mutual TLS and tokens).
DEFAULT_GATEWAY = sets("gateway.enabled=true", *ENGINES)


def gateway_objects(docs: tuple[dict[str, Any], ...]) -> list[tuple[str, str]]:
    return sorted(
        (d["kind"], d["metadata"]["name"]) for d in docs if "gateway" in d["metadata"]["name"]
    )


def pod_spec(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return dict(find(docs, "Deployment", GATEWAY)["spec"]["template"]["spec"])


def gateway_yaml(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return dict(yaml.safe_load(find(docs, "ConfigMap", GATEWAY)["data"]["gateway.yaml"]))


def mounted(docs: tuple[dict[str, Any], ...], tmp_path: Path) -> dict[str, Path]:
    """The files the gateway's pod would see, written under tmp_path: its mount path -> file."""
    spec = pod_spec(docs)
    [container] = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    files: dict[str, Path] = {}
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        data = secret_data(docs, secret["secretName"])
        for item in secret.get("items") or [{"key": k, "path": k} for k in data]:
            path = tmp_path / f"{mount['name']}-{item['path']}"
            path.write_bytes(data[item["key"]])
            files[f"{mount['mountPath']}/{item['path']}"] = path
    return files


def load_gateway_settings(
    docs: tuple[dict[str, Any], ...], tmp_path: Path, **overrides: Any
) -> GatewaySettings:
    """The rendered gateway.yaml, loaded as `crossflow-gateway serve --config` loads it, with the
    credential paths it names pointed at the Secrets' contents (each must be mounted)."""
    config = gateway_yaml(docs)
    files = mounted(docs, tmp_path)
    auth = config["broker_auth"]
    for key in ("ca_file", "cert_file", "key_file", "token_file"):
        if key in auth:
            assert auth[key] in files, f"broker_auth.{key} {auth[key]} is not mounted"
            auth[key] = str(files[auth[key]])
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return load_settings(path, overrides)


# -- what it renders ---------------------------------------------------------------------------


@needs_helm
def test_the_gateway_is_off_by_default() -> None:
    docs = render()
    assert gateway_objects(docs) == []
    assert "Role" not in kinds(docs) and "RoleBinding" not in kinds(docs)
    assert "data" not in find(docs, "Secret", "cf-crossflow-router-tokens")  # no router listed
    assert "gateway" not in notes().split("Security:")[0]


@needs_helm
def test_static_engines_render_a_gateway_behind_its_service() -> None:
    docs = render(*values_args(STATIC), "--api-versions", SERVICE_MONITOR_API)
    assert gateway_objects(docs) == [
        ("ConfigMap", GATEWAY), ("Deployment", GATEWAY), ("NetworkPolicy", GATEWAY),
        ("Service", GATEWAY), ("Service", f"{GATEWAY}-metrics"),
        ("ServiceMonitor", f"{GATEWAY}-metrics"),
    ]  # fmt: skip
    deploy = find(docs, "Deployment", GATEWAY)
    assert deploy["spec"]["replicas"] == 3
    template = deploy["spec"]["template"]
    labels = template["metadata"]["labels"]
    # the label the broker's NetworkPolicy admits on its gRPC port
    assert labels["crossflow.io/gateway"] == "true"
    assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8000"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert annotations["example.com/team"] == "serving"
    assert len(annotations["checksum/config"]) == 64
    spec = template["spec"]
    assert spec["serviceAccountName"] == "cf-crossflow"
    assert spec["automountServiceAccountToken"] is False  # no discovery: no API token
    assert spec["nodeSelector"] == {"node-pool": "cpu"}
    assert spec["tolerations"][0]["key"] == "dedicated"
    [gateway] = spec["containers"]
    assert gateway["command"] == [
        "crossflow-gateway", "serve", "--config", "/etc/crossflow/gateway.yaml",
    ]  # fmt: skip
    assert gateway["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # /health is 503 while an engine role is down: liveness must not restart it for that
    assert gateway["livenessProbe"]["tcpSocket"] == {"port": "http"}
    assert env_of(gateway)["PYTHONFAULTHANDLER"]["value"] == "1"
    assert gateway["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}
    assert volumes == {
        # the CA only, never the broker's key; its own router token, never the other routers'
        "broker-ca": {"secretName": "cf-crossflow-broker-tls",
                      "items": [{"key": "ca.crt", "path": "ca.crt"}]},
        "client-tls": {"secretName": "cf-crossflow-client-tls",
                       "items": [{"key": "tls.crt", "path": "tls.crt"},
                                 {"key": "tls.key", "path": "tls.key"}]},
        "router-token": {"secretName": "cf-crossflow-router-tokens",
                         "items": [{"key": "gw-a", "path": "gw-a"}]},
    }  # fmt: skip

    service = find(docs, "Service", GATEWAY)
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}
    ]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["metadata"]["annotations"] == {
        "service.beta.kubernetes.io/aws-load-balancer-internal": "true"
    }
    policy = find(docs, "NetworkPolicy", GATEWAY)["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["policyTypes"] == ["Ingress"]  # it reaches the broker and engines anywhere
    assert policy["ingress"] == [
        {"ports": [{"port": "http", "protocol": "TCP"}],
         "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}]}
    ]  # fmt: skip


@needs_helm
def test_the_service_monitor_scrapes_every_gateway_pod() -> None:
    docs = render(*values_args(STATIC), "--api-versions", SERVICE_MONITOR_API)
    monitor = find(docs, "ServiceMonitor", f"{GATEWAY}-metrics")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    selector = monitor["spec"]["selector"]["matchLabels"]
    [service] = [
        d
        for d in docs
        if d["kind"] == "Service" and selector.items() <= d["metadata"]["labels"].items()
    ]
    assert service["metadata"]["name"] == f"{GATEWAY}-metrics"
    assert service["spec"]["clusterIP"] == "None"
    [port] = service["spec"]["ports"]
    assert (port["name"], port["targetPort"]) == ("metrics", "http")
    pod_labels = find(docs, "Deployment", GATEWAY)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    # without the CRD, or with the gateway off, none
    assert "ServiceMonitor" not in kinds(render(*values_args(STATIC)))
    assert f"{GATEWAY}-metrics" not in [
        d["metadata"]["name"] for d in render("--api-versions", SERVICE_MONITOR_API)
    ]


@needs_helm
def test_discovery_gives_the_gateway_its_own_account_and_a_pod_reader_role() -> None:
    docs = render(*values_args(DISCOVERY))
    assert ("Role", GATEWAY) in gateway_objects(docs)
    account = find(docs, "ServiceAccount", GATEWAY)
    assert account["automountServiceAccountToken"] is True
    # the chart's own account still mounts no token
    assert find(docs, "ServiceAccount", "cf-crossflow")["automountServiceAccountToken"] is False
    spec = pod_spec(docs)
    assert spec["serviceAccountName"] == GATEWAY
    assert spec["automountServiceAccountToken"] is True
    role = find(docs, "Role", GATEWAY)
    assert role["metadata"]["namespace"] == "inference"  # where the engines run
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]
    binding = find(docs, "RoleBinding", GATEWAY)
    assert binding["metadata"]["namespace"] == "inference"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": GATEWAY,
    }  # fmt: skip
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": GATEWAY, "namespace": "serving"}
    ]
    assert gateway_yaml(docs)["kubernetes"] == {
        "namespace": "inference",
        "prefill_selector": "app=sglang,crossflow.io/role=prefill",
        "decode_selector": "app=sglang,crossflow.io/role=decode",
        "port": 30000,
        "bootstrap_port": 8998,
        "period_s": 2,
    }
    # the namespace defaults to the release's
    same = render(*values_args(DISCOVERY), "--set", "gateway.discovery.namespace=")
    assert find(same, "Role", GATEWAY)["metadata"]["namespace"] == "serving"
    assert gateway_yaml(same)["kubernetes"]["namespace"] == "serving"


# -- its settings ------------------------------------------------------------------------------


@needs_helm
@pytest.mark.parametrize(
    "args",
    [values_args(STATIC), values_args(DISCOVERY), DEFAULT_GATEWAY],
    ids=["static", "discovery", "defaults"],
)
def test_gateway_yaml_loads_with_the_gateway_settings(
    args: tuple[str, ...], tmp_path: Path
) -> None:
    docs = render(*args)
    settings = load_gateway_settings(docs, tmp_path)
    assert settings.listen == "0.0.0.0:8000"
    assert settings.broker == "cf-crossflow-broker.serving.svc:50051"
    auth = settings.broker_auth
    assert auth.server_name == "cf-crossflow-broker.serving.svc"
    assert auth.ca_file and auth.cert_file and auth.key_file and auth.token_file
    assert auth.token_file.read_text() == (
        secret_data(docs, "cf-crossflow-router-tokens")["gw-a" if args == values_args(STATIC)
                                                        else "gateway"].decode()
    )  # fmt: skip
    if args == values_args(STATIC):
        assert settings.model == "gpt-oss-120b" and settings.max_hold_ms == 200
        assert [e.node_id for e in settings.decode] == ["gpu-decode-0", "gpu-decode-1"]
        assert settings.otlp_endpoint == "http://otel-collector.monitoring:4317"
        assert settings.kubernetes is None
    if args == values_args(DISCOVERY):
        assert settings.kubernetes is not None
        assert settings.kubernetes.namespace == "inference"
        assert settings.kubernetes.bootstrap_port == 8998
        assert settings.protocol == "sglang" and settings.model == "qwen3-32b"
    assert settings.log_json is True and settings.log_level == "info"


@needs_helm
def test_gateway_command_is_what_the_gateway_cli_accepts() -> None:
    from crossflow_ctl.gateway.__main__ import cli

    [gateway] = pod_spec(render(*DEFAULT_GATEWAY))["containers"]
    assert gateway["command"][:2] == ["crossflow-gateway", "serve"]
    ctx = cli.commands["serve"].make_context("serve", list(gateway["command"][2:]))
    assert str(ctx.params["config_file"]) == "/etc/crossflow/gateway.yaml"


@needs_helm
def test_without_security_the_gateway_mounts_no_credentials(tmp_path: Path) -> None:
    plain = ("security.insecure=true", "security.tls.enabled=false",
             "security.tls.mutual=false", "security.generated.tokens=false")  # fmt: skip
    docs = render(*DEFAULT_GATEWAY, *sets(*plain))
    assert gateway_yaml(docs)["broker_auth"] == {}
    assert [v["name"] for v in pod_spec(docs)["volumes"]] == ["config", "tmp"]
    assert load_gateway_settings(docs, tmp_path).broker_auth.tls is False


@needs_helm
def test_credentials_of_its_own_replace_the_charts() -> None:
    docs = render(*DEFAULT_GATEWAY, *sets(
        "gateway.credentials.tlsSecret=gw-cert", "gateway.credentials.tokenSecret=gw-token",
    ))  # fmt: skip
    volumes = {v["name"]: v["secret"] for v in pod_spec(docs)["volumes"] if "secret" in v}
    assert volumes["client-tls"]["secretName"] == "gw-cert"
    assert volumes["router-token"] == {
        "secretName": "gw-token", "items": [{"key": "gateway", "path": "gateway"}],
    }  # fmt: skip
    # its token is the operator's: the chart makes none for it
    assert "data" not in find(docs, "Secret", "cf-crossflow-router-tokens")


# -- what the chart refuses --------------------------------------------------------------------


@needs_helm
@pytest.mark.parametrize(
    ("settings", "named"),
    [
        # GatewaySettings refuses a gateway without engines at start (a crash loop)
        (("gateway.enabled=true",), "gateway.config.prefill and gateway.config.decode"),
        (("gateway.enabled=true", *ENGINES[:2]), "gateway.discovery.enabled=true"),
        # ...and discovery without a model
        (
            ("gateway.enabled=true", "gateway.discovery.enabled=true",
             "gateway.discovery.prefillSelector=r=p", "gateway.discovery.decodeSelector=r=d"),
            "needs gateway.config.model",
        ),
        (
            ("gateway.enabled=true", "gateway.discovery.enabled=true", "gateway.config.model=m"),
            "gateway.discovery.prefillSelector and gateway.discovery.decodeSelector",
        ),
        # the lists would be ignored without a word
        (
            ("gateway.enabled=true", *ENGINES, "gateway.discovery.enabled=true",
             "gateway.config.model=m", "gateway.discovery.prefillSelector=r=p",
             "gateway.discovery.decodeSelector=r=d"),
            "not both",
        ),
        # SGLang's prefill engines need their bootstrap port
        (
            ("gateway.enabled=true", "gateway.discovery.enabled=true", "gateway.config.model=m",
             "gateway.config.protocol=sglang", "gateway.discovery.prefillSelector=r=p",
             "gateway.discovery.decodeSelector=r=d"),
            "gateway.discovery.bootstrapPort",
        ),
        # a broker that would not know the gateway: every Admit refused, every prompt sent the
        # normal way without a word
        (
            ("gateway.enabled=true", *ENGINES, "security.tokenHashesSecret=h",
             "security.agentCredentials.tokenSecret=a"),
            "gateway.credentials.tokenSecret",
        ),
        (
            ("gateway.enabled=true", *ENGINES, "security.tls.secretName=s",
             "security.agentCredentials.tlsSecret=a"),
            "gateway.credentials.tlsSecret",
        ),
    ],
    ids=["no-engines", "no-decode", "discovery-no-model", "discovery-no-selectors",
         "lists-and-discovery", "sglang-no-bootstrap", "no-token", "no-client-cert"],
)  # fmt: skip
def test_a_gateway_that_cannot_work_is_refused(settings: tuple[str, ...], named: str) -> None:
    result = helm("template", "cf", str(CHART), *sets(*settings))
    assert result.returncode != 0, f"{settings} rendered"
    assert named in result.stderr, result.stderr


@needs_helm
@pytest.mark.parametrize(
    "settings",
    [
        ("security.tokenHashesSecret=h", "security.agentCredentials.tokenSecret=a",
         "gateway.credentials.tokenSecret=t"),
        ("security.tls.secretName=s", "security.agentCredentials.tlsSecret=a",
         "gateway.credentials.tlsSecret=g"),
        # a gateway that never asks the broker needs no identity there
        ("security.tokenHashesSecret=h", "security.agentCredentials.tokenSecret=a",
         "gateway.config.borrow=false"),
    ],
    ids=["own-token", "own-certificate", "no-borrowing"],
)  # fmt: skip
def test_a_gateway_with_an_identity_renders(settings: tuple[str, ...]) -> None:
    result = helm("template", "cf", str(CHART), *DEFAULT_GATEWAY, *sets(*settings))
    assert result.returncode == 0, result.stderr


@needs_helm
@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("gateway.config.no_such_setting=1", "no_such_setting"),
        ("gateway.config.listen=0.0.0.0:1", "listen"),  # the chart sets it
        ("gateway.config.kubernetes.namespace=x", "kubernetes"),  # gateway.discovery does
        ("gateway.config.max_hold_ms=-1", "max_hold_ms"),
        ("gateway.port=70000", "port"),
        ("gateway.routerName=a/b", "routerName"),
        ("gateway.discovery.namespace=Not_A_Namespace", "namespace"),
        ("gateway.service.type=Ingress", "type"),
    ],
)
def test_invalid_gateway_values_are_refused_by_the_schema(setting: str, named: str) -> None:
    result = helm("template", "cf", str(CHART), *DEFAULT_GATEWAY, "--set", setting)
    assert result.returncode != 0, f"{setting} was accepted"
    assert "schema" in result.stderr, result.stderr
    assert named in result.stderr, result.stderr


# -- its identity at the broker ----------------------------------------------------------------


@needs_helm
def test_the_gateway_gets_a_router_token_whose_hash_the_broker_has() -> None:
    docs = render(*values_args(STATIC), "--set", "broker.config.auth.trust_domain=acme")
    routers = secret_data(docs, "cf-crossflow-router-tokens")
    assert sorted(routers) == ["gw-a", "router-b"]
    lines = secret_data(docs, "cf-crossflow-tokens")["tokens"].decode().splitlines()
    table = dict(line.split() for line in lines if not line.startswith("#"))
    token = routers["gw-a"]
    assert len(token) == 48 and token.isalnum()
    assert table["sha256:" + hashlib.sha256(token).hexdigest()] == "spiffe://acme/router/gw-a"
    # listed among the routers already: one token
    twice = render(*values_args(STATIC), "--set", "security.generated.routers={gw-a}")
    assert sorted(secret_data(twice, "cf-crossflow-router-tokens")) == ["gw-a"]

    # The broker reads its token file at start: enabling the gateway rolls its replicas.
    def identities(*args: str) -> str:
        deploy = find(render(*args), "Deployment", "cf-crossflow-broker")
        return str(deploy["spec"]["template"]["metadata"]["annotations"]["checksum/identities"])

    assert identities() != identities(*DEFAULT_GATEWAY)
    assert "routers gateway (Secret cf-crossflow-router-tokens)" in notes(
        "gateway.enabled=true", *ENGINES
    )


@needs_helm
async def test_a_real_broker_admits_the_gateway_with_the_charts_credentials(
    tmp_path: Path,
) -> None:
    """The chart's broker.yaml and the gateway's own gateway.yaml (their mounted paths pointed
    at the Secrets' contents): an Admit over real gRPC, mutual TLS and the gateway's router
    token, as the gateway makes it (its settings' broker_auth)."""
    docs = render(*DEFAULT_GATEWAY)
    broker_files = tmp_path / "broker"
    broker_files.mkdir()
    tls = secret_data(docs, "cf-crossflow-broker-tls")
    for key, value in tls.items():
        (broker_files / key).write_bytes(value)
    (broker_files / "tokens").write_bytes(secret_data(docs, "cf-crossflow-tokens")["tokens"])
    config = broker_config(docs)
    config["auth"]["tls"] = {
        "cert_file": broker_files / "tls.crt",
        "key_file": broker_files / "tls.key",
        "client_ca_file": broker_files / "ca.crt",
    }
    config["auth"]["token_file"] = broker_files / "tokens"
    config.update(listen="0.0.0.0:0", redis_url=None, metrics_listen=None, stream_grace_s=0.5)
    server = BrokerServer(BrokerSettings(**config), MemoryStore(), SystemClock())
    await server.start()
    try:
        settings = load_gateway_settings(docs, tmp_path)
        address = f"127.0.0.1:{server.port}"  # the Service's name is checked (server_name)
        async with AdmissionClient(
            address, timeout_s=5, credentials=settings.broker_auth
        ) as gateway:
            await gateway.admit(uncached_prompt_tokens=1_000)  # not Unauthenticated
        # the router token names it: the chart's client certificate alone names no one
        anonymous = settings.broker_auth.model_copy(update={"token_file": None})
        async with AdmissionClient(address, timeout_s=5, credentials=anonymous) as nobody:
            with pytest.raises(Unauthenticated):
                await nobody.admit(uncached_prompt_tokens=1_000)
    finally:
        await server.stop(grace_s=0.5)
