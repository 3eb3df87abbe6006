"""Optional mypyc build of the numeric kernels; pure Python otherwise (the default).

``CROSSFLOW_MYPYC=1 pip install --no-build-isolation .`` (mypy installed, a C compiler
present) compiles the modules in ``KERNELS``: the step-time roofline, the Safety arithmetic and
the lending arithmetic (chunk search, pricing, debits), which the simulator and the agents call
in their hot loops. They compute exactly what the pure modules compute:
``tests/domain/test_compiled_kernels.py`` builds them and holds the simulator's golden runs to
the same decisions. Everything else is in pyproject.toml. Editable installs stay pure Python: a
compiled module next to its source would shadow later edits of it.
"""

from __future__ import annotations

import os

from setuptools import setup

KERNELS = (
    "crossflow_ctl/domain/roofline.py",
    "crossflow_ctl/domain/safety.py",
    "crossflow_ctl/domain/lending.py",
)

if os.environ.get("CROSSFLOW_MYPYC") == "1":
    from mypyc.build import mypycify

    setup(ext_modules=mypycify(list(KERNELS), opt_level="3"))
else:
    setup()
