"""The public client library (what routers and crossflowctl use): async, over grpc.aio.

``AdmissionClient`` (Admit/Commit/Release, optional fail-closed Admit) and ``AdminClient``
return domain models and raise the domain's error classes (see ``client.errors``).
``ClientCredentials`` secures their channel: TLS, mutual TLS, a bearer token.
"""

from crossflow_ctl.client.admin import AdminClient
from crossflow_ctl.client.admission import AdmissionClient
from crossflow_ctl.client.models import CommitResult, NodeDetailView, NodeEventView, NodeView
from crossflow_ctl.security import ClientCredentials

__all__ = [
    "AdminClient",
    "AdmissionClient",
    "ClientCredentials",
    "CommitResult",
    "NodeDetailView",
    "NodeEventView",
    "NodeView",
]
