"""The public client library (what routers and crossflowctl use): async, over grpc.aio.

``AdmissionClient`` (Admit/Commit/Release, optional fail-closed Admit), ``AdmissionStream``
(AdmitStream for high-QPS routers, fail-closed per request) and ``AdminClient``
return domain models and raise the domain's error classes (see ``client.errors``).
"""

from crossflow_ctl.client.admin import AdminClient
from crossflow_ctl.client.admission import AdmissionClient
from crossflow_ctl.client.admission_stream import AdmissionStream
from crossflow_ctl.client.models import CommitResult, NodeDetailView, NodeEventView, NodeView

__all__ = [
    "AdminClient",
    "AdmissionClient",
    "AdmissionStream",
    "CommitResult",
    "NodeDetailView",
    "NodeEventView",
    "NodeView",
]
