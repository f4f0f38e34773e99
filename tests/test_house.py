"""The house rules that code can check: no import circles, contracts that import alone, builds
split one extension per kernel file, and build locks that never wait for a dead builder."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kernels_cuda import KERNEL_DIR, Extension

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cookbook"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """The cookbook modules `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        # a package's own __init__ is where its submodules are imported from: not an edge back
        graph[name] = {dep for dep in _imports(path, known) if dep != name and not name.startswith(dep + ".")}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (circle := visit(node)):
            return circle
    return None


def test_no_import_circle_among_cookbook_modules():
    circle = find_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_circle_finder_finds_a_circle():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


CONTRACTS = sorted(p.stem for p in (PACKAGE / "ops").glob("*.py") if p.stem != "__init__")
LEAF_DEPENDENCIES = {"cookbook._checks", "cookbook.testing"}


@pytest.mark.parametrize("op", CONTRACTS)
def test_contracts_are_leaves(op):
    """A contract imports only the shared checks and agreement helpers and other contracts."""
    deps = import_graph()[f"cookbook.ops.{op}"]
    bad = {dep for dep in deps if dep not in LEAF_DEPENDENCIES and not dep.startswith("cookbook.ops")}
    assert not bad, f"cookbook.ops.{op} imports {bad}"


@pytest.mark.parametrize("op", CONTRACTS)
def test_each_contract_imports_alone(op):
    """Imported with the package's own __init__ (which loads the API) kept out of the way, a
    contract loads without the API, the registry or the build modules."""
    script = textwrap.dedent(f"""
        import sys, types
        package = types.ModuleType("cookbook")
        package.__path__ = [{str(PACKAGE)!r}]
        sys.modules["cookbook"] = package
        import cookbook.ops.{op}
        loaded = sorted(name for name in sys.modules if name.startswith("cookbook."))
        assert not {{"cookbook.api", "cookbook.registry", "cookbook.cuda"}} & set(loaded), loaded
        print("alone:", loaded)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]


# ---- builds ------------------------------------------------------------------------------------
def test_an_extension_is_one_kernel_file_split_by_dtype_and_rounding():
    ext = Extension("qk_norm", "qk_norm/v3_vectors_in_registers.cuh")
    assert (ext.name, ext.namespace) == ("qk_norm_v3", "cookbook::qk_norm::v3")
    units = ext.kernel_units()
    assert len(units) == 6 and all(name.endswith(".cu") for name in units)
    assert all(text.startswith('#include "qk_norm/v3_vectors_in_registers.cuh"') for text in units.values())
    assert "launch<cookbook::DType::kBFloat16, cookbook::Rounding::kHf>" in units["bfloat16_hf.cu"]
    assert ext.binding_unit() == ('#include "qk_norm/binding.h"\n'
                                  "COOKBOOK_QK_NORM_EXTENSION(qk_norm_v3, cookbook::qk_norm::v3)\n")


def test_an_extension_depends_on_what_it_includes_and_nothing_else():
    """The build key of a rung follows the files it includes (an edit there rebuilds it) and not
    the other rungs' (an edit of v6 does not rebuild v1)."""
    names = lambda ext: {p.relative_to(KERNEL_DIR).as_posix() for p in ext.dependencies()}  # noqa: E731
    v1 = names(Extension("qk_norm", "qk_norm/v1_thread_per_row.cuh"))
    v3 = names(Extension("qk_norm", "qk_norm/v3_vectors_in_registers.cuh"))
    assert {"include/common.cuh", "include/dtype.h", "qk_norm/rows.cuh", "qk_norm/binding.h"} <= v1
    assert "qk_norm/v2_warp_per_row.cuh" in v3 and "qk_norm/v2_warp_per_row.cuh" not in v1
    assert not any(name.startswith("qk_norm/v6") for name in v1 | v3)


HOLD_LOCK = """
import sys, time
from pathlib import Path
from cookbook import cuda
with cuda._build_lock(Path(sys.argv[1])):
    print("holding", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(directory: Path, seconds: float) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(directory), str(seconds)], stdout=subprocess.PIPE,
                             text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert child.stdout.readline().strip() == "holding"
    return child


def test_a_killed_builder_never_makes_the_next_build_wait(tmp_path):
    from cookbook import cuda

    directory = tmp_path / "qk_norm_tuned-0123"
    child = _holder(directory, 600)
    (directory / cuda.TORCH_BATON).write_text("")  # what a torch build killed half way leaves
    child.send_signal(signal.SIGKILL)
    child.wait()
    start = time.monotonic()
    with cuda._build_lock(directory):
        waited = time.monotonic() - start
        assert not (directory / cuda.TORCH_BATON).exists(), "the dead build's lock file is left in the way"
    assert waited < 2, f"waited {waited:.1f} s for a dead builder"


def test_a_live_builder_is_waited_for(tmp_path):
    from cookbook import cuda

    directory = tmp_path / "qk_norm_v3-4567"
    child = _holder(directory, 1.0)
    start = time.monotonic()
    with cuda._build_lock(directory):
        waited = time.monotonic() - start
    child.wait()
    assert waited > 0.5, "took the lock while another process was building"
