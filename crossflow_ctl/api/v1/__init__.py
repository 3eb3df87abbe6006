"""Generated gRPC code for crossflow.v1 (scripts/gen_protos.py). Do not edit."""
