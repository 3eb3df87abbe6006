"""Crossflow node agent: engine telemetry -> capacity model -> leases on a gRPC stream."""
