"""Triton kernels (with PyTorch references) that calibrate a node's roofline."""
