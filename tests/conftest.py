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


def pytest_collection_modifyitems(session, config, items):
    """Tests that wait for nvcc run last, so that its compiles (started below) overlap the rest."""
    items.sort(key=lambda item: item.get_closest_marker("nvcc") is not None)  # stable: order kept otherwise


def pytest_collection_finish(session):
    import nvcc_jobs
    from cookbook import nvcc_report

    if nvcc_report.nvcc() is None or session.config.option.collectonly:
        return
    calls = [call for call in map(nvcc_jobs.call_of, session.items) if call is not None]
    reports = (nvcc_report.compile_header, nvcc_report.compile_extension)
    calls.sort(key=lambda call: call[0] not in reports)  # the reports first: notebooks read them too
    nvcc_jobs.start(calls)


def pytest_sessionfinish(session, exitstatus):
    import nvcc_jobs

    nvcc_jobs.stop()
