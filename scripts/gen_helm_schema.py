"""Generate deploy/helm/crossflow/values.schema.json from pydantic models.

The chart's own values are modelled here (:class:`ChartValues`, whose defaults are exactly
``values.yaml``); ``broker.config`` and ``agent.config`` take the JSON schema of the settings
models the processes themselves load (``BrokerSettings``, ``AgentSettings``), and
``gateway.config`` that of ``GatewaySettings``, minus the keys the chart sets. So a typo or an
out-of-range setting fails at ``helm install``/``helm template``, not at pod start.

    python scripts/gen_helm_schema.py           # write the schema
    python scripts/gen_helm_schema.py --check   # exit 1 when the committed file is stale
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "crossflow"
SCHEMA_FILE = CHART / "values.schema.json"

# Keys of the settings files that the chart computes itself (ports, Redis, observability).
BROKER_MANAGED: tuple[str, ...] = ("listen", "redis_url", "metrics_listen", "otlp_endpoint")
BROKER_MANAGED += ("log_level", "log_json", "redis_namespace", "broker_id", "redis_ca_file")
BROKER_MANAGED += ("workers",)
AGENT_MANAGED: tuple[str, ...] = ("brokers", "node_id", "role", "source", "metrics_url")
AGENT_MANAGED += ("metrics_listen", "otlp_endpoint", "log_level", "log_json")
# kubernetes: rendered from gateway.discovery, which also makes the Role the gateway lists pods by.
GATEWAY_MANAGED: tuple[str, ...] = ("listen", "broker", "broker_auth", "otlp_endpoint")
GATEWAY_MANAGED += ("log_level", "log_json", "kubernetes")
SETTINGS_MODELS = {
    "broker": ("crossflow_ctl.service.config", "BrokerSettings", BROKER_MANAGED),
    "agent": ("crossflow_agent.settings", "AgentSettings", AGENT_MANAGED),
    "gateway": ("crossflow_ctl.gateway.settings", "GatewaySettings", GATEWAY_MANAGED),
}

Port = Annotated[int, Field(ge=1, le=65535)]
Quantity = Annotated[str | int, Field()]
LabelKey = Annotated[
    str, Field(min_length=1, max_length=253, pattern=r"^([a-z0-9.-]+/)?[A-Za-z0-9_.-]{1,63}$")
]
Duration = Annotated[str, Field(pattern=r"^[0-9]+(ms|s|m|h)$")]
NodeName = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
]


class Values(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class Resources(Values):
    requests: dict[str, Quantity] = {}
    """Resource requests (cpu, memory)."""
    limits: dict[str, Quantity] = {}
    """Resource limits."""


class EnvVar(Values):
    name: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$")]
    value: str | None = None
    valueFrom: dict[str, Any] | None = None


class Image(Values):
    repository: Annotated[str, Field(min_length=1)] = "ghcr.io/crossflow/crossflow"
    """Image repository."""
    tag: str = ""
    """Image tag; empty uses the chart's appVersion."""
    pullPolicy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Kubernetes image pull policy."""


class ServiceAccount(Values):
    create: bool = True
    """Create the ServiceAccount."""
    name: str = ""
    """Its name; empty derives one from the release."""
    annotations: dict[str, str] = {}
    """Annotations on the ServiceAccount."""
    automountToken: bool = False
    """Mount an API token into the pods."""


class SecurityContext(Values):
    runAsUser: Annotated[int, Field(ge=1)] = 10001
    """Numeric user id (non-zero: the containers run as non-root)."""
    runAsGroup: Annotated[int, Field(ge=1)] = 10001
    """Numeric group id, also the pods' fsGroup."""


class ServiceMonitor(Values):
    enabled: bool = True
    """Create ServiceMonitors when the cluster serves the monitoring.coreos.com/v1 CRD."""
    interval: Duration = "30s"
    """Scrape interval."""
    scrapeTimeout: Duration = "10s"
    """Scrape timeout."""
    labels: dict[str, str] = {}
    """Extra labels on the ServiceMonitors."""


