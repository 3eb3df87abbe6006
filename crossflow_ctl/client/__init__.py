"""The public client library (what routers and crossflowctl use): async, over grpc.aio.

``AdmissionClient`` (Admit/Commit/Release, optional fail-closed Admit) and ``AdminClient``
return domain models and raise the domain's error classes (see ``client.errors``).
"""

from crossflow_ctl.client.admin import AdminClient
from crossflow_ctl.client.admission import AdmissionClient
from crossflow_ctl.client.models import CommitResult, NodeDetailView, NodeEventView, NodeView

__all__ = [
    "AdminClient",
    "AdmissionClient",
    "CommitResult",
    "NodeDetailView",
    "NodeEventView",
    "NodeView",
]
