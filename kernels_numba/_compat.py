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
