"""GPU tests of `tp_qk_norm`: the checks of `tests/tp_gpu_checks.py`, one process per GPU under torchrun.

Skipped unless at least two CUDA GPUs are visible (the CPU suite, tests/test_tp_qk_norm.py, runs the
reference and the Numba pipeline under gloo). The checks run on two ranks and, where more GPUs are
visible, on all of them (`--quick` there). NVLink multicast stays off in the children.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cookbook.bench.tp import MULTICAST_OFF

ROOT = Path(__file__).resolve().parents[1]
NPROC = 2
TIMEOUT_S = 900

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < NPROC, reason=f"needs {NPROC} CUDA GPUs")


def torchrun(*args, prefix=(), nproc=NPROC):
    cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, **MULTICAST_OFF, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_all_checks_pass_on_two_gpus():
    run = torchrun("tests/tp_gpu_checks.py")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-6000:]


@pytest.mark.skipif(torch.cuda.device_count() <= NPROC, reason=f"needs more than {NPROC} CUDA GPUs")
def test_checks_pass_on_every_visible_gpu():
    """The shapes follow the world size: the same checks at 4 or 8 ranks (fewer agreement cases)."""
    run = torchrun("tests/tp_gpu_checks.py", "--quick", nproc=torch.cuda.device_count())
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-6000:]


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not on PATH")
def test_fused_kernel_is_clean_under_compute_sanitizer():
    """memcheck of every rank on one small case (the sanitizer follows torchrun's children). CUDA API
    errors are not counted: PyTorch's symmetric-memory allocator probes driver features whose
    refusals the sanitizer would report; the kernels' memory accesses are what is checked."""
    run = torchrun("tests/tp_gpu_checks.py", "--small",
                   prefix=("compute-sanitizer", "--tool", "memcheck", "--report-api-errors", "no",
                           "--target-processes", "all", "--error-exitcode", "3"))
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-6000:]
