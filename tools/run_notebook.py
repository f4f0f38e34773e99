#!/usr/bin/env python3
"""Run a jupytext percent script cell by cell and write the `.ipynb` with its outputs.

    python tools/run_notebook.py notebooks/01_qk_norm.py            # -> notebooks/01_qk_norm.ipynb
    python tools/run_notebook.py notebooks/01_qk_norm.py -o out.ipynb

Dependency-free (standard library; matplotlib only if the notebook uses it): GPU machines have no
jupyter, nbclient or jupytext, and this is how the committed notebooks get outputs from a real
GPU run. All code cells run in one namespace, in the script's directory (as Jupyter would run
the paired notebook). Per cell it records:

* stdout and stderr (echoed to the terminal as well, so a long GPU run shows progress);
* the value of a trailing expression, as ``text/plain`` (a trailing ``;`` hides it, as in IPython);
* every matplotlib figure still open at the end of the cell, as ``image/png`` (Agg backend),
  then closes it;
* an exception: an ``error`` output; later cells are not run, the notebook is still written, and
  the exit status is 1.

Markdown cells are carried over. The parser follows jupytext's percent format for what the
notebooks here use (``# %%`` and ``# %% [markdown]`` markers, the ``# ---`` header);
tests/test_notebooks.py checks that it splits cells exactly as jupytext does.
"""

from __future__ import annotations

import argparse
import ast
import base64
import io
import json
import os
import platform
import re
import sys
import time
import traceback
from pathlib import Path

