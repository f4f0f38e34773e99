"""The edge cases of docs/edge_cases.md on a GPU, for every CUDA C implementation (each rung and
tuned kernel of every op): NaN, Inf, float32's range and zero heads give the defined rows in
every dtype; shared memory, grad and inference tensors are refused on CUDA tensors with nothing
written, also under torch.compile (its opaque op checks the memory when the graph runs); and
compute-sanitizer finds no error on the edge rows.

Skipped on machines without a CUDA GPU (CI). Run it with tests/test_edge_cases.py, which runs the
same cases on the references and the Numba kernels (on the GPU there)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cookbook import api, registry
from cookbook.testing import agreement
from edge_cases import (acceptances, API, api_arguments, call_api, check_edge_rows, check_zero_heads, exact, NAMES,
                        OPS, PER_HEAD_OPS, rejections)
from helpers import assert_rejected_untouched, ON_GPU, require

pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
COMPILED = [pytest.param(op, impl, id=f"{op}-{impl.name}") for op in OPS
            for impl in registry.implementations(op, registry.COMPILED_LEVELS)]
PER_HEAD_COMPILED = [p for p in COMPILED if p.values[0] in PER_HEAD_OPS]


def require_one_process(impl):
    """tp_qk_norm's fused kernels (v2 on) exchange their sums through a process group's symmetric
    memory: they need two or more GPUs (tools/gpu_tp_run.sh); its cuda_v1 runs at one rank here."""
    require(impl)
    if impl.op == "tp_qk_norm" and api.is_fused(impl):
        pytest.skip(f"{impl.name}: the fused kernel needs a process group of 2+ GPUs")


def _cases(make_cases):
    return [pytest.param(op, *case, id=f"{op}-{case[0]}") for op in OPS for case in make_cases(op, device="cuda")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op,impl", COMPILED)
def test_edge_rows(op, impl, dtype):
    require_one_process(impl)
    check_edge_rows(op, impl, dtype, "cuda")


@pytest.mark.parametrize("heads", [(0, 2), (3, 0)], ids=["no_q_heads", "no_kv_heads"])
@pytest.mark.parametrize("op,impl", PER_HEAD_COMPILED)
def test_zero_heads(op, impl, heads):
    require_one_process(impl)
    check_zero_heads(op, impl, heads, "cuda")


@pytest.mark.parametrize("backend", ["cuda", "auto"])
@pytest.mark.parametrize("op,label,make,fragment", _cases(rejections))
def test_rejected_untouched(op, label, make, fragment, backend):
    assert_rejected_untouched(API[op], api_arguments(make()), ValueError, fragment, backend=backend)


@pytest.mark.parametrize("op,label,make,new_to_kernels", _cases(acceptances))
def test_accepted_and_right(op, label, make, new_to_kernels):
    args = make()
    expected = exact(op, args, 1e-6)
    call_api(op, args, "cuda", eps=1e-6)
    for name in (NAMES[op]["q"], NAMES[op]["k"]):
        check = agreement(name, args[name], expected[name], None, "fused", registry.contract(op).TOLERANCES[args[name].dtype])
        assert check.ok, check.message


@pytest.mark.parametrize("op", ["qk_norm", "cross_head_norm", "qk_norm_rope"])
def test_compiled_op_checks_memory_when_the_graph_runs(op):
    """Tracing cannot see addresses; the opaque op checks them when it runs, before any write."""
    label, make, fragment = next(case for case in rejections(op, device="cuda") if case[0] == "k is q")

    @torch.compile(fullgraph=True)
    def step(**kwargs):
        return API[op](**kwargs, backend="cuda")

    assert_rejected_untouched(step, api_arguments(make()), ValueError, fragment)


def _build_every_compiled_implementation():
    from cookbook import cuda

    impls = [impl for op in OPS for impl in registry.implementations(op, registry.COMPILED_LEVELS)]
    cuda.build([impl.extension for impl in impls if impl.extension is not None])
    for op in {impl.op for impl in impls if impl.extension is None}:
        cuda.load(op)


SANITIZED = """
import sys
sys.path.insert(0, {tests!r})
import torch
from cookbook import api, registry
import edge_cases as cases
for op in cases.OPS:
    for impl in registry.implementations(op, registry.COMPILED_LEVELS):
        if op == "tp_qk_norm" and api.is_fused(impl):
            continue  # needs a process group of 2+ GPUs
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            cases.check_edge_rows(op, impl, dtype, "cuda")
        if op in cases.PER_HEAD_OPS:
            for heads in ((0, 2), (3, 0)):
                cases.check_zero_heads(op, impl, heads, "cuda")
torch.cuda.synchronize()
print("sanitized run done")
"""


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not on PATH")
def test_compute_sanitizer_memcheck_on_the_edge_rows():
    _build_every_compiled_implementation()  # outside the sanitizer; the child reuses the cache
    script = SANITIZED.format(tests=str(Path(__file__).resolve().parent))
    run = subprocess.run(
        ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1", sys.executable, "-c", script],
        capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0 and "ERROR SUMMARY: 0 errors" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
