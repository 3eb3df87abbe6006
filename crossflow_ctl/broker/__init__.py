"""broker."""
