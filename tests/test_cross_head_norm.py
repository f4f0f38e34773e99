"""cross_head_norm: every registered implementation agrees with the contract; wrong variants
(per-head statistics among them) are caught; bad inputs get a clear error and leave the tensors
untouched."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from numba import cuda
from hypothesis import strategies as st

import cookbook
import nvcc_jobs
from cookbook import explainer, nvcc_report
from cookbook.ops import cross_head_norm as contract
from cookbook.testing import agreement
from cross_head_norm_plans import BENCH_PLANS, EDGE_PLANS, choice_of_plan
from kernels_numba.helpers import block_sum
from helpers import assert_rejected_untouched, BACKENDS, bad_case, clone_inputs, DEVICE, kernel_impls, ON_GPU, require, run_and_compare

OP = "cross_head_norm"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# The simulator runs every GPU thread as a Python thread: tiny shapes there (hidden <= 256). On a
# GPU the widths around the CUDA C v3 per-CTA limits (4096, 8192, 16384, 32768 bf16 elements) and
# beyond, odd token counts 127 and 129; the CPU reference gets moderate widths (float64 oracle).
SIM_WIDTHS = [2, 32, 64, 96, 130, 256]
CPU_WIDTHS = [2, 96, 130, 1022, 1024, 2048, 4096, 4100]
GPU_WIDTHS = CPU_WIDTHS + [8192, 8200, 16384, 16392, 32768, 32776, 65536]
LAYOUTS = ("rows", "fused_qkv", "heads")


def simulated(impl):
    return impl.level == "numba" and not ON_GPU


def shape_strategy(impl):
    if simulated(impl):
        tokens, widths = st.sampled_from([1, 2, 3]), SIM_WIDTHS
    else:
        tokens, widths = st.sampled_from([1, 2, 127, 129]), GPU_WIDTHS if ON_GPU else CPU_WIDTHS
    return st.tuples(tokens, st.sampled_from(widths), st.sampled_from(widths))


def case_strategy():
    return st.fixed_dictionaries(
        dict(
            dtype=st.sampled_from(DTYPES),
            fp32_weight=st.booleans(),
            layout=st.sampled_from(LAYOUTS),
            kind=st.sampled_from(contract.INPUT_KINDS),
            rounding=st.sampled_from(["fused", "hf"]),
            weight_offset=st.sampled_from([0.0, 1.0]),
            eps=st.sampled_from([1e-6, 1e-5, 0.0]),
            seed=st.integers(0, 2**16),
        )
    )


def build(shape, case):
    tokens, q_hidden, k_hidden = shape
    # "heads": [T, heads, head_dim] views with packed heads; a head_dim that divides both widths.
    head_dim = math.gcd(q_hidden, k_hidden, 128) if case["layout"] == "heads" else None
    return contract.make_inputs(
        tokens, q_hidden, k_hidden, case["dtype"], DEVICE, seed=case["seed"], fused_qkv=case["layout"] == "fused_qkv",
        weight_dtype=torch.float32 if case["fp32_weight"] else None, kind=case["kind"], head_dim=head_dim,
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
def test_unequal_widths_and_zero_rows(impl, dtype):
    """q wider than k (GQA); all-zero rows give zeros with eps = 0, never NaN."""
    require(impl)
    inputs = contract.make_inputs(3, 128, 32, dtype, DEVICE, seed=1, kind="zero_rows", fused_qkv=True)
    run_and_compare(OP, impl, inputs, eps=0.0, weight_offset=0.0, rounding="fused")
    assert not inputs["q"].isnan().any() and not inputs["k"].isnan().any()


@pytest.mark.parametrize("impl", kernel_impls(OP))
def test_k_wider_than_q_packed_heads_hf(impl):
    """k wider than q, as packed-heads views of fused qkv, in the Hugging Face order with Gemma's offset."""
    require(impl)
    inputs = contract.make_inputs(2, 64, 192, torch.bfloat16, DEVICE, seed=2, fused_qkv=True, head_dim=32)
    assert inputs["q"].shape == (2, 2, 32) and inputs["k"].shape == (2, 6, 32)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=1.0, rounding="hf")


