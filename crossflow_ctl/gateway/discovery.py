"""Engines from Kubernetes: the ready pods that match a label selector, polled.

The gateway lists ``/api/v1/namespaces/{namespace}/pods?labelSelector=...`` with its service
account's token every ``period_s``. A pod counts once it is Running and Ready, at
``http://{podIP}:{port}``. Its engine id is the Kubernetes node it runs on (``spec.nodeName``):
that is the id the chart's agent DaemonSet leases under, so a BORROW's node is the engine on that
node. One decode engine per node (two matching pods on one node are refused, by name, in the log).
A list that fails keeps the engines as they were (an API hiccup must not empty the pools).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import aiohttp
import structlog
from pydantic import BaseModel, ConfigDict, Field

from crossflow_ctl.domain.models import is_node_id

log = structlog.get_logger()

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubernetesEngines(BaseModel):
    """Where the gateway finds its engines in a cluster (``kubernetes:`` in its settings)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: Annotated[str, Field(min_length=1, max_length=63)]
    prefill_selector: Annotated[str, Field(min_length=1)]
    """Label selector of the prefill engines' pods, e.g. ``app=vllm,crossflow.io/role=prefill``."""
    decode_selector: Annotated[str, Field(min_length=1)]
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    """The engines' HTTP port in the pod."""
    bootstrap_port: Annotated[int | None, Field(ge=1, le=65535)] = None
    """SGLang prefill pods' KV bootstrap port."""
    period_s: Annotated[float, Field(gt=0, le=3600)] = 5.0
    api_url: str = "https://kubernetes.default.svc"
    token_file: Path = SERVICE_ACCOUNT / "token"
    ca_file: Path | None = SERVICE_ACCOUNT / "ca.crt"
    """None: the API's certificate is not checked (a test API on plain HTTP)."""


class DiscoveryError(Exception):
    pass


def ready_engines(pod_list: dict[str, Any], port: int, role: str) -> list[dict[str, Any]]:
    """Engine endpoints (as settings take them) of the Running and Ready pods in a PodList."""
    found: dict[str, dict[str, Any]] = {}
    for pod in pod_list.get("items") or []:
        name = str(pod.get("metadata", {}).get("name", "?"))
        status, spec = pod.get("status") or {}, pod.get("spec") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        node, ip = spec.get("nodeName"), status.get("podIP")
        if status.get("phase") != "Running" or not ready or not node or not ip:
            continue
        if not is_node_id(node):
            log.warning("gateway.discovery_bad_node", pod=name, node=node)
            continue
        if node in found:
            log.warning("gateway.discovery_two_engines_on_a_node", node=node, pod=name, role=role)
            continue
        host = f"[{ip}]" if ":" in ip else ip
        found[node] = {"node_id": node, "url": f"http://{host}:{port}"}
    return sorted(found.values(), key=lambda e: e["node_id"])


async def list_pods(
    session: aiohttp.ClientSession, source: KubernetesEngines, selector: str
) -> dict[str, Any]:
    url = (
        f"{source.api_url.rstrip('/')}/api/v1/namespaces/{quote(source.namespace)}/pods"
        f"?labelSelector={quote(selector)}"
    )
    try:
        token = source.token_file.read_text().strip()
    except OSError as exc:
        raise DiscoveryError(f"cannot read the service account token: {exc}") from None
    ssl: Any = None
    if source.ca_file is not None and url.startswith("https"):
        import ssl as ssl_module

        try:
            ssl = ssl_module.create_default_context(cafile=str(source.ca_file))
        except OSError as exc:
            raise DiscoveryError(f"cannot read the API's CA {source.ca_file}: {exc}") from None
    try:
        async with session.get(
            url,
            headers={"Authorization": f"Bearer {token}"},
            ssl=ssl,
            timeout=aiohttp.ClientTimeout(total=10),
        ) as resp:
            if resp.status != 200:
                raise DiscoveryError(f"listing pods ({selector}) answered {resp.status}")
            data = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise DiscoveryError(f"listing pods ({selector}) failed: {exc}") from None
    if not isinstance(data, dict):
        raise DiscoveryError("the pod list is not a JSON object")
    return data


async def discover(
    session: aiohttp.ClientSession, source: KubernetesEngines
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(prefill, decode) endpoints now; DiscoveryError when either list fails."""
    prefill = ready_engines(
        await list_pods(session, source, source.prefill_selector), source.port, "prefill"
    )
    if source.bootstrap_port is not None:
        for engine in prefill:
            engine["bootstrap_port"] = source.bootstrap_port
    decode = ready_engines(
        await list_pods(session, source, source.decode_selector), source.port, "decode"
    )
    return prefill, decode
