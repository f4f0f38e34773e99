"""Numba CUDA kernels: the same algorithms as the CUDA C versions, written in Python.

Importing this package does not import Numba (the registry asks `SIMULATOR` cheaply). Kernels run
on a GPU, or on the CPU under Numba's CUDA simulator when NUMBA_ENABLE_CUDASIM=1 is set before
Numba is first imported.
"""

import os

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