NBFORMAT, NBFORMAT_MINOR = 4, 5
_MARKER = re.compile(r"^# %%(?P<rest>.*)$")
_CELL_TYPE = re.compile(r"\[(markdown|md|raw)\]")
_HEADER_FENCE = "# ---"
METADATA = {
    "jupytext": {"formats": "ipynb,py:percent"},
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


# --------------------------------------------------------------------------------------------
# Parsing the percent format.
# --------------------------------------------------------------------------------------------
def _strip_blank_edges(lines: list[str]) -> list[str]:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def _uncomment(line: str) -> str:
    if line.startswith("# "):
        return line[2:]
    return line[1:] if line.startswith("#") else line


def parse_percent(text: str) -> list[dict]:
    """[{"cell_type": "code" | "markdown" | "raw", "source": str}] of a percent script."""
    lines = text.splitlines()
    if lines and lines[0] == _HEADER_FENCE:  # the YAML header of jupytext: notebook metadata
        end = lines.index(_HEADER_FENCE, 1)
        lines = lines[end + 1 :]
    cells, kind, body = [], None, []

    def close():
        if kind is None:
            if _strip_blank_edges(body):  # code before the first marker is a cell too
                cells.append({"cell_type": "code", "source": "\n".join(_strip_blank_edges(body))})
            return
        content = _strip_blank_edges(body)
        if kind != "code":
            content = [_uncomment(line) for line in content]
        cells.append({"cell_type": kind, "source": "\n".join(content)})

    for line in lines:
        match = _MARKER.match(line)
        if match:
            close()
            found = _CELL_TYPE.search(match["rest"])
            kind = {"md": "markdown"}.get(found[1], found[1]) if found else "code"
            body = []
        else:
            body.append(line)
    close()
    return cells


# --------------------------------------------------------------------------------------------
# Running cells.
# --------------------------------------------------------------------------------------------
class _Tee(io.TextIOBase):
    """Collects what a cell writes, and echoes it to the real stream."""

    def __init__(self, echo):
        self.parts, self.echo = [], echo

    def write(self, text):
        self.parts.append(text)
        self.echo.write(text)
        return len(text)

    def flush(self):
        self.echo.flush()

    def isatty(self):
        return False

    def getvalue(self) -> str:
        return "".join(self.parts)


def _terminal_text(text: str) -> str:
    """What a terminal shows: within each line, a carriage return overwrites (progress bars)."""
    shown = []
    for line in text.split("\n"):
        segments = [segment for segment in line.split("\r") if segment]
        shown.append(segments[-1] if segments else "")
    return "\n".join(shown)


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _figures() -> list[dict]:
    """display_data outputs of the open matplotlib figures (closed afterwards)."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return []
    outputs = []
    for number in pyplot.get_fignums():
        figure = pyplot.figure(number)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", bbox_inches="tight")
        width, height = figure.get_size_inches() * figure.dpi
        outputs.append({
            "output_type": "display_data",
            "data": {"image/png": base64.b64encode(buffer.getvalue()).decode("ascii"),
                     "text/plain": [f"<Figure size {width:g}x{height:g} with {len(figure.axes)} Axes>"]},
            "metadata": {},
        })
        pyplot.close(figure)
    return outputs


def run_cell(source: str, namespace: dict, filename: str, count: int) -> tuple[list[dict], bool]:
    """Execute one code cell: (outputs, ok)."""
    out, err = _Tee(sys.__stdout__), _Tee(sys.__stderr__)
    result, error = None, None
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        tree = ast.parse(source, filename=filename)
        trailing = None
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";"):
            trailing = ast.Expression(tree.body.pop().value)
        exec(compile(tree, filename, "exec"), namespace)
        if trailing is not None:
            result = eval(compile(trailing, filename, "eval"), namespace)
    except BaseException as exc:  # noqa: BLE001 (KeyboardInterrupt too: write what ran)
        error = exc
    finally:
        sys.stdout, sys.stderr = saved
    outputs = []
    for name, stream in (("stdout", out), ("stderr", err)):
        text = _terminal_text(stream.getvalue())
        if text:
            outputs.append({"output_type": "stream", "name": name, "text": _lines(text)})
    if error is None and result is not None:
        outputs.append({"output_type": "execute_result", "execution_count": count,
                        "data": {"text/plain": _lines(repr(result))}, "metadata": {}})
    outputs += _figures()
    if error is not None:
        frames = traceback.format_exception(type(error), error, error.__traceback__)
        outputs.append({"output_type": "error", "ename": type(error).__name__, "evalue": str(error),
                        "traceback": [frame.rstrip("\n") for frame in frames]})
        sys.__stderr__.write("".join(frames))
    return outputs, error is None


def run_notebook(script: Path, output: Path) -> bool:
    """Run `script` (a percent script) and write `output` (.ipynb); True when every cell ran."""
    os.environ.setdefault("MPLBACKEND", "Agg")  # before the notebook imports matplotlib
    script = script.resolve()
    cells = parse_percent(script.read_text())
    namespace = {"__name__": "__main__", "__file__": str(script)}
    notebook_cells, count, ok = [], 0, True
    cwd = os.getcwd()
    os.chdir(script.parent)
    sys.path.insert(0, str(script.parent))
    started = time.time()
    try:
        for index, cell in enumerate(cells):
            entry = {"cell_type": cell["cell_type"], "id": f"cell-{index}", "metadata": {},
                     "source": _lines(cell["source"])}
            if cell["cell_type"] == "code":
                entry.update(execution_count=None, outputs=[])
                if ok:
                    count += 1
                    sys.__stderr__.write(f"[run_notebook] cell {index} ({count})\n")
                    entry["outputs"], ok = run_cell(cell["source"], namespace, f"<{script.name} cell {index}>", count)
                    entry["execution_count"] = count
            notebook_cells.append(entry)
    finally:
        os.chdir(cwd)
        sys.path.remove(str(script.parent))
    metadata = json.loads(json.dumps(METADATA))
    metadata["language_info"]["version"] = platform.python_version()
    notebook = {"cells": notebook_cells, "metadata": metadata, "nbformat": NBFORMAT, "nbformat_minor": NBFORMAT_MINOR}
    output.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    status = "ran" if ok else "STOPPED at an error in"
    sys.__stderr__.write(f"[run_notebook] {status} {count} code cells in {time.time() - started:.1f} s; wrote {output}\n")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", type=Path, help="a jupytext percent script (notebooks/NN_name.py)")
    parser.add_argument("-o", "--output", type=Path, help="the .ipynb to write (default: next to the script)")
    args = parser.parse_args(argv)
    return 0 if run_notebook(args.script, args.output or args.script.with_suffix(".ipynb")) else 1


if __name__ == "__main__":
    sys.exit(main())
