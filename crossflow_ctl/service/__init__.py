"""The control plane's application service: admission, reservations, lease ingest, admin.

Below every transport: the gRPC servicers (:mod:`crossflow_ctl.broker`), the simulator and the
demo drive the same :class:`Broker` over a :class:`~crossflow_ctl.store.base.Store`.
"""

from crossflow_ctl.service.broker import Broker, NodeDetail
from crossflow_ctl.service.config import BrokerSettings, load_settings

__all__ = ["Broker", "BrokerSettings", "NodeDetail", "load_settings"]
