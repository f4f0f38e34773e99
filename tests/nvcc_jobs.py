"""The nvcc compiles of the CUDA C sources, started in the background at the start of a session.

CI's machine has two cores and no GPU; the simulator tests keep one core busy in Python, and nvcc
would otherwise run after them, one compile at a time, for several minutes. So `conftest.py`
starts, as soon as collection is done, every compile that the selected tests marked
`@pytest.mark.nvcc("<function of cookbook.nvcc_report>", *args)` will need, one after another on
a worker thread (nvcc itself runs as a subprocess, on the other core), and runs those tests last.
A test asks for its result with `result(function, *args)`: it waits for the job started for the
same call, or, where none was started (the test run on its own), makes the call itself. A
failed compile raises in the test that asks for it, with nvcc's output.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from cookbook import nvcc_report

_jobs: dict[tuple, Future] = {}
_pool: ThreadPoolExecutor | None = None


def call_of(item) -> tuple | None:
    """(function, args) a collected test's `nvcc` marker names; the args default to its `op` (or
    its extension's `name`) parameter."""
    marker = item.get_closest_marker("nvcc")
    if marker is None or not marker.args:
        return None
    function, *args = marker.args
    if not args:
        params = item.callspec.params
        args = [params["op"] if "op" in params else params["name"]]
    return getattr(nvcc_report, function), tuple(args)


def start(calls) -> None:
    """Start the compiles of `calls` ((function, args) pairs, in order) on one worker thread."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvcc")
    for function, args in calls:
        key = (function.__name__, args)
        if key not in _jobs:
            _jobs[key] = _pool.submit(function, *args)


def stop() -> None:
    """Drop the compiles no test waited for (the one running finishes: nvcc is not interrupted)."""
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)


def result(function, *args):
    job = _jobs.get((function.__name__, args))
    return job.result() if job is not None else function(*args)
