"""The README's code runs as pasted, and the extras are where a newcomer looks.

Every ```python block of README.md runs in a fresh interpreter, from a directory outside the
checkout, without NUMBA_ENABLE_CUDASIM: a block whose first line is ``# needs a GPU`` (GPU_MARK)
runs only where a CUDA GPU is visible; every other block must run on a CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GPU_MARK = "# needs a GPU"
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[str]:
    return _PYTHON_BLOCK.findall(text)


BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_blocks_for_both_machines():
    cpu = [block for block in BLOCKS if not block.startswith(GPU_MARK)]
    assert len(cpu) >= 3 and len(cpu) < len(BLOCKS), "expected CPU blocks and at least one marked GPU block"
    assert python_blocks("```python\n# needs a GPU\nx\n```\ntext\n```python\ny\n```\n") == [f"{GPU_MARK}\nx\n", "y\n"]


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_a_readme_block_runs_as_pasted(block, tmp_path):
    if block.startswith(GPU_MARK) and not torch.cuda.is_available():
        pytest.skip("a README block marked for a CUDA GPU")
    env = {name: value for name, value in os.environ.items() if name != "NUMBA_ENABLE_CUDASIM"}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")  # as installed; tiny models need no download
    run = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert run.returncode == 0, f"README block failed as pasted:\n{block}\n--- stderr:\n{run.stderr[-3000:]}"


# ---- the extras ------------------------------------------------------------------------------------
def _extra(name: str) -> set[str]:
    """The distributions pyproject.toml's extra `name` lists."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower() for requirement in extras[name]}


def test_the_notebooks_extra_is_named_where_a_newcomer_looks():
    notebook_00 = (ROOT / "notebooks" / "00_getting_started.py").read_text()
    for page in (README.read_text(), notebook_00):
        assert 'pip install -e ".[notebooks]"' in page
    assert {"jupyter", "matplotlib", "transformers"} <= _extra("notebooks")  # notebook 05 builds tiny models


def test_the_test_extra_executes_notebooks_with_jupyter():
    """nbmake runs the notebooks through nbclient (which brings nbformat, jupyter-client and
    jupyter-core, and `jupyter execute`) on the ipykernel kernel: the extra names both directly."""
    assert {"nbmake", "nbclient", "ipykernel", "transformers"} <= _extra("test")
    assert "jupyter execute notebooks/00_getting_started.ipynb" in README.read_text()
