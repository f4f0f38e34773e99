"""Compatibility shims that must run before Numba compiles anything: import this module first.

NumPy 2.5 removed ``np.row_stack`` (a deprecated alias of ``np.vstack`` since NumPy 2.0), but
numba-cuda 0.30 (``numba/cuda/np/arrayobj.py``) still registers an overload for it on every
NumPy >= 2.0, so the first kernel compile fails with
``AttributeError: module 'numpy' has no attribute 'row_stack'``. We put back a stand-in with the
old behaviour. It is a distinct function (as ``row_stack`` was before 2.5), so the overload
registers on it and not a second time on ``np.vstack``.

Remove this module once the pinned numba-cuda guards that overload by NumPy version (numba 0.68
itself already does: ``numpy_version < (2, 5)``).
"""

import numpy as np

if not hasattr(np, "row_stack"):

    def row_stack(tup, *, dtype=None, casting="same_kind"):
        """NumPy < 2.5's ``row_stack``: the same as ``np.vstack``."""
        return np.vstack(tup, dtype=dtype, casting=casting)

    np.row_stack = row_stack


# ------------------------------------------------------------------------------------------
# The CUDA simulator's shared arrays. The simulator runs a block's threads as Python threads and
# keys each `cuda.shared.array` by its source line: the first thread to reach the line allocates
# the array, the others look it up. The look-up and the allocation are not one step, so two
# threads that reach the line together in a block's first call can each allocate an array of
# their own: they then write and read different memory, and a block sum silently drops some
# threads' values (seen in CI, once, as one token's sum short by a few percent). A lock makes the
# first allocation one step. Only under the simulator (importing its kernel API does not import
# the GPU half of Numba).
# ------------------------------------------------------------------------------------------
def _serialize_simulated_shared_arrays() -> None:
    import sys
    import threading

    from numba.cuda.simulator import kernelapi

    shared = kernelapi.FakeCUDAShared
    if getattr(shared, "_cookbook_locked", False):
        return
    unlocked = shared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory (one buffer), or the simulator's refusal
            return unlocked(self, shape, dtype, alignment)
        caller = sys._getframe(1)  # the kernel's line: the array's key, as the simulator keys it
        key = (caller.f_code.co_filename, caller.f_lineno)
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        with lock:
            if key not in self._allocations:
                self._allocations[key] = np.empty(shape, dtype)
            return self._allocations[key]

    shared.array = array
    shared._cookbook_locked = True


def _simulator_requested() -> bool:
    from kernels_numba import simulator

    return simulator()


if _simulator_requested():
    _serialize_simulated_shared_arrays()
