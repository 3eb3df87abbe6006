"""``crossflow-gateway``: the data path. An OpenAI-compatible HTTP front for a P/D cluster that
asks Admit for each request and sends it where the answer says (see :mod:`.pipeline`).

HTTP only; it asks the broker through the public client library, like any router.
"""
