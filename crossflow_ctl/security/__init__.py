"""Transport security shared by the broker, the client library, the agent and the CLI.

* :mod:`.identity`: who a caller is (``Identity``: a role and a name), read from a SPIFFE URI
  (``spiffe://<trust-domain>/<node|router|admin>/<name>``) in a certificate's SAN, or from a
  bearer token looked up in a file of token hashes (:class:`TokenTable`).
* :mod:`.settings`: the settings models (``ClientCredentials`` for callers, ``AuthSettings`` and
  ``ServerTLS`` for the broker), nested into each process's one settings model.
* :mod:`.channel`: the one way a caller opens a channel to the broker (TLS, mTLS, bearer token).
"""

from crossflow_ctl.security.identity import Identity, Role, TokenTable, hash_token
from crossflow_ctl.security.settings import AuthSettings, ClientCredentials, ServerTLS

__all__ = [
    "AuthSettings",
    "ClientCredentials",
    "Identity",
    "Role",
    "ServerTLS",
    "TokenTable",
    "hash_token",
]