class PrometheusRule(Values):
    enabled: bool = True
    """Create the PrometheusRule (when the CRD is served, or force)."""
    force: bool = False
    """Render it even when the cluster does not serve the CRD."""
    labels: dict[str, str] = {}
    """Extra labels on the PrometheusRule."""
    runbookUrl: Annotated[str, Field(pattern=r"^https?://")] = (
        "https://github.com/crossflow/crossflow/blob/main/docs/runbooks.md"
    )
    """Where each alert's runbook_url points."""


class GrafanaDashboard(Values):
    enabled: bool = True
    """Create the dashboard ConfigMap."""
    labels: dict[str, str] = {"grafana_dashboard": "1"}
    """Labels Grafana's dashboard sidecar selects by."""
    annotations: dict[str, str] = {}
    """Annotations on the ConfigMap (e.g. grafana_folder)."""
    namespace: str = ""
    """Namespace of the ConfigMap; empty: the release's."""


class Observability(Values):
    otlpEndpoint: Annotated[str, Field(pattern=r"^$|^https?://")] = ""
    """OTLP/gRPC endpoint for traces; empty exports none."""
    logLevel: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the broker and the agents."""
    logJson: bool = True
    """JSON log lines."""
    podAnnotations: bool = True
    """prometheus.io/scrape annotations on the pods."""
    serviceMonitor: ServiceMonitor = ServiceMonitor()
    prometheusRule: PrometheusRule = PrometheusRule()
    grafanaDashboard: GrafanaDashboard = GrafanaDashboard()


class PodDisruptionBudget(Values):
    enabled: bool = True
    """Create it."""
    minAvailable: Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=r"^[0-9]+%$")] = 1
    """Replicas (or a percentage) that must stay up."""


class Service(Values):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Service type."""
    annotations: dict[str, str] = {}
    """Service annotations."""


class Broker(Values):
    replicas: Annotated[int, Field(ge=1, le=100)] = 2
    """Number of stateless replicas."""
    grpcPort: Port = 50051
    """gRPC port."""
    metricsPort: Port = 9464
    """Prometheus /metrics port."""
    workers: Annotated[int, Field(ge=0, le=256)] = 1
    """Worker processes per pod sharing the gRPC port; 0: the pod's CPUs."""
    config: dict[str, Any] = {}
    """BrokerSettings, less the keys the chart sets."""
    resources: Resources = Resources(
        requests={"cpu": "250m", "memory": "256Mi"}, limits={"memory": "512Mi"}
    )
    podDisruptionBudget: PodDisruptionBudget = PodDisruptionBudget()
    antiAffinity: Literal["soft", "hard", "none"] = "soft"
    """Spread replicas over nodes."""
    nodeSelector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    podAnnotations: dict[str, str] = {}
    terminationGracePeriodSeconds: Annotated[int, Field(ge=0, le=3600)] = 30
    extraEnv: list[EnvVar] = []
    service: Service = Service()


