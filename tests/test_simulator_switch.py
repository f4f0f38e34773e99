"""NUMBA_ENABLE_CUDASIM set late: honoured while Numba is not imported yet (as in a notebook that
sets os.environ after a failed call), else an error that says to restart.

Each case runs in a fresh interpreter without the variable and without a visible GPU, so the test
session's own Numba (imported under the simulator by conftest) is not involved."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LATE = textwrap.dedent("""
    import os
    import torch
    import cookbook, kernels_numba  # neither imports Numba
    {prelude}
    q, k, w = torch.randn(2, 4, 64), torch.randn(2, 2, 64), torch.ones(64)
    try:
        cookbook.qk_norm(q.clone(), k.clone(), w, w, backend="numba")
        print("BEFORE ran")
    except ValueError as error:
        print("BEFORE", error)
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # set late, as a notebook user would after that error
    want_q, want_k = cookbook.qk_norm(q.clone(), k.clone(), w, w, backend="reference")
    try:
        cookbook.qk_norm(q, k, w, w, backend="numba")
        print("AFTER ran, agrees:", torch.allclose(q, want_q, atol=1e-5) and torch.allclose(k, want_k, atol=1e-5))
    except ValueError as error:
        print("AFTER", error)
""")


def _run(prelude: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name != "NUMBA_ENABLE_CUDASIM"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", LATE.format(prelude=prelude)], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return dict(line.split(" ", 1) for line in run.stdout.splitlines() if line.startswith(("BEFORE", "AFTER")))


def test_a_late_setting_is_honoured_before_numba_is_imported():
    said = _run("")
    assert "NUMBA_ENABLE_CUDASIM=1" in said["BEFORE"] and "restart" not in said["BEFORE"].lower(), said
    assert said["AFTER"] == "ran, agrees: True", said


@pytest.mark.parametrize("prelude", ["import numba", "from numba import cuda"])
def test_a_late_setting_after_numba_is_imported_says_restart(prelude):
    said = _run(prelude + "  # Numba reads NUMBA_ENABLE_CUDASIM (unset) now, once")
    assert "NUMBA_ENABLE_CUDASIM" in said["BEFORE"] and "Restart the process" in said["BEFORE"], said
    assert "setting it now has no effect" in said["AFTER"] and "Restart the process" in said["AFTER"], said
    assert "notebook: restart the kernel" in said["AFTER"], said
