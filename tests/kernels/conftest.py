"""Kernel tests run Triton in its CPU interpreter unless told otherwise.

``TRITON_INTERPRET`` must be set before triton is imported (``@triton.jit`` picks the interpreter
when a kernel is defined), so it is set here, before any test module imports the kernels. The
GPU check (``kernels/gpu_check.sh``) sets ``TRITON_INTERPRET=0`` to run the same tests compiled on
a CUDA device. Modules that need torch/triton skip themselves when those are absent.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """``cuda`` when the tests run compiled on a GPU (TRITON_INTERPRET=0), else ``cpu``."""
    if os.environ.get("TRITON_INTERPRET") == "0":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("TRITON_INTERPRET=0 but no CUDA device: compiled kernels need a GPU")
        return "cuda"
    return "cpu"