class Agent(Values):
    enabled: bool = True
    """Run the agent DaemonSets."""
    roleLabel: LabelKey = "crossflow.io/role"
    """Node label whose value is the node's role."""
    roles: Annotated[
        list[Literal["decode", "prefill"]],
        Field(min_length=1, max_length=2, json_schema_extra={"uniqueItems": True}),
    ] = ["decode", "prefill"]
    """Roles to run agents for."""
    nodeSelector: dict[str, str | None] = {"nvidia.com/gpu.present": "true"}
    """Node selector every agent pod also needs."""
    tolerations: list[dict[str, Any]] = [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    hostNetwork: bool = False
    """Use the node's network namespace."""
    engineMetricsUrl: Annotated[str, Field(pattern=r"^(https?://.*)?$")] = ""
    """Engine Prometheus endpoint; $(NODE_IP), $(NODE_NAME), $(POD_IP) expand. Empty: the
    engine's default port on the node (30000 for sglang, 8000 for vllm)."""
    engine: Literal["sglang", "vllm", "synthetic"] = "sglang"
    """Engine kind behind that URL."""
    metricsPort: Port = 9465
    """Prometheus /metrics (and /healthz) port of the agent."""
    config: dict[str, Any] = {}
    """AgentSettings, less the keys the chart sets."""
    resources: Resources = Resources(
        requests={"cpu": "50m", "memory": "96Mi"}, limits={"memory": "256Mi"}
    )
    podAnnotations: dict[str, str] = {}
    priorityClassName: str = ""
    extraEnv: list[EnvVar] = []


class GatewayService(Values):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Service type."""
    port: Port = 8000
    """The port clients call."""
    annotations: dict[str, str] = {}
    """Service annotations."""


class GatewayDiscovery(Values):
    enabled: bool = False
    """Find the engines as the Ready pods matching the selectors (a Role lets it list pods)."""
    namespace: Annotated[
        str, Field(max_length=63, pattern=r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    ] = ""
    """The engines' namespace; empty: the release's."""
    prefillSelector: str = ""
    """Label selector of the prefill engines' pods."""
    decodeSelector: str = ""
    """Label selector of the decode engines' pods."""
    port: Port = 8000
    """The engines' HTTP port in the pod."""
    bootstrapPort: Port | None = None
    """SGLang prefill pods' KV bootstrap port."""
    periodSeconds: Annotated[float, Field(gt=0, le=3600)] = 5
    """How often the pods are listed."""


class GatewayCredentials(Values):
    tlsSecret: str = ""
    """Secret with tls.crt and tls.key: a client certificate naming the router (mutual TLS)."""
    tokenSecret: str = ""
    """Secret whose key <routerName> holds the gateway's bearer token."""


class Gateway(Values):
    enabled: bool = False
    """Run crossflow-gateway."""
    routerName: NodeName = "gateway"
    """Its router identity's name (router/<routerName>) and the key of its token."""
    replicas: Annotated[int, Field(ge=1, le=100)] = 2
    """Number of replicas."""
    port: Port = 8000
    """HTTP port in the pod (OpenAI API, /health, /metrics)."""
    config: dict[str, Any] = {}
    """GatewaySettings, less the keys the chart sets."""
    discovery: GatewayDiscovery = GatewayDiscovery()
    credentials: GatewayCredentials = GatewayCredentials()
    resources: Resources = Resources(
        requests={"cpu": "500m", "memory": "256Mi"}, limits={"memory": "1Gi"}
    )
    nodeSelector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    podAnnotations: dict[str, str] = {}
    terminationGracePeriodSeconds: Annotated[int, Field(ge=0, le=3600)] = 30
    extraEnv: list[EnvVar] = []
    service: GatewayService = GatewayService()
    clientsFrom: list[dict[str, Any]] = []
    """NetworkPolicy peers allowed to call its port; empty allows all."""


class Persistence(Values):
    enabled: bool = False
    size: Quantity = "1Gi"
    storageClass: str = ""


class BundledRedis(Values):
    image: Annotated[str, Field(min_length=1)] = "redis:7.4-alpine"
    port: Port = 6379
    persistence: Persistence = Persistence()
    resources: Resources = Resources(
        requests={"cpu": "100m", "memory": "128Mi"}, limits={"memory": "512Mi"}
    )


class ExternalRedis(Values):
    url: Annotated[str, Field(pattern=r"^$|^(redis|rediss|unix)://[^@]*$")] = ""
    """Redis URL without credentials (the password comes from a Secret)."""
    caSecret: str = ""
    """Secret whose ca.crt the Redis server's certificate must chain to (rediss://)."""


class Redis(Values):
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"mode": {"const": "external"}}, "required": ["mode"]},
            "then": {
                "required": ["external"],
                "properties": {
                    "external": {"required": ["url"], "properties": {"url": {"minLength": 1}}}
                },
            },
        }
    )
    mode: Literal["external", "bundled"] = "bundled"
    """external (production) or bundled (trials)."""
    namespace: Annotated[str, Field(min_length=1, max_length=64)] = "crossflow"
    """Key prefix of every Crossflow key."""
    password: str = ""
    existingSecret: str = ""
    passwordKey: Annotated[str, Field(min_length=1)] = "password"
    external: ExternalRedis = ExternalRedis()
    bundled: BundledRedis = BundledRedis()


class ServerTLSValues(Values):
    enabled: bool = True
    """Serve TLS on the broker's gRPC port."""
    secretName: str = ""
    """Secret with tls.crt, tls.key and ca.crt; empty: cert-manager's, else Helm-made ones."""
    mutual: bool = True
    """Require client certificates (mutual TLS)."""
    serverName: str = ""
    """Name callers check the broker's certificate against."""


class AgentCredentials(Values):
    tlsSecret: str = ""
    """Secret with <node>.crt and <node>.key per node."""
    tokenSecret: str = ""
    """Secret with one bearer token per node name."""


