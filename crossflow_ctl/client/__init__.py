"""The public client library (what routers and crossflowctl use): async, over grpc.aio.

``AdmissionClient`` (Admit/Commit/Release/WatchRoom, optional fail-closed Admit),
``AdmissionStream`` (AdmitStream for high-QPS routers, fail-closed per request) and
``AdminClient`` return domain models and raise the domain's error classes (see
``client.errors``). ``AdmissionQueue`` (``client.queue``) does late binding over any admitter.
``ClientCredentials`` secures the clients' channel: TLS, mutual TLS, a bearer token.
"""

from crossflow_ctl.client.admin import AdminClient
from crossflow_ctl.client.admission import AdmissionClient
from crossflow_ctl.client.admission_stream import AdmissionStream
from crossflow_ctl.client.holding import Dispatch, QueueConfig
from crossflow_ctl.client.models import (
    CommitResult,
    NodeDetailView,
    NodeEventView,
    NodeView,
    reporting_nodes,
)
from crossflow_ctl.client.queue import (
    AdmissionQueue,
    Admitter,
    Outcome,
    QueueObserver,
    QueueStats,
    Ticket,
)
from crossflow_ctl.security import ClientCredentials

__all__ = [
    "AdminClient",
    "AdmissionClient",
    "AdmissionQueue",
    "AdmissionStream",
    "Admitter",
    "ClientCredentials",
    "CommitResult",
    "Dispatch",
    "NodeDetailView",
    "NodeEventView",
    "NodeView",
    "Outcome",
    "QueueConfig",
    "QueueObserver",
    "QueueStats",
    "Ticket",
    "reporting_nodes",
]