@pytest.mark.parametrize("impl", kernel_impls(OP))
def test_mixed_weight_dtypes(impl):
    """q_weight in float32, k_weight in the activation dtype: each weight is read as stored."""
    require(impl)
    inputs = contract.make_inputs(3, 96, 64, torch.float16, DEVICE, seed=3)
    inputs["q_weight"] = inputs["q_weight"].float()
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.0, rounding="hf")


@pytest.mark.parametrize("impl", kernel_impls(OP))
def test_misaligned_views(impl):
    """Legal views whose rows (and a weight) do not start on 16-byte boundaries take a slower path, correctly."""
    require(impl)
    tokens, q_hidden, k_hidden = 3, 128, 64
    width = q_hidden + 2 * k_hidden
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(tokens, width + 1, generator=gen).to(torch.bfloat16).to(DEVICE)
    qkv = base[:, 1:]  # one element (2 bytes) past every 16-byte boundary
    inputs = dict(
        q=qkv[:, :q_hidden],
        k=qkv[:, q_hidden : q_hidden + k_hidden],
        q_weight=(torch.rand(q_hidden + 1, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE)[1:],
        k_weight=(torch.rand(k_hidden, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE),
    )
    v_before = qkv[:, q_hidden + k_hidden :].clone()
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.0, rounding="fused")
    assert torch.equal(qkv[:, q_hidden + k_hidden :], v_before), "v (the rest of qkv) was modified"


def test_public_api_returns_the_same_tensors_and_leaves_v_alone():
    inputs = contract.make_inputs(4, 256, 64, torch.bfloat16, DEVICE, fused_qkv=True)
    qkv = inputs["q"]._base
    v_before = qkv[:, 256 + 64 :].clone()
    q, k = cookbook.cross_head_norm(**inputs)
    assert q is inputs["q"] and k is inputs["k"]
    assert torch.equal(qkv[:, 256 + 64 :], v_before)


def test_leading_token_dims_and_packed_heads():
    """`[batch, seq, hidden]` and `[batch, seq, heads, head_dim]` work like `[tokens, hidden]`."""
    inputs = contract.make_inputs(6, 128, 64, torch.float32, DEVICE, seed=3)
    flat = clone_inputs(inputs)
    cookbook.cross_head_norm(**flat, backend="reference")
    for q_shape, k_shape in (((2, 3, 128), (2, 3, 64)), ((2, 3, 4, 32), (2, 3, 2, 32)), ((2, 3, 128), (2, 3, 2, 32))):
        x = clone_inputs(inputs)
        q, k = x["q"].view(q_shape), x["k"].view(k_shape)
        cookbook.cross_head_norm(q, k, x["q_weight"], x["k_weight"], backend="reference")
        assert torch.equal(q.reshape(6, 128), flat["q"]) and torch.equal(k.reshape(6, 64), flat["k"])


def test_the_weight_length_names_the_row():
    """[T, H, D] with a [H*D] weight: one row per token; with a [D] weight: one row per head
    (then the token dims are [T, H], so q and k need as many heads)."""
    inputs = contract.make_inputs(4, 128, 128, torch.float32, DEVICE, seed=4, head_dim=32)
    across = clone_inputs(inputs)
    cookbook.cross_head_norm(**across, backend="reference")
    per_head = clone_inputs(inputs)
    q_w, k_w = per_head["q_weight"][:32].clone(), per_head["k_weight"][:32].clone()
    cookbook.cross_head_norm(per_head["q"], per_head["k"], q_w, k_w, backend="reference")
    want = contract.rms_norm_rows(inputs["q"], q_w, 1e-6, 0.0, "fused")
    assert torch.equal(per_head["q"], want)
    assert not torch.allclose(across["q"], per_head["q"]), "across heads and per head should differ"


def test_single_head_decode_shape():
    """A decode step's [batch, 1, hidden] next to [batch, heads, head_dim]: both readings are legal."""
    inputs = contract.make_inputs(3, 128, 64, torch.float32, DEVICE, seed=6)
    flat = clone_inputs(inputs)
    cookbook.cross_head_norm(**flat, backend="reference")
    q, k = inputs["q"].view(3, 1, 128), inputs["k"].view(3, 2, 32)
    cookbook.cross_head_norm(q, k, inputs["q_weight"], inputs["k_weight"], backend="reference")
    assert torch.equal(q.view(3, 128), flat["q"]) and torch.equal(k.view(3, 64), flat["k"])


# ------------------------------------------------------------------------------------------
# Negative controls: plausible wrong implementations the same checks must reject.
# Each takes (q, k, q_weight, k_weight, eps, weight_offset, rounding) and returns (q_out, k_out).
# ------------------------------------------------------------------------------------------
CONTROL_HEAD_DIM = 64


def _per_row(norm_rows):
    """A per-row function (x, w, ...) applied to q and k, named after it."""

    def both(q, k, q_w, k_w, eps, offset, rounding):
        return norm_rows(q, q_w, eps, offset, rounding), norm_rows(k, k_w, eps, offset, rounding)

    both.__name__ = norm_rows.__name__
    return both


def _wrong_per_head(q, k, q_w, k_w, eps, offset, rounding):
    """The qk_norm statistic: mean over each head of 64, not over the whole hidden."""

    def per_head(x, w):
        heads = x.unflatten(-1, (-1, CONTROL_HEAD_DIM)).float()
        rstd = torch.rsqrt(heads.square().mean(-1, keepdim=True) + eps)
        return (heads * rstd).flatten(-2).mul(w.float() + offset).to(x.dtype)

    return per_head(q, q_w), per_head(k, k_w)


@_per_row
def _wrong_eps_outside_sqrt(x, w, eps, offset, rounding):
    xf = x.float()
    return (xf / (xf.square().mean(-1, keepdim=True).sqrt() + eps) * (w.float() + offset)).to(x.dtype)


@_per_row
def _wrong_fp16_accumulator(x, w, eps, offset, rounding):
    xh = x.half()
    rstd = torch.rsqrt(xh.square().mean(-1, keepdim=True) + eps)
    return (xh * rstd).float().mul(w.float() + offset).to(x.dtype)


@_per_row
def _wrong_rounding_order(x, w, eps, offset, rounding):
    return contract.rms_norm_rows(x, w, eps, offset, "fused" if rounding == "hf" else "hf")


@_per_row
def _wrong_weight_offset_ignored(x, w, eps, offset, rounding):
    return contract.rms_norm_rows(x, w, eps, 0.0, rounding)


def _wrong_k_divided_by_q_hidden(q, k, q_w, k_w, eps, offset, rounding):
    """One `hidden` for both tensors (the q width): right only when q_hidden == k_hidden."""
    kf = k.float()
    rstd = torch.rsqrt(kf.square().sum(-1, keepdim=True) / q.shape[-1] + eps)
    return contract.rms_norm_rows(q, q_w, eps, offset, rounding), (kf * rstd * (k_w.float() + offset)).to(k.dtype)


def _wrong_one_statistic_for_q_and_k(q, k, q_w, k_w, eps, offset, rounding):
    """A single rstd over q and k concatenated (the fused-CTA bug: the two sums mixed up)."""
    both = torch.cat([q.float(), k.float()], dim=-1)
    rstd = torch.rsqrt(both.square().mean(-1, keepdim=True) + eps)
    return (q.float() * rstd * (q_w.float() + offset)).to(q.dtype), (k.float() * rstd * (k_w.float() + offset)).to(k.dtype)


WRONG = [
    _wrong_per_head, _wrong_eps_outside_sqrt, _wrong_fp16_accumulator, _wrong_rounding_order,
    _wrong_weight_offset_ignored, _wrong_k_divided_by_q_hidden, _wrong_one_statistic_for_q_and_k,
]
CONTROL_CASES = [
    (dtype, kind, rounding, offset)
    for dtype in (torch.float16, torch.bfloat16)
    for kind in ("normal", "tiny", "huge")
    for rounding in ("fused", "hf")
    for offset in (0.0, 1.0)
]


def _all_pass(norm):
    for dtype, kind, rounding, offset in CONTROL_CASES:
        inputs = contract.make_inputs(4, 512, 256, dtype, "cpu", seed=7, kind=kind)
        expected = contract.expected(inputs, 1e-6, offset, rounding)
        q, k, q_w, k_w = (inputs[name] for name in ("q", "k", "q_weight", "k_weight"))
        outputs = dict(zip(("q", "k"), norm(q, k, q_w, k_w, 1e-6, offset, rounding)))
        for name, actual in outputs.items():
            exact, rounded = expected[name]
            if not agreement(name, actual, exact, rounded, rounding, contract.TOLERANCES[dtype]).ok:
                return False
    return True


def test_reference_passes_the_control_cases():
    assert _all_pass(_per_row(contract.rms_norm_rows))


@pytest.mark.parametrize("wrong", WRONG, ids=lambda f: f.__name__.removeprefix("_wrong_"))
def test_wrong_variant_is_rejected(wrong):
    assert not _all_pass(wrong), f"{wrong.__name__} passed every check: the checks are too loose"


# ------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, and nothing written.
# ------------------------------------------------------------------------------------------
def _good(dtype=torch.bfloat16, device=DEVICE):
    return contract.make_inputs(2, 128, 64, dtype, device, seed=5)


def _bad_cases():
    with_ = functools.partial(bad_case, _good)

    def strided_last(a):
        q = a["q"]
        return torch.randn(q.shape[:-1] + (q.shape[-1] * 2,)).to(dtype=q.dtype, device=q.device)[..., ::2]

    def unpacked_heads(a):
        # [T, 2 heads, 64] whose heads are 128 elements apart: not one run of 128 elements.
        return torch.randn(2, 2, 128).to(dtype=a["q"].dtype, device=a["q"].device)[..., :64]

    def uncollapsible(a):
        return torch.ones(4, 2, 128, dtype=a["q"].dtype, device=a["q"].device).permute(1, 0, 2)

    def zeros(*shape):
        return lambda a: a["q"].new_zeros(*shape)

    return [
        ("q not a tensor", with_(q=lambda a: a["q"].tolist()), TypeError, "q: expected a torch.Tensor"),
        ("integer q", with_(q=lambda a: a["q"].to(torch.int32)), TypeError, "q: expected"),
        ("q of rank 1", with_(q=lambda a: a["q"][0]), ValueError, "at least 2 dims"),
        ("token mismatch", with_(k=lambda a: a["k"][:1]), ValueError, "k: expected the token dims of q"),
        ("dtype mismatch", with_(k=lambda a: a["k"].half()), TypeError, "k: expected the dtype of q"),
        ("weight shape", with_(q_weight=lambda a: a["q_weight"][:32]), ValueError, "q_weight: expected [q_hidden=128]"),
        ("weight dtype", with_(k_weight=lambda a: a["k_weight"].half()), TypeError, "k_weight: expected [k_hidden=64]"),
        ("weight rank", with_(q_weight=lambda a: a["q_weight"].view(1, 128)), ValueError, "q_weight"),
        ("weight not a tensor", with_(k_weight=1.0), TypeError, "k_weight: expected a torch.Tensor"),
        ("strided last dim", with_(q=strided_last), ValueError, "contiguous last dim"),
        ("heads not packed", with_(q=unpacked_heads), ValueError, "packed heads"),
        ("odd hidden", with_(q=lambda a: a["q"][..., :63], q_weight=lambda a: a["q_weight"][:63]), ValueError,
         "unsupported q_hidden=63"),
        ("hidden too big", with_(k=zeros(2, 65538), k_weight=zeros(65538)), ValueError, "unsupported k_hidden=65538"),
        ("negative eps", with_(eps=-1e-6), ValueError, "eps"),
        ("nan eps", with_(eps=float("nan")), ValueError, "eps"),
        ("eps not a number", with_(eps="1e-6"), TypeError, "eps"),
        ("bad rounding", with_(rounding="bf16"), ValueError, "rounding: expected one of"),
        ("bad weight_offset", with_(weight_offset=float("inf")), ValueError, "weight_offset"),
        ("uncollapsible token dims", with_(q=uncollapsible, k=lambda a: a["k"].new_ones(2, 4, 64)), ValueError, "collapse"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label,make,error,fragment", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_is_rejected_untouched(backend, label, make, error, fragment):
    assert_rejected_untouched(cookbook.cross_head_norm, make(), error, fragment, backend=backend)


def test_bad_backend_name():
    assert_rejected_untouched(cookbook.cross_head_norm, _good(), ValueError, "backend: expected one of", backend="triton")


def test_bench_layouts():
    """A bench shape's q and k are views of one fused qkv tensor, or two contiguous tensors where
    the shape's fourth element is SEPARATE; any other fourth element is an error naming the shape."""
    fused, label = contract.bench_case((3, 64, 32), torch.float32, "cpu")
    assert fused["q"].untyped_storage().data_ptr() == fused["k"].untyped_storage().data_ptr()
    assert label == "T=3 q_hidden=64 k_hidden=32"
    separate, label = contract.bench_case((3, 64, 32, contract.SEPARATE), torch.float32, "cpu")
    assert separate["q"].is_contiguous() and separate["k"].is_contiguous()
    assert separate["q"].untyped_storage().data_ptr() != separate["k"].untyped_storage().data_ptr()
    assert label == f"T=3 q_hidden=64 k_hidden=32 {contract.SEPARATE}"
    with pytest.raises(ValueError, match=r"shape: expected \(tokens, q_hidden, k_hidden\[, 'separate'\]\), got \(3, 64, 32, 'fused'\)"):
        contract.bench_case((3, 64, 32, "fused"), torch.float32, "cpu")


@pytest.mark.skipif(ON_GPU, reason="checks the CPU-tensor error of the CUDA backend")
def test_cpu_tensors_with_cuda_backend():
    fragment = "backend='cuda': expected CUDA tensors, got tensors on cpu"
    assert_rejected_untouched(cookbook.cross_head_norm, _good(), ValueError, fragment, backend="cuda")


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: mixes CUDA and CPU tensors")
def test_device_mismatch():
    args = _good()
    args["k"] = args["k"].cpu()
    assert_rejected_untouched(cookbook.cross_head_norm, args, ValueError, "k: expected the device of q")



# ------------------------------------------------------------------------------------------
# The Numba block_sum helper this op introduced (simulator on a CPU, shuffles on a GPU).
# ------------------------------------------------------------------------------------------
@cuda.jit
def _block_sums_kernel(v, sums, doubled):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    sums[i] = block_sum(v[i])
    doubled[i] = block_sum(2 * v[i])  # a second call right after: its scratch must not race the first's


@pytest.mark.parametrize("threads", [32, 96, 256])
def test_numba_block_sum_gives_every_thread_the_blocks_sum(threads):
    blocks = 3
    v = (np.arange(blocks * threads, dtype=np.float32) % 17) ** 2  # small integers: every order sums exactly
    sums, doubled = np.zeros_like(v), np.zeros_like(v)
    _block_sums_kernel[blocks, threads](v, sums, doubled)
    want = np.repeat(v.reshape(blocks, threads).sum(axis=1), threads)
    np.testing.assert_array_equal(sums, want)
    np.testing.assert_array_equal(doubled, 2 * want)


# ------------------------------------------------------------------------------------------
# The tuned kernel's policy (kernels_cuda/cross_head_norm/policy.h), compiled for the host and
# asked for an H100 (132 SMs; the kernels' registers from nvcc's report): its choices at every
# bench shape and at its edges, without a GPU. tests/test_gpu_cross_head_norm.py checks the same
# choices through the kernels the GPU launches, and that the GPU's answer is this one.
# ------------------------------------------------------------------------------------------
needs_nvcc = pytest.mark.skipif(nvcc_report.nvcc() is None, reason="nvcc not on PATH")
TUNED_EXTENSION = "cross_head_norm_tuned"


def plan(shape, dtype=torch.bfloat16, layout="fused_qkv", **kwargs):
    nvcc_jobs.result(nvcc_report.compile_extension, TUNED_EXTENSION)  # the report the answer reads
    return explainer.explain(OP, shape=shape, dtype=dtype, layout=layout, gpu=kwargs.pop("gpu", "h100"), **kwargs).plan


def test_bench_plans_cover_the_bench_shapes():
    assert set(BENCH_PLANS) == set(map(tuple, contract.BENCH_SHAPES))


@needs_nvcc
@pytest.mark.nvcc("compile_extension", TUNED_EXTENSION)
@pytest.mark.parametrize("shape", contract.BENCH_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_policy_at_the_bench_shapes(shape):
    t, q_hidden, k_hidden, *layout = shape
    p = plan((t, q_hidden, k_hidden), layout="separate" if layout else "fused_qkv")
    assert choice_of_plan(p) == BENCH_PLANS[tuple(shape)], p
    assert int(p["rows"]) == 2 * t
    if p["path"] == "cta_per_row_from_a_wave":  # the warm budget: 2 MiB of rows, none past 192 MiB moved
        assert (int(p["warm_first_ctas"]) > 0) == (int(p["call_bytes"]) <= 192 << 20)
        assert (int(p["rows_ahead"]) > 0) == (p["template_arguments"].endswith("kWarm=Warm::kFirstRowsAndNextWave, kBlockThreads=0"))


@needs_nvcc
@pytest.mark.nvcc("compile_extension", TUNED_EXTENSION)
@pytest.mark.parametrize("shape, dtype, layout, expected", EDGE_PLANS,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) and isinstance(v[0], int) else str(v).removeprefix("torch."))
def test_policy_edges(shape, dtype, layout, expected):
    assert choice_of_plan(plan(shape, dtype, layout)) == expected


@needs_nvcc
@pytest.mark.nvcc("compile_extension", TUNED_EXTENSION)
def test_policy_takes_the_strided_kernel_off_16_byte_rows_and_weights():
    nvcc_jobs.result(nvcc_report.compile_extension, TUNED_EXTENSION)
    qkv = torch.empty(64, 1 + 4096 + 2 * 1024, dtype=torch.bfloat16, device="meta")
    q, k = qkv[:, 1: 1 + 4096], qkv[:, 1 + 4096: 1 + 4096 + 1024]
    w_q, w_k = torch.empty(4096, dtype=torch.bfloat16, device="meta"), torch.empty(1024, dtype=torch.bfloat16, device="meta")
    assert explainer.explain(OP, q, k, w_q, w_k, gpu="h100").plan["path"] == "strided"
    buffer = torch.empty(4097, dtype=torch.float32, device="meta")
    q, k = torch.empty(64, 4096, dtype=torch.bfloat16, device="meta"), torch.empty(64, 1024, dtype=torch.bfloat16, device="meta")
    assert explainer.explain(OP, q, k, buffer[1:], w_k, gpu="h100").plan["path"] == "strided"


@needs_nvcc
@pytest.mark.nvcc("compile_extension", TUNED_EXTENSION)
def test_policy_without_bulk_copies_strides_the_widest_rows():
    """A GPU before sm_90 has no bulk-copy engine: the rows past the registers run rung 2's kernel."""
    nvcc_jobs.result(nvcc_report.compile_extension, TUNED_EXTENSION)
    ampere = explainer.Gpu("an sm_80 GPU", sms=108, major=8, shared_bytes_per_sm=164 * 1024,
                           shared_bytes_per_block_optin=163 * 1024)
    assert plan((3, 65536, 8), gpu=ampere)["path"] == "strided"
    assert plan((3, 65536, 8))["path"] == "staged_row"


@needs_nvcc
@pytest.mark.nvcc("compile_extension", TUNED_EXTENSION)
@given(tokens=st.integers(0, 40000), q_hidden=st.integers(1, 2048).map(lambda n: 32 * n),
       k_hidden=st.integers(1, 2048).map(lambda n: 32 * n), dtype=st.sampled_from(DTYPES),
       layout=st.sampled_from(["fused_qkv", "separate"]), sms=st.sampled_from([None, 66, 114]))
def test_every_plan_names_a_compiled_kernel(tokens, q_hidden, k_hidden, dtype, layout, sms):
    """Any call the policy may see: the kernel it plans is one the tuned extension compiles (the host
    program fails on a kernel nvcc's report lacks), with a grid that covers the call."""
    p = plan((tokens, q_hidden, k_hidden), dtype, layout, sms=sms, gpu=None if sms else "h100")
    rows = int(p["rows"])
    assert rows == 2 * tokens
    if rows:
        assert int(p["registers"]) > 0
        rows_per_cta = 2 * int(p["block"]) // 32 if p["path"] == "warp_per_token" else 1  # a warp: a token's two rows
        assert int(p["grid"]) * rows_per_cta >= rows
