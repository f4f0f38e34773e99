"""`help(cookbook.<op>)` answers a newcomer's first questions: the sizes each op takes (its
contract's limits), that the weights are contiguous, what backend="auto" runs where (the fallbacks
`registry.resolve` really takes), and Examples that run as shown on a CPU (doctest)."""

from __future__ import annotations

import doctest
import re

import pytest

import cookbook
import kernels_numba
from cookbook import cuda, registry
from cookbook.ops import cross_head_norm, qk_norm, qk_norm_rope, tp_qk_norm

OPS = [cookbook.qk_norm, cookbook.cross_head_norm, cookbook.qk_norm_rope, cookbook.tp_qk_norm]
# What each op's docstring states: the sizes its contract takes, and the weights' layout.
STATED = {
    "qk_norm": [f"head_dim even, from 2 to {qk_norm.MAX_HEAD_DIM}", "q_weight, k_weight: ``[head_dim]``, contiguous"],
    "cross_head_norm": [f"q_hidden even, from 2 to {cross_head_norm.MAX_HIDDEN}",
                        "q_weight, k_weight: ``[q_hidden]`` and ``[k_hidden]``, contiguous"],
    "qk_norm_rope": [f"head_dim even, from 2 to {qk_norm_rope.MAX_HEAD_DIM}", "the weights ``[head_dim]``, contiguous",
                     "cos_sin_cache: ``[max_position, rope_dim]``, contiguous"],
    "tp_qk_norm": [f"the shard width even, from 2 to {tp_qk_norm.MAX_SHARD_WIDTH}",
                   "``[q_shard_width]`` and ``[k_shard_width]``, contiguous"],
}
NO_NVCC = "nvcc (the CUDA toolkit) was not found: set CUDA_HOME"


def _flat(doc: str) -> str:
    return re.sub(r"\s+", " ", doc)


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.__name__)
def test_the_docstring_states_sizes_weights_and_backends(op):
    doc = _flat(op.__doc__)
    for fact in STATED[op.__name__]:
        assert fact in doc, f"{op.__name__}: does not state {fact!r}"
    assert 'backend: "auto" (default)' in doc and "Examples: " in doc


@pytest.mark.parametrize("op", OPS[:3], ids=lambda op: op.__name__)
def test_auto_without_nvcc_is_the_numba_kernel_on_a_gpu_as_stated(op, monkeypatch):
    assert "on a GPU machine without nvcc (no CUDA toolkit found: set CUDA_HOME), the last Numba kernel" in _flat(op.__doc__)
    monkeypatch.setattr(cuda, "unavailable", lambda: NO_NVCC)
    monkeypatch.setattr(kernels_numba, "simulator", lambda: False)  # a real GPU's Numba
    assert registry.resolve(op.__name__, "auto", "cuda") is registry.latest(op.__name__, "numba")
    monkeypatch.setattr(kernels_numba, "simulator", lambda: True)  # Numba cannot take CUDA tensors either
    monkeypatch.setattr(cuda, "unavailable", lambda: f"{NO_NVCC} ({op.__name__})")  # a fresh warning
    with pytest.warns(RuntimeWarning, match="falls back to the PyTorch reference"):
        assert registry.resolve(op.__name__, "auto", "cuda") is registry.latest(op.__name__, "reference")


def test_the_collective_auto_needs_nvcc_as_stated(monkeypatch):
    assert "they need nvcc, with no Numba fallback" in _flat(cookbook.tp_qk_norm.__doc__)
    monkeypatch.setattr(cuda, "unavailable", lambda: NO_NVCC)
    with pytest.raises(RuntimeError, match="nvcc"):
        registry.resolve("tp_qk_norm", "cuda", "cuda")  # what resolve_tp asks for "auto" on CUDA tensors


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.__name__)
def test_the_examples_run_on_a_cpu(op):
    runner = doctest.DocTestRunner()
    tests = [test for test in doctest.DocTestFinder().find(op, op.__name__, globs={}) if test.examples]
    assert tests, f"{op.__name__}: no examples"
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
