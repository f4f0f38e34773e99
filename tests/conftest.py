"""Test setup: the Numba CUDA simulator on machines without a GPU, and hypothesis profiles.

NUMBA_ENABLE_CUDASIM must be set before Numba is first imported, so it is decided here, at the
top of the first module pytest loads.
"""

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

# The simulator runs every GPU thread as a Python thread: few, tiny examples on a CPU.
settings.register_profile(
    "cpu", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("gpu", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if ON_GPU else "cpu"))
