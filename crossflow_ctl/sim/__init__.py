"""Trace-driven simulator of a P/D cluster running the real admission policy, store and leases."""
