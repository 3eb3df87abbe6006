"""The proto bridge: ``crossflow.v1`` messages <-> domain models, for the broker and the client.

It sits between the generated code (crossflow_ctl.api.v1) and the domain, below both the broker and
the client, so routers and the CLI use the contract without importing broker internals.
"""
