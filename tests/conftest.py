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


def _skip_reason(report) -> str:
    """The reason pytest gives for a skipped test, without its file and line."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line per kind of skip instead of thousands of 's': what a CPU-only run leaves out."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    gpu_words = ("GPU", "CUDA tensors", "compute-sanitizer", "torchrun")
    gpu = sum(any(word in _skip_reason(r) for word in gpu_words) for r in skipped)
    other = {}
    for report in skipped:
        reason = _skip_reason(report)
        if not any(word in reason for word in gpu_words):
            other[reason] = other.get(reason, 0) + 1
    terminalreporter.write_sep("-", "skipped")
    if gpu:
        terminalreporter.write_line(f"{gpu} GPU tests skipped: no GPU (they run on a CUDA GPU: H100/H200)")
    for reason, count in sorted(other.items(), key=lambda item: -item[1])[:8]:
        terminalreporter.write_line(f"{count} skipped: {reason}")
