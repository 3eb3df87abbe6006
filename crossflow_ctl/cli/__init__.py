"""Command-line entry points: crossflowctl (operators) and crossflow (demo)."""
