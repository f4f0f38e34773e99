"""In-place safety and numerics at the edges (docs/edge_cases.md), for every op: shared memory,
grad and inference tensors, and eps or weight_offset infinite in float32 are refused before
anything is written, on every backend; memory shared safely is accepted; NaN, Inf, float32's
range and zero heads give the defined rows on the references and the Numba kernels (every CUDA C
implementation: test_gpu_edge_cases.py). The exact memory-overlap test is checked against brute
force."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from cookbook import _checks as C
from cookbook import registry
from cookbook.testing import agreement
from edge_cases import (acceptances, API, api_arguments, call_api, check_edge_rows, check_zero_heads, EDGE_DTYPES,
                        exact, make_inputs, NAMES, OPS, PER_HEAD_OPS, rejections)
from helpers import assert_rejected_untouched, BACKENDS, DEVICE, require

LEVELS = ("reference", "numba")  # here; the CUDA C levels run in test_gpu_edge_cases.py
IMPLS = [pytest.param(op, impl, id=f"{op}-{impl.name}") for op in OPS for impl in registry.implementations(op, LEVELS)]
PER_HEAD_IMPLS = [p for p in IMPLS if p.values[0] in PER_HEAD_OPS]


def _cases(make_cases):
    return [pytest.param(op, *case, id=f"{op}-{case[0]}") for op in OPS for case in make_cases(op, device=DEVICE)]


# --------------------------------------------------------------------------------------------
# Refused, with nothing written
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,label,make,fragment", _cases(rejections))
def test_rejected_untouched(op, label, make, fragment, backend):
    assert_rejected_untouched(API[op], api_arguments(make()), ValueError, fragment, backend=backend)


# --------------------------------------------------------------------------------------------
# Memory shared safely, grad on read-only inputs, inference tensors in inference mode: accepted
# --------------------------------------------------------------------------------------------
ACCEPTED = [pytest.param(op, label, make, backend, id=f"{op}-{label}-{backend}") for op in OPS
            for label, make, new_to_kernels in acceptances(op, device=DEVICE)
            for backend in (LEVELS if new_to_kernels else ("reference",))]


@pytest.mark.parametrize("op,label,make,backend", ACCEPTED)
def test_accepted_and_right(op, label, make, backend):
    args = make()
    expected = exact(op, args, 1e-6)
    call_api(op, args, backend, eps=1e-6)
    for name in (NAMES[op]["q"], NAMES[op]["k"]):
        out = args[name]
        assert not out.requires_grad and out.grad_fn is None, f"{name} was recorded for autograd"
        check = agreement(name, out, expected[name], None, "fused", registry.contract(op).TOLERANCES[out.dtype])
        assert check.ok, check.message


@pytest.mark.parametrize("backend", LEVELS)
@pytest.mark.parametrize("op", OPS)
def test_inference_tensors_in_inference_mode(op, backend):
    with torch.inference_mode():
        args = make_inputs(op, torch.bfloat16, DEVICE, seed=7)
    expected = exact(op, args, 1e-6)
    with torch.inference_mode():
        call_api(op, args, backend, eps=1e-6)
    for name in (NAMES[op]["q"], NAMES[op]["k"]):
        check = agreement(name, args[name], expected[name], None, "fused", registry.contract(op).TOLERANCES[torch.bfloat16])
        assert check.ok, check.message


# --------------------------------------------------------------------------------------------
# Rows with a defined result: NaN and Inf, float32's range, zero heads
# --------------------------------------------------------------------------------------------
# Under the simulator NumPy warns where a float32 sum overflows or a NaN is met: the rows' point.
QUIET_NUMPY = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                         "ignore:invalid value encountered:RuntimeWarning")


@QUIET_NUMPY
@pytest.mark.parametrize("dtype", EDGE_DTYPES, ids=str)
@pytest.mark.parametrize("op,impl", IMPLS)
def test_edge_rows(op, impl, dtype):
    require(impl)
    check_edge_rows(op, impl, dtype, DEVICE)


@pytest.mark.parametrize("heads", [(0, 2), (3, 0)], ids=["no_q_heads", "no_kv_heads"])
@pytest.mark.parametrize("op,impl", PER_HEAD_IMPLS)
def test_zero_heads(op, impl, heads):
    require(impl)
    check_zero_heads(op, impl, heads, DEVICE)


def test_reference_rstd_defines_the_edges():
    """rstd: 0 only where mean(x^2) + eps == 0; NaN where it is NaN or +Inf; rsqrt elsewhere."""
    from cookbook.ops.qk_norm import rstd_of

    rstd = rstd_of(torch.tensor([0.0, 4.0, math.nan, math.inf]), 0.0)
    assert rstd[0] == 0 and rstd[1] == 0.5 and rstd[2:].isnan().all()
    assert rstd_of(torch.tensor([0.0, math.inf]), 0.25).tolist()[0] == 2.0 and rstd_of(torch.tensor([math.inf]), 0.25).isnan()


# --------------------------------------------------------------------------------------------
# eps and weight_offset as float32
# --------------------------------------------------------------------------------------------
def test_scalars_are_rounded_to_float32_as_the_kernels_take_them():
    rounds_to_inf = 2.0**128 - 2.0**103
    assert C.as_float32(rounds_to_inf) == math.inf and C.as_float32(-rounds_to_inf) == -math.inf
    assert C.as_float32(math.nextafter(rounds_to_inf, 0.0)) == C.FLOAT32_MAX
    for value in (1e-6, 1e-50, 0.1, -3.5, C.FLOAT32_MAX, 1e-45):
        assert C.as_float32(value) == torch.tensor(value, dtype=torch.float32).item()
    assert C.require_eps(1e-50) == 0.0 and C.require_eps(C.FLOAT32_MAX) == C.FLOAT32_MAX
    assert C.require_weight_offset(-C.FLOAT32_MAX) == -C.FLOAT32_MAX and C.require_weight_offset(0.1) == C.as_float32(0.1)
    for bad in (rounds_to_inf, 1e300, math.inf, math.nan, -1e-6):
        with pytest.raises(ValueError, match="eps: expected a finite float >= 0"):
            C.require_eps(bad)
    for bad in (-rounds_to_inf, 1e300, math.inf, math.nan):
        with pytest.raises(ValueError, match="weight_offset: expected a finite float"):
            C.require_weight_offset(bad)


def test_eps_at_float32_max_is_finite_everywhere():
    """The largest eps accepted still gives finite, tiny outputs (no inf reaches rsqrt)."""
    args = make_inputs("qk_norm", torch.float32, DEVICE)
    call_api("qk_norm", args, "reference", eps=C.FLOAT32_MAX)
    assert args["q"].isfinite().all() and args["q"].abs().max() < 1e-18


# --------------------------------------------------------------------------------------------
# The memory-overlap test: exact, against brute force
# --------------------------------------------------------------------------------------------
def _random_view(rng, buffer):
    dims = rng.randint(1, 4)
    shape = [rng.randint(1, 4) for _ in range(dims)]
    stride = [rng.choice([0, 1, 2, 3, 4, 6, 8, 12, 16, 33]) for _ in range(dims)]
    if rng.random() < 0.7:
        stride[-1] = 1
    source = buffer if rng.random() < 0.5 else buffer.view(torch.float32)
    return source.as_strided(shape, stride, rng.randint(0, 40))


def _element_bytes(t):
    """The byte addresses of each element of `t`, one range per element."""
    item = t.element_size()
    for index in itertools.product(*map(range, t.shape)):
        first = t.data_ptr() + item * sum(i * s for i, s in zip(index, t.stride()))
        yield range(first, first + item)


def test_overlap_is_exact_against_brute_force():
    rng = random.Random(0)
    buffer = torch.zeros(2048, dtype=torch.bfloat16)
    for _ in range(400):
        a, b = _random_view(rng, buffer), _random_view(rng, buffer)
        elements_a = list(_element_bytes(a))
        bytes_a, bytes_b = set().union(*elements_a), set().union(*_element_bytes(b))
        assert C.overlap(C.footprint(a), C.footprint(b)) == bool(bytes_a & bytes_b), (a.shape, a.stride(), b.shape, b.stride())
        itself = sum(map(len, elements_a)) != len(bytes_a)
        assert C.overlaps_itself(C.footprint(a)) == itself, (a.shape, a.stride())


def test_an_irregular_layout_is_refused_not_guessed(monkeypatch):
    """Past MAX_OVERLAP_CASES the check refuses (naming the argument) rather than assume disjoint."""
    monkeypatch.setattr(C, "MAX_OVERLAP_CASES", 3)
    buffer = torch.zeros(4096)
    q = buffer.as_strided((16, 1, 8), (40, 8, 1))  # token strides 40 and 41: many candidate pairs
    k = buffer.as_strided((16, 1, 8), (41, 8, 1), 8)
    w = torch.ones(8)
    with pytest.raises(ValueError, match="k: expected memory provably disjoint .* too irregular"):
        C.require_disjoint(dict(q=q, k=k), dict(q_weight=w, k_weight=w))


def test_meta_tensors_have_no_memory_to_check():
    """The bench sizes shapes on the meta device through check_inputs."""
    contract = registry.contract("qk_norm")
    meta = contract.make_inputs(4, 2, 1, 64, torch.bfloat16, "cpu")
    meta = {name: torch.empty_like(t, device="meta") for name, t in meta.items()}
    contract.check_inputs(**meta, eps=1e-6, weight_offset=0.0, rounding="fused")


@pytest.mark.parametrize("op", OPS)
def test_meta_tensors_are_refused_by_the_kernels_and_taken_by_the_reference(op):
    """Meta tensors have no data for a kernel to read: backend="numba" (even under the simulator)
    and "cuda" refuse them by name, like any device they cannot run on; the reference (and "auto",
    which picks it off CUDA) takes them, as shapes only. tp_qk_norm here at one rank; on gloo
    ranks: test_tp_qk_norm.py."""
    inputs = {name: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t
              for name, t in make_inputs(op, torch.bfloat16, "cpu").items()}
    for backend in ("numba", "cuda"):
        with pytest.raises(ValueError, match=rf"backend='{backend}': expected CUDA tensors.* got tensors on meta"):
            call_api(op, inputs, backend)
    assert registry.latest(op, "numba").unavailable("meta") is not None
    for backend in ("reference", "auto"):
        call_api(op, inputs, backend)
