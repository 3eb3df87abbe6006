"""The Helm chart: lint, render with realistic values, validate every manifest offline, refuse
bad values through values.schema.json, and keep the schema and values.yaml in step."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "crossflow"
VALUES_DIR = Path(__file__).resolve().parent / "values"
VALUE_FILES = sorted(p.name for p in VALUES_DIR.glob("*.yaml"))
SERVICE_MONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"
PROMETHEUS_RULE_API = "monitoring.coreos.com/v1/PrometheusRule"
# The chart's kubeVersion floor, and the version the bundled helm's client speaks.
K8S_VERSIONS = ("1.27.0", "1.35.0")


def helm_binary() -> str | None:
    local = ROOT / ".ci-tools" / "bin" / "helm"
    return str(local) if local.exists() else shutil.which("helm")


HELM = helm_binary()
needs_helm = pytest.mark.skipif(
    HELM is None, reason="helm not found on PATH or in .ci-tools/bin (scripts/install_tools.sh)"
)


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run(
        [HELM, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


@cache
def render(*args: str) -> tuple[dict[str, Any], ...]:
    result = helm("template", "cf", str(CHART), "--namespace", "serving", *args)
    assert result.returncode == 0, result.stderr
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def values_args(name: str | None) -> tuple[str, ...]:
    return ("-f", str(VALUES_DIR / name)) if name else ()


def find(docs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(matches) == 1, f"{len(matches)} {kind} {name or ''} in {[d['kind'] for d in docs]}"
    return matches[0]


def kinds(docs: tuple[dict[str, Any], ...]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container.get("env", [])}


def check_service_monitor(doc: dict[str, Any]) -> None:
    """No offline schema for the operator's CRD: check the fields Prometheus relies on."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    spec = doc["spec"]
    assert spec["selector"]["matchLabels"]
    for endpoint in spec["endpoints"]:
        assert endpoint["port"] == "metrics"
        assert endpoint["path"] == "/metrics"


def check_prometheus_rule(doc: dict[str, Any]) -> None:
    """No offline schema for the operator's CRD either (promtool checks the rules themselves:
    tests/deploy/test_alert_rules.py)."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    for group in doc["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            assert rule["alert"] and rule["expr"]


def check_certificate(doc: dict[str, Any]) -> None:
    """No offline schema for cert-manager's CRD: check the fields cert-manager requires."""
    assert doc["apiVersion"] == "cert-manager.io/v1"
    spec = doc["spec"]
    assert spec["secretName"] and spec["issuerRef"]["name"]
    assert spec.get("dnsNames") or spec.get("uris") or spec.get("commonName")


def check_issuer(doc: dict[str, Any]) -> None:
    """cert-manager's Issuer: exactly one kind of issuer (the chart's: selfSigned or ca)."""
    assert doc["apiVersion"] == "cert-manager.io/v1"
    kinds_ = set(doc["spec"]) & {"selfSigned", "ca", "acme", "vault", "venafi"}
    assert len(kinds_) == 1, doc["spec"]
    if "ca" in kinds_:
        assert doc["spec"]["ca"]["secretName"]


# -- lint and validate ----------------------------------------------------------------------


@needs_helm
@pytest.mark.parametrize("values", [None, *VALUE_FILES])
def test_helm_lint(values: str | None) -> None:
    result = helm("lint", "--strict", str(CHART), *values_args(values))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_helm
@pytest.mark.parametrize("values", [None, *VALUE_FILES])
def test_every_rendered_manifest_is_valid_kubernetes(values: str | None) -> None:
    docs = render(
        *values_args(values),
        "--api-versions", SERVICE_MONITOR_API,
        "--api-versions", PROMETHEUS_RULE_API,
    )  # fmt: skip
    assert docs
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            check_service_monitor(doc)
            continue
        if doc["kind"] == "PrometheusRule":
            check_prometheus_rule(doc)
            continue
        if doc["kind"] == "Certificate":
            check_certificate(doc)
            continue
        if doc["kind"] == "Issuer":
            check_issuer(doc)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} on {version}: {exc}")


