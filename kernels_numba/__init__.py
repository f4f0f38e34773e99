"""Numba CUDA kernels: the same algorithms as the CUDA C versions, written in Python.

Importing this package does not import Numba (the registry asks `SIMULATOR` cheaply). Kernels run
on a GPU, or on the CPU under Numba's CUDA simulator when NUMBA_ENABLE_CUDASIM=1 is set before
Numba is first imported.

``SIMULATOR`` (also `simulator()`) is read when asked, not at import: until Numba is imported it
follows the variable, so setting ``os.environ["NUMBA_ENABLE_CUDASIM"] = "1"`` in a notebook and
retrying works; from then on it is what Numba read, and changing it needs a new process
(`how_to_simulate` says so).
"""

import os
import sys

# Numba reads NUMBA_ENABLE_CUDASIM once, into numba.core.config, when it is first imported (the
# CUDA target's config is that module); numba.cuda then imports one of its two halves by it.
_NUMBA_CONFIG = "numba.core.config"
_SIMULATOR_HALF, _DEVICE_HALF = "numba.cuda.simulator_init", "numba.cuda.device_init"


def requested() -> bool:
    """Whether NUMBA_ENABLE_CUDASIM asks for the simulator now."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def numba_choice() -> bool | None:
    """What Numba chose (True: the simulator) once imported: the half numba.cuda imported, or
    before that the value its configuration read; None while Numba is not imported."""
    if _SIMULATOR_HALF in sys.modules:
        return True
    if _DEVICE_HALF in sys.modules:
        return False
    config = sys.modules.get(_NUMBA_CONFIG)
    return None if config is None else bool(config.ENABLE_CUDASIM)


def simulator() -> bool:
    """Whether the Numba kernels run under the CUDA simulator: Numba's choice once made, else
    what NUMBA_ENABLE_CUDASIM asks for now."""
    chosen = numba_choice()
    return requested() if chosen is None else chosen


def __getattr__(name: str):
    if name == "SIMULATOR":  # `from kernels_numba import SIMULATOR`: the value at that moment
        return simulator()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def how_to_simulate() -> str:
    """How to run the Numba kernels on CPU tensors from here: set the variable, or, once Numba
    was imported without the simulator, restart the process with it set."""
    if numba_choice() is False:
        now = "; setting it now has no effect" if requested() else ""
        return ("CPU tensors run the Numba kernels only under the CUDA simulator, and this process imported Numba "
                f"without it: NUMBA_ENABLE_CUDASIM is read once, when Numba is first imported{now}. Restart the "
                "process (in a notebook: restart the kernel) with NUMBA_ENABLE_CUDASIM=1 set before anything "
                "imports numba")
    return ("CPU tensors run the Numba kernels only under the CUDA simulator: set NUMBA_ENABLE_CUDASIM=1 "
            "(os.environ[\"NUMBA_ENABLE_CUDASIM\"] = \"1\" in this process works until Numba is imported)")
