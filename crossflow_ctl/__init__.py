"""Crossflow control plane: leases from decode nodes, atomic admission for routers."""

__version__ = "0.1.0"
