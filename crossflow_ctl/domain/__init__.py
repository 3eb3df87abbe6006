"""Pure domain code: models, admission policy, capacity model, sizing.

Nothing here does I/O or imports grpc, redis, HTTP clients or torch (see .importlinter).
The broker, the agent and the simulator all import these modules, so they cannot drift apart.
"""
