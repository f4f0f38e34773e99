"""qk_norm: every registered implementation agrees with the contract; wrong variants are caught;
bad inputs get a clear error and leave the tensors untouched."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cookbook
from cookbook.ops import qk_norm as contract
from cookbook.testing import agreement
from helpers import (assert_rejected_untouched, BACKENDS, bad_case, clone_inputs, DEVICE, fields, kernel_impls, ON_GPU, require,
                     run_and_compare)

OP = "qk_norm"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# The simulator runs every GPU thread as a Python thread: tiny shapes there. On a GPU (and for
# the reference) the odd sizes that catch tail bugs: 1, 127, 129 tokens; fast and general dims.
FAST_HEAD_DIMS = [64, 128, 256, 512, 1024]
GENERAL_HEAD_DIMS = [2, 96, 80, 130, 1022]


def shape_strategy(impl):
    simulated = impl.level == "numba" and not ON_GPU
    tokens = st.sampled_from([1, 2, 3] if simulated else [1, 2, 127, 129])
    heads = st.integers(1, 3 if simulated else 9)
    head_dim = st.sampled_from([2, 32, 64, 96] if simulated else FAST_HEAD_DIMS + GENERAL_HEAD_DIMS)
    return st.tuples(tokens, heads, heads, head_dim)


def case_strategy():
    return st.fixed_dictionaries(
        dict(
            dtype=st.sampled_from(DTYPES),
            fp32_weight=st.booleans(),
            fused_qkv=st.booleans(),
            kind=st.sampled_from(contract.INPUT_KINDS),
            rounding=st.sampled_from(["fused", "hf"]),
            weight_offset=st.sampled_from([0.0, 1.0]),
            eps=st.sampled_from([1e-6, 1e-5, 0.0]),
            seed=st.integers(0, 2**16),
        )
    )


def build(shape, case):
    tokens, hq, hk, head_dim = shape
    return contract.make_inputs(
        tokens, hq, hk, head_dim, case["dtype"], DEVICE, seed=case["seed"], fused_qkv=case["fused_qkv"],
        weight_dtype=torch.float32 if case["fp32_weight"] else None, kind=case["kind"],
    )


@pytest.mark.parametrize("impl", kernel_impls(OP))
def test_agrees_with_contract(impl):
    require(impl)

    @given(shape=shape_strategy(impl), case=case_strategy())
    def check(shape, case):
        inputs = build(shape, case)
        run_and_compare(OP, impl, inputs, eps=case["eps"], weight_offset=case["weight_offset"], rounding=case["rounding"])

    check()


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_heads_one_and_zero_rows(impl, dtype):
    """GQA down to one kv head; all-zero rows give zeros (eps > 0 and eps = 0), never NaN."""
    require(impl)
    inputs = contract.make_inputs(3, 4, 1, 64, dtype, DEVICE, seed=1, kind="zero_rows", fused_qkv=True)
    run_and_compare(OP, impl, inputs, eps=0.0, weight_offset=0.0, rounding="fused")
    assert not inputs["q"].isnan().any() and not inputs["k"].isnan().any()


@pytest.mark.parametrize("impl", kernel_impls(OP))
def test_misaligned_views(impl):
    """Legal views whose rows do not start on 16-byte boundaries take a slower path, correctly."""
    require(impl)
    tokens, hq, hk, head_dim = 3, 2, 1, 64
    width = (hq + 2 * hk) * head_dim
    base = torch.randn(tokens, width + 1, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(DEVICE)
    qkv = base[:, 1:]  # one element (2 bytes) past every 16-byte boundary
    inputs = dict(
        q=qkv[:, : hq * head_dim].view(tokens, hq, head_dim),
        k=qkv[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim),
        q_weight=torch.rand(head_dim, device=DEVICE, dtype=torch.bfloat16) + 0.5,
        k_weight=torch.rand(head_dim, device=DEVICE, dtype=torch.bfloat16) + 0.5,
    )
    v_before = qkv[:, (hq + hk) * head_dim :].clone()
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.0, rounding="fused")
    assert torch.equal(qkv[:, (hq + hk) * head_dim :], v_before), "v (the rest of qkv) was modified"


def test_public_api_returns_the_same_tensors_and_leaves_v_alone():
    inputs = contract.make_inputs(4, 2, 1, 128, torch.bfloat16, DEVICE, fused_qkv=True)
    qkv = inputs["q"]._base if inputs["q"]._base is not None else inputs["q"]
    v_before = qkv[:, 3 * 128 :].clone()
    q, k = cookbook.qk_norm(**inputs)
    assert q is inputs["q"] and k is inputs["k"]
    assert torch.equal(qkv[:, 3 * 128 :], v_before)


def test_leading_token_dims():
    """`[batch, seq, heads, head_dim]` works like `[tokens, heads, head_dim]`."""
    inputs = contract.make_inputs(6, 2, 1, 64, torch.float32, DEVICE, seed=3)
    flat = clone_inputs(inputs)
    cookbook.qk_norm(flat["q"], flat["k"], flat["q_weight"], flat["k_weight"], backend="reference")
    q4, k4 = inputs["q"].view(2, 3, 2, 64), inputs["k"].view(2, 3, 1, 64)
    cookbook.qk_norm(q4, k4, inputs["q_weight"], inputs["k_weight"], backend="reference")
    assert torch.equal(q4.view(6, 2, 64), flat["q"]) and torch.equal(k4.view(6, 1, 64), flat["k"])


# ------------------------------------------------------------------------------------------
# Negative controls: plausible wrong implementations the same checks must reject.
# ------------------------------------------------------------------------------------------
def _wrong_eps_outside_sqrt(x, w, eps, weight_offset, rounding):
    xf = x.float()
    rstd = 1.0 / (xf.square().mean(-1, keepdim=True).sqrt() + eps)
    return (xf * rstd * (w.float() + weight_offset)).to(x.dtype)


def _wrong_fp16_accumulator(x, w, eps, weight_offset, rounding):
    xh = x.half()
    rstd = torch.rsqrt(xh.square().mean(-1, keepdim=True) + eps)
    return (xh * rstd).float().mul(w.float() + weight_offset).to(x.dtype)


def _wrong_axis(x, w, eps, weight_offset, rounding):
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-2, keepdim=True) + eps)  # over heads, not head_dim
    return (xf * rstd * (w.float() + weight_offset)).to(x.dtype)


def _wrong_rounding_order(x, w, eps, weight_offset, rounding):
    swapped = "fused" if rounding == "hf" else "hf"
    return contract.rms_norm_rows(x, w, eps, weight_offset, swapped)


def _wrong_weight_offset_ignored(x, w, eps, weight_offset, rounding):
    return contract.rms_norm_rows(x, w, eps, 0.0, rounding)


WRONG = [_wrong_eps_outside_sqrt, _wrong_fp16_accumulator, _wrong_axis, _wrong_rounding_order, _wrong_weight_offset_ignored]
# The cases the property test draws from, fixed here so every wrong variant meets them all.
CONTROL_CASES = [
    (dtype, kind, rounding, offset)
    for dtype in (torch.float16, torch.bfloat16)
    for kind in ("normal", "tiny", "huge")
    for rounding in ("fused", "hf")
    for offset in (0.0, 1.0)
]


def _all_pass(norm_rows):
    for dtype, kind, rounding, offset in CONTROL_CASES:
        inputs = contract.make_inputs(4, 4, 2, 128, dtype, "cpu", seed=7, kind=kind)
        expected = contract.expected(inputs, 1e-6, offset, rounding)
        for name, w in (("q", inputs["q_weight"]), ("k", inputs["k_weight"])):
            actual = norm_rows(inputs[name], w, 1e-6, offset, rounding)
            exact, rounded = expected[name]
            if not agreement(name, actual, exact, rounded, rounding, contract.TOLERANCES[dtype]).ok:
                return False
    return True


def test_reference_passes_the_control_cases():
    assert _all_pass(contract.rms_norm_rows)


@pytest.mark.parametrize("wrong", WRONG, ids=lambda f: f.__name__.removeprefix("_wrong_"))
def test_wrong_variant_is_rejected(wrong):
    assert not _all_pass(wrong), f"{wrong.__name__} passed every check: the checks are too loose"


# ------------------------------------------------------------------------------------------
# eps where it matters. The random examples above rarely leave the range where eps is
# negligible (rows of rms ~1 against eps <= 1e-5), so an eps ignored, added outside the square
# root, or divided by head_dim would pass them. These rows put mean(x^2) near eps and far below
# it; the mutated kernels below prove they catch each of the three.
# ------------------------------------------------------------------------------------------
EPS_CASES = [  # (eps, the rows' rms values): mean(x^2) = rms^2 against eps
    (1e-2, (1e-4, 3e-2, 0.1, 0.3)),  # eps dominant, then comparable with mean(x^2)
    (1e-6, (1e-30, 1e-4, 1e-3, 3e-3)),  # the default eps against rows of small rms (squares of 1e-30 underflow)
]


def _eps_rows(rms_values, dtype, seed):
    """make_inputs' q and k (2 tokens, 2 q heads, 1 kv head, head_dim 64), each row rescaled to
    the next of `rms_values` in turn."""
    inputs = contract.make_inputs(2, 2, 1, 64, dtype, DEVICE, seed=seed)
    for name in ("q", "k"):
        rows = inputs[name].view(-1, 64).double()
        scale = torch.tensor([rms_values[i % len(rms_values)] for i in range(rows.shape[0])], dtype=torch.float64)
        inputs[name].view(-1, 64).copy_(rows / rows.square().mean(-1, keepdim=True).sqrt() * scale[:, None])
    return inputs


def eps_rows_agree(impl, dtype=torch.bfloat16):
    """Whether `impl` matches the contract on every EPS_CASES row (bf16: numba_v3's word kernel)."""
    for seed, (eps, rms_values) in enumerate(EPS_CASES):
        inputs = _eps_rows(rms_values, dtype, seed)
        expected = contract.expected(clone_inputs(inputs), eps, 0.0, "fused")
        impl.fn(*fields(contract.check_inputs(**inputs, eps=eps, weight_offset=0.0, rounding="fused")))
        for name, (exact, _) in expected.items():
            if not agreement(name, inputs[name], exact, None, "fused", contract.TOLERANCES[dtype]).ok:
                return False
    return True


@pytest.mark.parametrize("impl", kernel_impls(OP))
def test_eps_where_it_matters(impl):
    require(impl)
    assert eps_rows_agree(impl), f"{impl.name} is wrong where eps matters"


def _mutated_rstd(mutation, head_dim=64):
    """(rstd_from, rstd_from_mean) with a plausible eps bug, as Numba device functions."""
    from numba import cuda

    from kernels_numba.helpers import rsqrt

    if mutation == "eps_ignored":
        @cuda.jit(device=True)
        def rstd_from_mean(mean_sq, eps):
            return rsqrt(mean_sq) if mean_sq > 0 else np.float32(0.0)
    elif mutation == "eps_outside_sqrt":
        @cuda.jit(device=True)
        def rstd_from_mean(mean_sq, eps):
            return np.float32(1.0) / (np.float32(math.sqrt(mean_sq)) + eps)
    else:  # "eps_over_head_dim": eps added to the sum of squares, then divided with it
        @cuda.jit(device=True)
        def rstd_from_mean(mean_sq, eps):
            return rsqrt(mean_sq + eps / np.float32(head_dim))

    @cuda.jit(device=True)
    def rstd_from(sum_sq, width, eps):
        return rstd_from_mean(sum_sq / width, eps)

    return rstd_from, rstd_from_mean


@pytest.fixture
def fresh_numba_kernels():
    """The qk_norm Numba kernels rebuilt before and after the test (they bind their helpers when built)."""
    from kernels_numba import qk_norm as kernels

    factories = (kernels.make_qk_norm_kernel, kernels.make_qk_norm_kernel_v2, kernels.make_qk_norm_kernel_v3)
    for factory in factories:
        factory.cache_clear()
    yield kernels
    for factory in factories:
        factory.cache_clear()


@pytest.mark.parametrize("mutation", ["eps_ignored", "eps_outside_sqrt", "eps_over_head_dim"])
@pytest.mark.parametrize("impl", [p for p in kernel_impls(OP) if p.values[0].level == "numba"])
def test_eps_mutant_of_numba_kernel_is_rejected(impl, mutation, fresh_numba_kernels, monkeypatch):
    """A deliberately wrong eps in the Numba kernels' rstd fails the rows above."""
    require(impl)
    rstd_from, rstd_from_mean = _mutated_rstd(mutation)
    monkeypatch.setattr(fresh_numba_kernels, "rstd_from", rstd_from)
    monkeypatch.setattr(fresh_numba_kernels, "rstd_from_mean", rstd_from_mean)
    assert not eps_rows_agree(impl), f"{impl.name} with {mutation} passed: the eps rows are too loose"


# ------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, and nothing written.
# ------------------------------------------------------------------------------------------
def _good(dtype=torch.bfloat16, device=DEVICE):
    return contract.make_inputs(2, 4, 2, 64, dtype, device, seed=5)


def _bad_cases():
    with_ = functools.partial(bad_case, _good)

    def strided_last(a):
        q = a["q"]
        return torch.randn(q.shape[:-1] + (q.shape[-1] * 2,)).to(dtype=q.dtype, device=q.device)[..., ::2]

    def uncollapsible(a):
        return torch.ones(4, 2, 4, 64, dtype=a["q"].dtype, device=a["q"].device).permute(1, 0, 2, 3)

    return [
        ("q not a tensor", with_(q=lambda a: a["q"].tolist()), TypeError, "q: expected a torch.Tensor"),
        ("integer q", with_(q=lambda a: a["q"].to(torch.int32)), TypeError, "q: expected"),
        ("q of rank 1", with_(q=lambda a: a["q"][0, 0]), ValueError, "at least 2 dims"),
        # a flattened [tokens, heads * head_dim] q or k is one token of one long head: the error says so
        ("flattened q", with_(q=lambda a: a["q"].reshape(2, 256)), ValueError,
         "q: read as 2-D [num_q_heads=2, head_dim=256] (one token, no token dims), but q_weight has head_dim=64; "
         "expected [tokens..., num_q_heads, head_dim=64]: view a flattened [tokens, num_q_heads * head_dim] q as "
         "q.view(2, 4, 64)"),
        ("flattened q and k", with_(q=lambda a: a["q"].reshape(2, 256), k=lambda a: a["k"].reshape(2, 128)), ValueError,
         "q: read as 2-D [num_q_heads=2, head_dim=256]"),
        ("flattened k", with_(k=lambda a: a["k"].reshape(2, 128)), ValueError,
         "k: read as 2-D [num_kv_heads=2, head_dim=128] (one token, no token dims), but k_weight has head_dim=64; "
         "expected [tokens..., num_kv_heads, head_dim=64]: view a flattened [tokens, num_kv_heads * head_dim] k as "
         "k.view(2, 2, 64)"),
        ("head_dim mismatch", with_(k=lambda a: a["k"][..., :32]), ValueError, "k: expected [tokens..., num_kv_heads, head_dim=64]"),
        ("token mismatch", with_(k=lambda a: a["k"][:1]), ValueError, "k: expected the token dims of q"),
        ("dtype mismatch", with_(k=lambda a: a["k"].half()), TypeError, "k: expected the dtype of q"),
        ("weight shape", with_(q_weight=lambda a: a["q_weight"][:32]), ValueError, "q_weight: expected [head_dim=64]"),
        ("weight dtype", with_(k_weight=lambda a: a["k_weight"].half()), TypeError, "k_weight: expected [head_dim=64]"),
        ("weight rank", with_(q_weight=lambda a: a["q_weight"].view(1, 64)), ValueError, "q_weight"),
        ("strided last dim", with_(q=strided_last), ValueError, "contiguous last dim"),
        ("odd head_dim", with_(q=lambda a: a["q"][..., :63], k=lambda a: a["k"][..., :63]), ValueError, "unsupported head_dim=63"),
        ("head_dim too big", with_(q=lambda a: a["q"].new_zeros(2, 1, 1026), k=lambda a: a["k"].new_zeros(2, 1, 1026)), ValueError, "unsupported head_dim=1026"),
        ("negative eps", with_(eps=-1e-6), ValueError, "eps"),
        ("nan eps", with_(eps=float("nan")), ValueError, "eps"),
        ("eps not a number", with_(eps="1e-6"), TypeError, "eps"),
        ("bad rounding", with_(rounding="bf16"), ValueError, "rounding: expected one of"),
        ("bad weight_offset", with_(weight_offset=float("inf")), ValueError, "weight_offset"),
        ("uncollapsible token dims", with_(q=uncollapsible, k=lambda a: a["k"].new_ones(2, 4, 2, 64)), ValueError, "collapse"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label,make,error,fragment", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_is_rejected_untouched(backend, label, make, error, fragment):
    assert_rejected_untouched(cookbook.qk_norm, make(), error, fragment, backend=backend)


def test_bad_backend_name():
    assert_rejected_untouched(cookbook.qk_norm, _good(), ValueError, "backend: expected one of", backend="triton")


@pytest.mark.skipif(ON_GPU, reason="checks the CPU-tensor error of the CUDA backend")
def test_cpu_tensors_with_cuda_backend():
    fragment = "backend='cuda': expected CUDA tensors, got tensors on cpu"
    assert_rejected_untouched(cookbook.qk_norm, _good(), ValueError, fragment, backend="cuda")


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: mixes CUDA and CPU tensors")
def test_device_mismatch():
    args = _good()
    args["k"] = args["k"].cpu()
    assert_rejected_untouched(cookbook.qk_norm, args, ValueError, "k: expected the device of q")

