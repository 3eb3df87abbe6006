"""Telemetry sources: SGLang and vLLM Prometheus endpoints, and a synthetic engine."""