class IssuerRef(Values):
    name: str = ""
    kind: Literal["Issuer", "ClusterIssuer"] = "Issuer"
    group: str = "cert-manager.io"


class Generated(Values):
    tokens: bool = True
    """Make bearer tokens (admin, routers, agents) when tokenHashesSecret is empty."""
    agentNodes: list[NodeName] = []
    """Nodes to make agent tokens for, besides the discovered ones."""
    discoverAgentNodes: bool = True
    """Also make tokens for the nodes labelled with agent.roleLabel (lookup)."""
    routers: list[NodeName] = []
    """Router names to make tokens for."""
    validityDays: Annotated[int, Field(ge=1, le=36500)] = 3650
    """Lifetime of the certificates Helm makes."""


class CertManager(Values):
    enabled: bool | Literal["auto"] = "auto"
    """Create cert-manager Certificates: auto when the cluster serves cert-manager.io/v1."""
    issuerRef: IssuerRef = IssuerRef()
    duration: Duration = "2160h"
    renewBefore: Duration = "360h"
    agentNodes: list[Annotated[str, Field(min_length=1, max_length=128)]] = []
    """Node names to issue agent certificates for."""


class Security(Values):
    required: bool = False
    """Refuse to start the broker unless callers are authenticated."""
    insecure: bool = False
    """Serve unauthenticated callers, or tokens over plaintext (auth.insecure)."""
    tls: ServerTLSValues = ServerTLSValues()
    tokenHashesSecret: str = ""
    """Secret whose key `tokens` holds the token hashes."""
    generated: Generated = Generated()
    agentCredentials: AgentCredentials = AgentCredentials()
    certManager: CertManager = CertManager()


class NetworkPolicy(Values):
    enabled: bool = True
    grpcFrom: list[dict[str, Any]] = []
    metricsFrom: list[dict[str, Any]] = []


class ChartValues(Values):
    """Values of the crossflow chart (defaults are values.yaml)."""

    nameOverride: str = ""
    fullnameOverride: str = ""
    image: Image = Image()
    imagePullSecrets: list[str] = []
    serviceAccount: ServiceAccount = ServiceAccount()
    securityContext: SecurityContext = SecurityContext()
    observability: Observability = Observability()
    broker: Broker = Broker()
    agent: Agent = Agent()
    gateway: Gateway = Gateway()
    redis: Redis = Redis()
    security: Security = Security()
    networkPolicy: NetworkPolicy = NetworkPolicy()


def _settings_schema(module: str, name: str, managed: tuple[str, ...]) -> dict[str, Any] | None:
    """The settings model's schema without the chart-managed keys; None when absent."""
    try:
        model = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    schema: dict[str, Any] = model.model_json_schema()
    for key in managed:
        schema.get("properties", {}).pop(key, None)
    schema["required"] = [k for k in schema.get("required", []) if k not in managed]
    if not schema["required"]:
        del schema["required"]
    return schema


def build_schema() -> dict[str, Any]:
    schema = ChartValues.model_json_schema()
    defs: dict[str, Any] = schema.setdefault("$defs", {})
    for section, (module, name, managed) in SETTINGS_MODELS.items():
        sub = _settings_schema(module, name, managed)
        if sub is None:
            continue
        for def_name, definition in sub.pop("$defs", {}).items():
            if defs.setdefault(def_name, definition) != definition:
                raise SystemExit(f"two different schema definitions named {def_name}")
        sub["description"] = f"{name} ({module}), less the keys the chart sets: " + ", ".join(
            managed
        )
        defs[f"{name}Values"] = sub
        defs[section.capitalize()]["properties"]["config"] = {
            "$ref": f"#/$defs/{name}Values",
            "default": {},
        }
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


def render() -> str:
    return json.dumps(build_schema(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = SCHEMA_FILE.read_text(encoding="utf-8") if SCHEMA_FILE.exists() else ""
        if current != text:
            print(
                f"{SCHEMA_FILE.relative_to(ROOT)} is stale: run python scripts/gen_helm_schema.py",
                file=sys.stderr,
            )
            return 1
        return 0
    SCHEMA_FILE.write_text(text, encoding="utf-8")
    print(f"wrote {SCHEMA_FILE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