# -- what the defaults render ----------------------------------------------------------------


@needs_helm
def test_defaults_render_the_whole_control_plane() -> None:
    docs = render()
    assert kinds(docs) == [
        "ConfigMap", "ConfigMap", "ConfigMap", "DaemonSet", "DaemonSet", "Deployment",
        "NetworkPolicy", "NetworkPolicy", "NetworkPolicy", "PodDisruptionBudget",
        *["Secret"] * 8, "Service", "Service", "Service", "ServiceAccount", "StatefulSet",
    ]  # fmt: skip
    # secure by default (tests/deploy/test_chart_security.py): the CA, the broker's and a client
    # certificate, bearer tokens (their hashes, the admin's, routers', agents'), Redis' password
    assert sorted(d["metadata"]["name"] for d in docs if d["kind"] == "Secret") == [
        "cf-crossflow-admin-token", "cf-crossflow-agent-tokens", "cf-crossflow-broker-tls",
        "cf-crossflow-ca", "cf-crossflow-client-tls", "cf-crossflow-redis-auth",
        "cf-crossflow-router-tokens", "cf-crossflow-tokens",
    ]  # fmt: skip
    deploy = find(docs, "Deployment", "cf-crossflow-broker")
    spec = deploy["spec"]["template"]["spec"]
    [broker] = spec["containers"]
    assert deploy["spec"]["replicas"] == 2
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert broker["securityContext"]["readOnlyRootFilesystem"] is True
    assert broker["securityContext"]["runAsUser"] != 0
    assert broker["securityContext"]["capabilities"]["drop"] == ["ALL"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert broker[probe]["tcpSocket"]["port"] == 50051  # TLS: kubelet gRPC probes are plaintext
    assert "preferredDuringSchedulingIgnoredDuringExecution" in spec["affinity"]["podAntiAffinity"]
    assert env_of(broker)["CROSSFLOW_REDIS_URL"]["value"] == (
        "redis://:$(REDIS_PASSWORD)@cf-crossflow-redis:6379/0"
    )
    assert find(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    service = find(docs, "Service", "cf-crossflow-broker")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": 50051,
        "metrics": 9464,
    }
    # No ServiceMonitor unless the cluster serves the CRD.
    assert "ServiceMonitor" not in kinds(docs)


@needs_helm
def test_config_checksum_follows_the_configmap() -> None:
    def checksum_and_config(*args: str) -> tuple[str, str]:
        docs = render(*args)
        cm = find(docs, "ConfigMap", "cf-crossflow-broker")
        deploy = find(docs, "Deployment")
        annotation = deploy["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        return annotation, cm["data"]["broker.yaml"]

    a, config_a = checksum_and_config()
    b, config_b = checksum_and_config("--set", "broker.config.policy.shadow_mode=true")
    assert a != b
    assert yaml.safe_load(config_b)["policy"] == {"shadow_mode": True}
    assert "policy" not in yaml.safe_load(config_a)
    for digest in (a, b):
        assert len(digest) == 64 and int(digest, 16) >= 0
    assert hashlib.sha256(b"").hexdigest() not in (a, b)


@needs_helm
def test_agents_one_daemonset_per_role_on_labelled_gpu_nodes() -> None:
    docs = render()
    for role in ("decode", "prefill"):
        ds = find(docs, "DaemonSet", f"cf-crossflow-agent-{role}")
        spec = ds["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {
            "crossflow.io/role": role,
            "nvidia.com/gpu.present": "true",
        }
        assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert "hostNetwork" not in spec
        [agent] = spec["containers"]
        env = env_of(agent)
        assert env["CROSSFLOW_AGENT_ROLE"]["value"] == role
        assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
        # SGLang's default port (the chart paired engine sglang with vLLM's 8000)
        assert env["CROSSFLOW_AGENT_METRICS_URL"]["value"] == "http://$(NODE_IP):30000/metrics"
        assert agent["readinessProbe"]["httpGet"]["path"] == "/healthz"
        assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    config = yaml.safe_load(find(docs, "ConfigMap", "cf-crossflow-agent")["data"]["agent.yaml"])
    assert config["brokers"] == ["cf-crossflow-broker.serving.svc:50051"]
    assert config["source"] == "sglang"


@needs_helm
def test_the_engine_metrics_url_defaults_by_engine() -> None:
    def url(*args: str) -> str:
        ds = find(render(*args), "DaemonSet", "cf-crossflow-agent-decode")
        [agent] = ds["spec"]["template"]["spec"]["containers"]
        return str(env_of(agent)["CROSSFLOW_AGENT_METRICS_URL"]["value"])

    assert url("--set", "agent.engine=vllm") == "http://$(NODE_IP):8000/metrics"
    assert url("--set", "agent.engine=sglang") == "http://$(NODE_IP):30000/metrics"
    given = "http://$(NODE_IP):31000/metrics"
    assert url("--set", "agent.engine=vllm", "--set", f"agent.engineMetricsUrl={given}") == given


@needs_helm
def test_external_redis_takes_the_password_from_a_secret() -> None:
    docs = render(*values_args("external-redis.yaml"))
    assert "StatefulSet" not in kinds(docs)
    secrets = [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"]
    assert "cf-crossflow-redis-auth" not in secrets  # existingSecret: the chart creates none
    deploy = find(docs, "Deployment")
    [broker] = deploy["spec"]["template"]["spec"]["containers"]
    env = env_of(broker)
    ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "crossflow-redis", "key": "redis-password"}
    assert env["CROSSFLOW_REDIS_URL"]["value"] == (
        "rediss://:$(REDIS_PASSWORD)@redis-master.data.svc:6380/0"
    )
    names = list(env)
    assert names.index("REDIS_PASSWORD") < names.index("CROSSFLOW_REDIS_URL")  # expansion order
    config = yaml.safe_load(find(docs, "ConfigMap", "cf-crossflow-broker")["data"]["broker.yaml"])
    assert config["otlp_endpoint"] == "http://otel-collector.monitoring:4317"
    assert config["log_level"] == "debug"
    assert config["policy"]["borrow_share"] == 0.3
    affinity = deploy["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" in affinity
    policy = find(docs, "NetworkPolicy", "cf-crossflow-broker")
    assert policy["spec"]["ingress"][0]["from"][2]["namespaceSelector"]  # after agents, gateways


@needs_helm
def test_bundled_redis_with_password_and_volume() -> None:
    docs = render(*values_args("bundled-redis.yaml"))
    secret = find(docs, "Secret", "cf-crossflow-redis-auth")
    assert secret["data"]["password"] == "dHJpYWwtcGFzc3dvcmQ="  # base64 of trial-password
    sts = find(docs, "StatefulSet")
    [redis] = sts["spec"]["template"]["spec"]["containers"]
    assert "--requirepass" in redis["args"][0]
    assert "--appendonly yes" in redis["args"][0]
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "fast-ssd"
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "DaemonSet"] == [
        "cf-crossflow-agent-decode"
    ]
    assert "PodDisruptionBudget" not in kinds(docs)
    redis_policy = find(docs, "NetworkPolicy", "cf-crossflow-redis")
    peer = redis_policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert peer["app.kubernetes.io/component"] == "broker"


@needs_helm
def test_host_network_agents_and_service_monitors() -> None:
    docs = render(*values_args("hostnetwork-agents.yaml"), "--api-versions", SERVICE_MONITOR_API)
    ds = find(docs, "DaemonSet", "cf-crossflow-agent-decode")
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["nodeSelector"] == {"crossflow.io/role": "decode", "node-pool": "gpu-h200"}
    # NetworkPolicies do not apply to host-network pods: no agent policy is rendered.
    assert "cf-crossflow-agent" not in [
        d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy"
    ]
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert sorted(m["metadata"]["name"] for m in monitors) == [
        "cf-crossflow-agent-metrics",
        "cf-crossflow-broker",
    ]
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
        assert monitor["spec"]["endpoints"][0]["interval"] == "15s"
        # Each monitor selects a Service that exists and exposes a port named metrics.
        selector = monitor["spec"]["selector"]["matchLabels"]
        services = [
            d
            for d in docs
            if d["kind"] == "Service" and selector.items() <= d["metadata"]["labels"].items()
        ]
        assert len(services) == 1
        assert "metrics" in [p["name"] for p in services[0]["spec"]["ports"]]


@needs_helm
def test_minimal_values_render_the_broker_only() -> None:
    docs = render(*values_args("minimal.yaml"))
    assert kinds(docs) == [
        "ConfigMap", "ConfigMap", "Deployment", "PodDisruptionBudget", *["Secret"] * 7,
        "Service", "Service",
        "StatefulSet",
    ]  # fmt: skip
    assert "cf-crossflow-agent-tokens" not in [d["metadata"]["name"] for d in docs]
    spec = find(docs, "Deployment")["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "llm-serving"
    assert "affinity" not in spec


# -- values and the schema -----------------------------------------------------------------


INVALID_VALUES = [
    ("broker.replicas=0", "replicas"),
    ("broker.config.policy.borrow_share=2", "borrow_share"),
    ("broker.config.no_such_setting=1", "no_such_setting"),
    ("broker.config.listen=0.0.0.0:1", "listen"),
    ("no_such_value=1", "no_such_value"),
    ("redis.mode=cluster", "mode"),
    ("redis.mode=external", "url"),
    ("redis.external.url=redis://:secret@host:6379/0", "url"),
    ("agent.roles={gpu}", "roles"),
    ("agent.engineMetricsUrl=ftp://node/metrics", "engineMetricsUrl"),
    ("observability.logLevel=verbose", "logLevel"),
    ("observability.serviceMonitor.interval=often", "interval"),
    ("broker.grpcPort=70000", "grpcPort"),
    ("securityContext.runAsUser=0", "runAsUser"),
    ("broker.antiAffinity=always", "antiAffinity"),
]


@needs_helm
@pytest.mark.parametrize(("setting", "named"), INVALID_VALUES)
def test_invalid_values_are_refused_by_the_schema(setting: str, named: str) -> None:
    result = helm("template", "cf", str(CHART), "--set", setting)
    assert result.returncode != 0, f"{setting} was accepted"
    assert "schema" in result.stderr or "required" in result.stderr, result.stderr
    assert named in result.stderr, result.stderr


def test_schema_is_generated_from_the_current_models() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/gen_helm_schema.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_values_yaml_is_the_models_defaults() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_helm_schema
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    assert gen_helm_schema.ChartValues().model_dump(mode="json") == values
    for name in VALUE_FILES:
        gen_helm_schema.ChartValues.model_validate(
            yaml.safe_load((VALUES_DIR / name).read_text(encoding="utf-8"))
        )


def test_values_yaml_documents_every_value() -> None:
    lines = (CHART / "values.yaml").read_text(encoding="utf-8").splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "- ")) or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        above = lines[i - 1].strip() if i else ""
        parent_is_list_item = i and lines[i - 1].lstrip().startswith("- ")
        if parent_is_list_item or (indent and lines[i - 1].strip().startswith("- ")):
            continue
        if not above.startswith("#"):
            undocumented.append(stripped.split(":")[0])
    # Entries inside default lists/maps (tolerations, resource quantities) are examples, not
    # values of their own; every key at a values level needs its comment.
    allowed = {"key", "operator", "effect", "cpu", "memory", "nvidia.com/gpu.present"}
    assert [k for k in undocumented if k not in allowed] == []


@needs_helm
def test_mtls_mounts_secrets_and_issues_certificates() -> None:
    docs = render(*values_args("mtls.yaml"))
    certs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    assert sorted(certs) == [
        "cf-crossflow-agent-gpu-1", "cf-crossflow-agent-gpu-2", "cf-crossflow-broker-tls",
        "cf-crossflow-client-tls",  # for callers without a certificate (it names no one)
    ]  # fmt: skip
    assert certs["cf-crossflow-broker-tls"]["dnsNames"][0] == "cf-crossflow-broker.serving.svc"
    assert certs["cf-crossflow-agent-gpu-1"]["uris"] == ["spiffe://serving.example/node/gpu-1"]
    assert certs["cf-crossflow-agent-gpu-2"]["issuerRef"]["kind"] == "ClusterIssuer"

    config = yaml.safe_load(find(docs, "ConfigMap", "cf-crossflow-broker")["data"]["broker.yaml"])
    assert config["auth"] == {
        "required": True,
        "tls": {
            "cert_file": "/var/run/crossflow/tls/tls.crt",
            "key_file": "/var/run/crossflow/tls/tls.key",
            "client_ca_file": "/var/run/crossflow/tls/ca.crt",
        },
        "token_file": "/var/run/crossflow/tokens/tokens",
        "trust_domain": "serving.example",
        "routers_read_nodes": False,
    }
    assert config["redis_ca_file"] == "/var/run/crossflow/redis-ca/ca.crt"
    spec = find(docs, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "cf-crossflow-broker-tls"
    assert volumes["tokens"]["secret"]["secretName"] == "crossflow-token-hashes"
    assert volumes["redis-ca"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    [broker] = spec["containers"]
    mounts = {m["name"]: m["mountPath"] for m in broker["volumeMounts"]}
    assert mounts["tls"] == "/var/run/crossflow/tls"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert broker[probe]["tcpSocket"]["port"] == 50051  # kubelet gRPC probes are plaintext

    ds = find(docs, "DaemonSet", "cf-crossflow-agent-decode")["spec"]["template"]["spec"]
    [agent] = ds["containers"]
    env = env_of(agent)
    assert env["CROSSFLOW_AGENT_BROKER_AUTH__CA_FILE"]["value"].endswith("/broker-ca/ca.crt")
    assert env["CROSSFLOW_AGENT_BROKER_AUTH__SERVER_NAME"]["value"] == (
        "cf-crossflow-broker.serving.svc"
    )
    assert env["CROSSFLOW_AGENT_BROKER_AUTH__CERT_FILE"]["value"] == (
        "/var/run/crossflow/agent-tls/$(NODE_NAME).crt"
    )
    names = list(env)
    assert names.index("NODE_NAME") < names.index("CROSSFLOW_AGENT_BROKER_AUTH__CERT_FILE")
    agent_volumes = {v["name"]: v for v in ds["volumes"]}
    # Agents get the CA only, never the broker's private key.
    assert agent_volumes["broker-ca"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    sources = agent_volumes["agent-tls"]["projected"]["sources"]
    assert [s["secret"]["name"] for s in sources] == [
        "cf-crossflow-agent-gpu-1", "cf-crossflow-agent-gpu-2",
    ]  # fmt: skip
    assert sources[0]["secret"]["items"][0] == {"key": "tls.crt", "path": "gpu-1.crt"}


NO_TOKENS = "security.generated.tokens=false"


@needs_helm
@pytest.mark.parametrize(
    ("settings", "named"),
    [
        # The broker refuses to start so (auth.required with nobody able to authenticate): the
        # chart rendered it, and the pods crash-looped.
        (
            ("security.required=true", "security.tls.mutual=false", "no-tokens"),
            "security.tokenHashesSecret",
        ),
        (
            (
                "security.required=true",
                "security.tls.secretName=s",
                "security.tls.mutual=false",
                "no-tokens",
            ),
            "security.tls.mutual",
        ),
        # Mutual TLS without TLS was dropped without a word: an open broker.
        (("security.tls.enabled=false",), "security.tls.enabled"),
        # A broker that authenticates callers, and agents given no identity: every agent
        # stream was refused (UNAUTHENTICATED) and no node ever leased.
        (("security.tokenHashesSecret=h",), "security.agentCredentials.tokenSecret"),
        (("broker.config.auth.token_file=/t",), "security.agentCredentials.tokenSecret"),
        (
            ("security.tls.enabled=true", "security.tls.secretName=s", "security.tls.mutual=true"),
            "security.certManager.agentNodes",
        ),
        # Mutual TLS with the chart's client certificate, which names no one, and no tokens.
        (("security.generated.tokens=false",), "security.agentCredentials.tokenSecret"),
    ],
)
def test_security_values_that_cannot_work_are_refused(
    settings: tuple[str, ...], named: str
) -> None:
    settings = tuple(NO_TOKENS if s == "no-tokens" else s for s in settings)
    result = helm("template", "cf", str(CHART), *(a for s in settings for a in ("--set", s)))
    assert result.returncode != 0, f"{settings} rendered"
    assert named in result.stderr, result.stderr


@needs_helm
def test_token_auth_with_an_open_lease_service_needs_no_agent_token() -> None:
    """With crossflow.v1.LeaseService in auth.open_services the agents need no identity: the
    refusal of token auth without agent tokens blocked that valid install."""
    open_services = "{grpc.health.v1.Health,crossflow.v1.LeaseService}"
    result = helm(
        "template", "cf", str(CHART),
        "--set", "security.tokenHashesSecret=h",
        "--set", f"broker.config.auth.open_services={open_services}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


@needs_helm
@pytest.mark.parametrize(
    ("settings", "rendered"),
    [
        (("broker.replicas=1",), False),
        (("broker.podDisruptionBudget.minAvailable=2",), False),
        (("broker.podDisruptionBudget.minAvailable=51%",), False),  # rounds up to 2 of 2
        (("broker.replicas=1", "broker.podDisruptionBudget.minAvailable=50%"), False),
        (("broker.podDisruptionBudget.minAvailable=50%",), True),
        (("broker.replicas=1", "broker.podDisruptionBudget.minAvailable=0"), True),
        (("broker.replicas=1", "broker.podDisruptionBudget.enabled=false"), True),
    ],
)
def test_a_disruption_budget_that_blocks_every_drain_is_refused(
    settings: tuple[str, ...], rendered: bool
) -> None:
    """replicas=1 with the default minAvailable 1 rendered a PodDisruptionBudget that lets no
    broker pod be evicted: `kubectl drain` of its node then waits for ever."""
    result = helm("template", "cf", str(CHART), *(a for s in settings for a in ("--set", s)))
    assert (result.returncode == 0) is rendered, result.stderr
    if not rendered:
        assert "broker.podDisruptionBudget.enabled=false" in result.stderr, result.stderr


@needs_helm
def test_required_auth_renders_with_tokens_or_client_certificates() -> None:
    for extra in (
        ("security.tokenHashesSecret=tokens", "security.agentCredentials.tokenSecret=t"),
        ("broker.config.auth.token_file=/etc/tokens", "agent.enabled=false"),
        ("security.tls.enabled=true", "security.tls.secretName=s", "security.tls.mutual=true",
         "security.agentCredentials.tlsSecret=a"),
    ):  # fmt: skip
        args = ("security.required=true", *extra)
        config = yaml.safe_load(
            find(render(*(a for s in args for a in ("--set", s))), "ConfigMap",
                 "cf-crossflow-broker")["data"]["broker.yaml"]
        )  # fmt: skip
        assert config["auth"]["required"] is True, extra


@needs_helm
def test_without_security_values_the_broker_is_secure() -> None:
    """The defaults rendered a broker with auth off on 0.0.0.0 (issue 29)."""
    spec = find(render(), "Deployment")["spec"]["template"]["spec"]
    assert [v["name"] for v in spec["volumes"]] == ["config", "tls", "tokens", "tmp"]
    ds = find(render(), "DaemonSet", "cf-crossflow-agent-decode")["spec"]["template"]["spec"]
    assert sorted(e for e in env_of(ds["containers"][0]) if "BROKER_AUTH" in e) == [
        "CROSSFLOW_AGENT_BROKER_AUTH__CA_FILE", "CROSSFLOW_AGENT_BROKER_AUTH__CERT_FILE",
        "CROSSFLOW_AGENT_BROKER_AUTH__KEY_FILE", "CROSSFLOW_AGENT_BROKER_AUTH__SERVER_NAME",
        "CROSSFLOW_AGENT_BROKER_AUTH__TOKEN_FILE",
    ]  # fmt: skip
    config = yaml.safe_load(
        find(render(), "ConfigMap", "cf-crossflow-broker")["data"]["broker.yaml"]
    )
    assert config["auth"] == {
        "required": False,
        "tls": {
            "cert_file": "/var/run/crossflow/tls/tls.crt",
            "key_file": "/var/run/crossflow/tls/tls.key",
            "client_ca_file": "/var/run/crossflow/tls/ca.crt",
        },
        "token_file": "/var/run/crossflow/tokens/tokens",
    }


@needs_helm
def test_broker_configmap_loads_with_the_broker_settings(tmp_path: Path) -> None:
    from crossflow_ctl.service.config import load_settings

    for values in (None, *VALUE_FILES):
        docs = render(*values_args(values))
        cms = [d for d in docs if d["kind"] == "ConfigMap" and "broker.yaml" in d["data"]]
        config = tmp_path / "broker.yaml"
        config.write_text(cms[0]["data"]["broker.yaml"], encoding="utf-8")
        # What the Deployment's environment adds: the URL (TLS when a Redis CA is mounted).
        scheme = "rediss" if "redis_ca_file" in cms[0]["data"]["broker.yaml"] else "redis"
        settings = load_settings(config, {"redis_url": f"{scheme}://127.0.0.1:6379/0"})
        assert settings.listen == "0.0.0.0:50051"


@needs_helm
def test_agent_configmap_loads_with_the_agent_settings(tmp_path: Path) -> None:
    from crossflow_agent.settings import load_settings

    for values in (None, *VALUE_FILES):
        docs = render(*values_args(values))
        cms = [d for d in docs if d["kind"] == "ConfigMap" and "agent.yaml" in d["data"]]
        if not cms:
            continue
        config = tmp_path / "agent.yaml"
        config.write_text(cms[0]["data"]["agent.yaml"], encoding="utf-8")
        # What the DaemonSet's environment adds per node.
        settings = load_settings(config, {"node_id": "gpu-node-1", "role": "decode"})
        assert settings.metrics_listen == "0.0.0.0:9465"
        assert settings.brokers == ["cf-crossflow-broker.serving.svc:50051"]


@needs_helm
def test_broker_command_is_what_the_broker_cli_accepts() -> None:
    from crossflow_ctl.broker.__main__ import cli

    [broker] = find(render(), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert broker["command"][:2] == ["crossflow-broker", "serve"]
    ctx = cli.commands["serve"].make_context("serve", list(broker["command"][2:]))
    assert str(ctx.params["config_file"]) == "/etc/crossflow/broker.yaml"


@needs_helm
def test_agent_command_is_what_the_agent_cli_accepts() -> None:
    from crossflow_agent.cli import cli

    ds = find(render(), "DaemonSet", "cf-crossflow-agent-decode")
    [agent] = ds["spec"]["template"]["spec"]["containers"]
    assert agent["command"][:2] == ["crossflow-agent", "run"]
    run = cli.commands["run"]
    ctx = run.make_context("run", list(agent["command"][2:]))
    assert str(ctx.params["config_file"]) == "/etc/crossflow/agent.yaml"


def notes(*settings: str) -> str:
    args = [a for s in settings for a in ("--set", s)]
    result = helm("install", "cf", str(CHART), "--namespace", "serving", "--dry-run=client", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:", 1)[1]


@needs_helm
def test_notes_check_command_works_with_the_security_values() -> None:
    """The notes told every install to run `crossflowctl --server 127.0.0.1:50051 get nodes`,
    which a TLS broker refuses (no CA, and its certificate names the Service, not 127.0.0.1)."""
    plain = notes("security.insecure=true", "security.tls.enabled=false",
                  "security.tls.mutual=false", "security.generated.tokens=false")  # fmt: skip
    assert "crossflowctl --server 127.0.0.1:50051 get nodes" in plain
    assert "--ca-file" not in plain and "WARNING: INSECURE" in plain
    default = notes()
    assert (
        "crossflowctl --server 127.0.0.1:50051 --ca-file ca.crt --server-name "
        "cf-crossflow-broker.serving.svc --cert-file client.crt --key-file client.key "
        "--token-file admin.token get nodes"
    ) in default
    assert "get secret cf-crossflow-admin-token -o jsonpath='{.data.token}'" in default
    assert "INSECURE" not in default
    mtls = notes(
        "security.tls.enabled=true", "security.tls.secretName=s", "security.tls.mutual=true",
        "security.agentCredentials.tlsSecret=a",
    )  # fmt: skip
    assert (
        "crossflowctl --server 127.0.0.1:50051 --ca-file ca.crt --server-name "
        "cf-crossflow-broker.serving.svc --cert-file admin.crt --key-file admin.key get nodes"
    ) in mtls
    assert "get secret s -o jsonpath" in mtls and "spiffe://crossflow/admin/<name>" in mtls
    tokens = notes(
        "security.tokenHashesSecret=t", "broker.config.auth.trust_domain=acme",
        "security.agentCredentials.tokenSecret=a", "security.tls.enabled=false",
        "security.tls.mutual=false", "security.insecure=true",
    )  # fmt: skip
    assert "crossflowctl --server 127.0.0.1:50051 --token-file admin.token get nodes" in tokens
    assert "spiffe://acme/admin/<name>" in tokens


@needs_helm
def test_notes_say_which_labels_the_agents_need() -> None:
    """The notes said agents run on nodes labelled crossflow.io/role=...; the DaemonSets also
    select agent.nodeSelector (nvidia.com/gpu.present=true by default), so a node labelled as
    told got no agent on a cluster without the GPU operator's labels."""
    assert (
        "crossflow.io/role=<decode|prefill> that also carry nvidia.com/gpu.present=true "
        "(agent.nodeSelector):"
    ) in notes()
    assert "that also carry" not in notes("agent.nodeSelector=null")


@needs_helm
@pytest.mark.parametrize("key", ["agent.nodeSelector", "agent.config", "broker.config"])
def test_a_map_value_set_to_null_renders(key: str) -> None:
    """`--set agent.nodeSelector=null` (how Helm drops a default map, here the GPU label) failed
    with Go's "error calling deepCopy: reflect: call of reflect.Value.Type on zero Value";
    broker.config and agent.config alike (and in the notes and Certificates, on dig)."""
    docs = render("--set", f"{key}=null", *values_args("mtls.yaml"))
    assert find(docs, "Deployment")
    if key == "agent.nodeSelector":
        ds = find(docs, "DaemonSet", "cf-crossflow-agent-decode")["spec"]["template"]["spec"]
        assert ds["nodeSelector"] == {"crossflow.io/role": "decode"}
    assert "spiffe://" in notes(f"{key}=null", "security.tokenHashesSecret=h",
                                "security.agentCredentials.tokenSecret=t")  # fmt: skip


@needs_helm
def test_broker_workers_reach_the_broker_settings(tmp_path: Path) -> None:
    from crossflow_ctl.service.config import load_settings

    def workers(*args: str) -> int | None:
        docs = render(*args)
        config = tmp_path / "broker.yaml"
        config.write_text(
            find(docs, "ConfigMap", "cf-crossflow-broker")["data"]["broker.yaml"], encoding="utf-8"
        )
        return load_settings(config, {"redis_url": "redis://127.0.0.1:6379/0"}).workers

    assert workers() == 1  # the chart's default: one process per pod
    assert workers("--set", "broker.workers=3") == 3
    assert workers("--set", "broker.workers=0") is None  # the pod's CPUs (its CPU limit)
