"""The committed notebooks cannot drift from their jupytext sources.

Each `notebooks/NN_name.py` (jupytext percent script: the source we edit and review) is paired
with `notebooks/NN_name.ipynb` (the notebook with outputs from a real GPU run, written by
`tools/run_notebook.py`). Their cells must be the same, and the dependency-free runner must split
a script into cells exactly as jupytext does.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext", reason="jupytext is not installed (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


def _runner():
    spec = importlib.util.spec_from_file_location("run_notebook", ROOT / "tools" / "run_notebook.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cells(notebook, cell_type=None):
    return [(c.cell_type, c.source) for c in notebook.cells if cell_type in (None, c.cell_type)]


def test_there_are_notebooks():
    assert SCRIPTS, "no notebooks/NN_name.py scripts found"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_ipynb_matches_percent_source(script):
    ipynb = script.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} is missing: run `python tools/run_notebook.py {script.relative_to(ROOT)}`"
    source, committed = jupytext.read(script), jupytext.read(ipynb)
    for cell_type in ("code", "markdown"):
        want, got = _cells(source, cell_type), _cells(committed, cell_type)
        assert len(got) == len(want), f"{ipynb.name}: {len(got)} {cell_type} cells, {script.name} has {len(want)}"
        for i, (w, g) in enumerate(zip(want, got)):
            assert g == w, (
                f"{ipynb.name} {cell_type} cell {i} differs from {script.name}: regenerate it with "
                f"`python tools/run_notebook.py {script.relative_to(ROOT)}` (GPU) or `jupytext --to ipynb`\n"
                f"--- in {script.name}:\n{w[1][:400]}\n--- in {ipynb.name}:\n{g[1][:400]}"
            )
    assert _cells(committed) == _cells(source), f"{ipynb.name}: the cell order differs from {script.name}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_runner_splits_cells_like_jupytext(script):
    ours = [(c["cell_type"], c["source"]) for c in _runner().parse_percent(script.read_text())]
    assert ours == _cells(jupytext.read(script))
