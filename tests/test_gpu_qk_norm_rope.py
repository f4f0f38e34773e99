"""qk_norm_rope on a real GPU: every rung and the tuned kernel at odd and structured shapes, both
rope layouts, partial rotary, every table storage and alignment (the reference and Numba at scale
too; tests/test_qk_norm_rope.py checks them at every edge); the tuned kernel's policy (the kernel
a call launches is the one its plan names, at the policy's edges); torch.compile, CUDA graphs,
opcheck, 64-bit strides, compute-sanitizer.

Skipped on machines without a CUDA GPU (CI); run on an H100/H200."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

import cookbook
from cookbook import registry
from cookbook.ops import qk_norm_rope as contract
from cookbook.testing import agreement
from helpers import ON_GPU, clone_inputs, kernel_impls, launched_kernels, require, run_and_compare

pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
OP = "qk_norm_rope"
COMPILED = [pytest.param(impl, id=impl.name) for impl in registry.implementations(OP, registry.COMPILED_LEVELS)]

# (tokens, q heads, kv heads, head_dim, rope_dim, is_neox): FLUX (both layouts), Qwen-Image's partial
# rope, decode with GQA, a wide head with a rope_dim that is not a power of two, head_dims the vector
# kernels do not compile (512, 96) and a rope_dim that is not whole two-vector units (24).
SHAPES = [
    (4096, 24, 24, 128, 128, True),
    (4096, 24, 24, 128, 128, False),
    (4096, 32, 32, 128, 64, True),
    (64, 32, 8, 128, 128, True),
    (333, 5, 1, 256, 96, True),
    (3001, 7, 3, 64, 32, False),
    (7, 3, 1, 512, 384, False),
    (129, 4, 2, 96, 80, True),
    (65, 6, 2, 128, 24, True),
]


def _inputs(shape, dtype=torch.bfloat16, seed=11, **kwargs):
    t, hq, hk, d, rope_dim, is_neox = shape
    return contract.make_inputs(t, hq, hk, d, rope_dim, is_neox, dtype, "cuda", seed=seed, fused_qkv=True, **kwargs)


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("dtype, rounding", [(torch.bfloat16, "fused"), (torch.bfloat16, "hf"), (torch.float32, "fused")],
                         ids=lambda v: str(v).removeprefix("torch."))
def test_shapes_at_scale(impl, shape, dtype, rounding):
    require(impl)
    inputs = _inputs(shape, dtype, position_dtype=torch.int32, position_offset=7)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.0, rounding=rounding)


@pytest.mark.parametrize("impl", COMPILED)
@pytest.mark.parametrize("tokens", [1, 300, 3001])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rounding, weight_offset", [("fused", 0.0), ("hf", 1.0)])
def test_one_trip_to_many(impl, tokens, is_neox, rounding, weight_offset):
    """From one block to many trips of a persistent grid, the last partly empty, zero rows at eps=0:
    every row right (the tuned kernel's three walks: one row per lane group, the whole-token walk,
    the steps walk at 3001 x 9 heads, whose grid is no whole number of tokens)."""
    require(impl)
    inputs = _inputs((tokens, 8, 1, 128, 128, is_neox), seed=tokens, kind="zero_rows", position_offset=3)
    run_and_compare(OP, impl, inputs, eps=0.0, weight_offset=weight_offset, rounding=rounding)


@pytest.mark.parametrize("impl", COMPILED)
@pytest.mark.parametrize("heads", [(1, 1), (2, 1), (3, 1), (7, 5), (40, 1), (40, 8), (96, 32), (127, 1)], ids=str)
def test_every_head_of_every_token(impl, heads):
    """Every (token, head) lands on its own row with its own tensor's weight, for head counts whose
    whole-token grid is and is not close to the resident one (the tuned kernel divides by a
    host-computed magic number; rung 7 and the whole-token walk read a lane group's weight once):
    q's and k's weights far apart, 2049 tokens."""
    require(impl)
    inputs = _inputs((2049, *heads, 128, 128, True), seed=sum(heads), position_offset=5)
    inputs["q_weight"].copy_(torch.linspace(0.25, 2.0, 128, device="cuda"))
    inputs["k_weight"].copy_(torch.linspace(-1.5, -0.125, 128, device="cuda"))
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.5, rounding="fused")


def _shifted(t, elements):
    """A copy of `t` that starts `elements` past a fresh allocation: contiguous but not 16-byte
    aligned, so the vector paths must step aside for the general one."""
    flat = torch.zeros(t.numel() + elements, dtype=t.dtype, device=t.device)
    view = flat[elements:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("impl", COMPILED)
@pytest.mark.parametrize("table", ["cos_sin_cache", "weights", "rows"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
def test_misaligned_tables_and_rows(impl, table, cache_dtype, is_neox):
    require(impl)
    inputs = _inputs((300, 6, 2, 128, 128, is_neox), seed=5, cache_dtype=cache_dtype, weight_dtype=torch.float32)
    if table == "cos_sin_cache":
        inputs["cos_sin_cache"] = _shifted(inputs["cos_sin_cache"], 1)
    elif table == "weights":
        inputs["q_weight"] = _shifted(inputs["q_weight"], 1)
        inputs["k_weight"] = _shifted(inputs["k_weight"], 3)
    else:  # q and k one element into their buffer: rows off 16-byte boundaries
        qkv = torch.randn(300, 1 + 10 * 128, dtype=torch.bfloat16, device="cuda")
        inputs["q"] = qkv[:, 1: 1 + 6 * 128].view(300, 6, 128)
        inputs["k"] = qkv[:, 1 + 6 * 128: 1 + 8 * 128].view(300, 2, 128)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.0, rounding="fused")


@pytest.mark.parametrize("impl", COMPILED)
@pytest.mark.parametrize("dtype, rounding", [(torch.bfloat16, "fused"), (torch.float16, "hf"), (torch.float32, "fused")],
                         ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("storage", ["activation", "float32_weights", "float32_cache", "float32_both"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
def test_every_table_storage(impl, dtype, rounding, storage, is_neox):
    """Weights and cache in the activation dtype or float32: the four storage pairs the compiled
    kernels (rung 5 on, the tuned kernel) specialize for, in every dtype, both roundings (the
    reference and Numba: tests/test_qk_norm_rope.py)."""
    require(impl)
    weight_dtype = torch.float32 if storage in ("float32_weights", "float32_both") else dtype
    cache_dtype = torch.float32 if storage in ("float32_cache", "float32_both") else dtype
    inputs = _inputs((515, 8, 2, 128, 64, is_neox), dtype, seed=6, cache_dtype=cache_dtype, weight_dtype=weight_dtype)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=1.0, rounding=rounding)


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("tokens", [3, 2049])
def test_out_of_range_positions_give_nan(impl, tokens):
    """A token whose position is out of range reads nothing and gets NaN in its rotated dims, its
    pass-through dims normalized (the contract); the other tokens are right. At decode (the warmed
    one-row kernel reads each position before its wait) and on the walks of a prefill."""
    require(impl)
    rope_dim = 64
    inputs = _inputs((tokens, 8, 2, 128, rope_dim, True), seed=tokens, max_position=tokens + 1)
    bad = [0, tokens - 1]
    inputs["positions"][0] = 100000
    inputs["positions"][-1] = -1
    expected = contract.expected(clone_inputs(inputs), 1e-6, 0.0, "fused")
    a = contract.check_inputs(**inputs, eps=1e-6, weight_offset=0.0, rounding="fused")
    impl.fn(*_positional(a))
    good = torch.ones(tokens, dtype=torch.bool)
    good[bad] = False
    for name in ("q", "k"):
        out = inputs[name].cpu()
        assert out[bad, :, :rope_dim].isnan().all(), f"{name}: the bad tokens' rotated dims should be NaN"
        assert not out[bad, :, rope_dim:].isnan().any(), f"{name}: their pass-through dims stay normalized"
        exact = expected[name][0].cpu()
        verdict = agreement(name, out[good], exact[good], None, "fused", contract.TOLERANCES[torch.bfloat16])
        assert verdict.ok, verdict.message


@pytest.mark.parametrize("impl", COMPILED)
def test_token_stride_beyond_int32(impl):
    """A row stride over 2^31 elements must not overflow the kernels' index arithmetic."""
    require(impl)
    heads, head_dim = 2, 64
    stride = 2**31 + 8 * head_dim  # elements; keeps 16-byte alignment so the vector paths run
    try:
        storage = torch.zeros(stride + heads * head_dim, dtype=torch.bfloat16, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("needs about 4 GiB of GPU memory")
    inputs = _inputs((2, heads, 1, head_dim, head_dim, True), seed=9)
    q = storage.as_strided((2, heads, head_dim), (stride, head_dim, 1))
    q.copy_(inputs["q"])
    inputs["q"] = q
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.0, rounding="fused")
    del storage, q, inputs
    torch.cuda.empty_cache()


# ---- the tuned kernel's policy ---------------------------------------------------------------
TUNED_KERNEL = "cookbook::qk_norm_rope::tuned::qk_norm_rope_tuned_kernel"
WARP_PER_ROW = "cookbook::qk_norm_rope::v2::qk_norm_rope_v2_kernel"
WALKS = {"one_row": "Walk::kOneRow", "whole_tokens": "Walk::kWholeTokens", "steps": "Walk::kSteps"}


def _positional(a):
    return (a.q, a.k, a.q_weight, a.k_weight, a.cos_sin_cache, a.positions, a.eps, a.weight_offset, a.rounding,
            a.is_neox, a.rope_dim, a.position_offset)


def _plan(a) -> dict[str, str]:
    """The tuned policy's plan for checked arguments `a`, from the tuned extension's explain op."""
    from cookbook import cuda

    cuda.load_extension(registry.get(OP, "cuda_tuned").extension)
    text = torch.ops.cookbook.qk_norm_rope_tuned_explain(a.q, a.k, a.q_weight, a.k_weight, a.cos_sin_cache,
                                                           a.positions, a.eps, a.weight_offset, a.is_neox, a.rope_dim,
                                                           a.position_offset, a.rounding == "hf")
    return dict(line.split("=", 1) for line in text.strip().splitlines())


def _split_template(name: str) -> tuple[str, str]:
    """("ns::kernel", "v1,v2,...") of a demangled kernel name (enum casts dropped)."""
    from cookbook import explainer

    return explainer._split_template(name)


def check_tuned_dispatch(make, walk: str | None, rounding="fused"):
    """On the inputs `make()` returns, the tuned kernel launches exactly the kernel its plan names
    (function and template values), its walk is `walk` (None: rung 2's warp per row), and the
    result agrees with the contract."""
    impl = registry.get(OP, "cuda_tuned")
    require(impl)
    a = contract.check_inputs(**make(), eps=0.0, weight_offset=0.5, rounding=rounding)
    plan = _plan(a)
    names = launched_kernels(lambda: impl.fn(*_positional(a)))
    assert (plan["kernel"], plan["template_values"]) in {_split_template(n) for n in names}, (plan, names)
    if walk is None:
        assert plan["kernel"] == WARP_PER_ROW, plan
    else:
        assert plan["kernel"] == TUNED_KERNEL and plan["walk"] == WALKS[walk], plan
    run_and_compare(OP, impl, make(), eps=0.0, weight_offset=0.5, rounding=rounding)
    return plan


# The policy's edges (policy.h): one row per lane group where the call fits in one trip of the
# steps kernel's resident grid (decode); the whole-token walk where the rows need more trips and a
# whole-token grid is close to the resident one (FLUX's 48 heads, Qwen3-8B's 40); the steps walk
# where cutting the grid to whole tokens would lengthen the longest walk (8192 x 72 heads: 35 rows
# instead of 34 on 4 blocks per SM, 29 instead of 28 on 5). Far from the edges on an H100 or H200.
@pytest.mark.parametrize("shape, walk", [
    ((1, 32, 8, 128, 128, True), "one_row"), ((64, 32, 8, 128, 128, True), "one_row"),
    ((64, 32, 8, 128, 128, False), "one_row"), ((4096, 24, 24, 128, 128, True), "whole_tokens"),
    ((4096, 24, 24, 128, 128, False), "whole_tokens"), ((4096, 32, 8, 128, 128, True), "whole_tokens"),
    ((2048, 16, 4, 256, 96, False), "whole_tokens"), ((8192, 64, 8, 128, 128, True), "steps"),
    ((96, 6, 2, 512, 512, True), None), ((96, 6, 2, 96, 96, True), None), ((96, 6, 2, 128, 24, True), None)],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
@pytest.mark.parametrize("rounding", ["fused", "hf"])
def test_tuned_policy(shape, walk, rounding):
    check_tuned_dispatch(lambda: _inputs(shape, seed=shape[0], kind="zero_rows"), walk, rounding)


@pytest.mark.parametrize("weights, cache", [(torch.float32, torch.bfloat16), (None, torch.bfloat16),
                                            (torch.float32, torch.float32)], ids=["f32_bf16", "bf16_bf16", "f32_f32"])
def test_tuned_kernel_of_each_table_storage(weights, cache):
    plan = check_tuned_dispatch(lambda: _inputs((4096, 24, 24, 128, 128, True), weight_dtype=weights,
                                                cache_dtype=cache), "whole_tokens")
    assert plan["template_values"].split(",")[4:6] == [str(int(weights == torch.float32)), str(int(cache == torch.float32))]


def test_tuned_rows_off_16_bytes_run_the_warp_per_row():
    def make():
        inputs = _inputs((300, 6, 2, 128, 128, True))
        qkv = torch.randn(300, 1 + 10 * 128, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
        inputs["q"] = qkv[:, 1: 1 + 6 * 128].view(300, 6, 128)
        inputs["k"] = qkv[:, 1 + 6 * 128: 1 + 8 * 128].view(300, 2, 128)
        return inputs

    plan = check_tuned_dispatch(make, None)
    assert plan["off_vectors"] == "rows_unaligned"


def test_auto_and_cuda_run_the_tuned_kernel():
    tuned = registry.get(OP, "cuda_tuned")
    assert registry.resolve(OP, "auto", "cuda") is tuned and registry.resolve(OP, "cuda", "cuda") is tuned


# ---- torch.compile, CUDA graphs, opcheck, compute-sanitizer -----------------------------------
def _public(inputs):
    inputs = dict(inputs)
    rope = inputs.pop("rope")
    return inputs, dict(is_neox=rope.is_neox, rope_dim=rope.rope_dim, position_offset=rope.position_offset)


def test_torch_compile_fullgraph():
    tensors, kwargs = _public(_inputs((64, 8, 2, 128, 64, True), seed=2))
    eager = clone_inputs(tensors)
    cookbook.qk_norm_rope(**eager, **kwargs, backend="cuda")

    @torch.compile(fullgraph=True)
    def step(q, k, q_weight, k_weight, cos_sin_cache, positions):
        return cookbook.qk_norm_rope(q, k, q_weight, k_weight, cos_sin_cache, positions, **kwargs, backend="cuda")

    step(**tensors)
    assert torch.equal(tensors["q"], eager["q"]) and torch.equal(tensors["k"], eager["k"])


@pytest.mark.parametrize("impl", COMPILED)
@pytest.mark.parametrize("tokens", [8, 3001])
def test_cuda_graph_capture_and_replay(impl, tokens):
    """Every compiled kernel (rung 1's scratch from torch's allocator included) captured in a graph
    and replayed on new rows and new positions in the same buffers."""
    tensors, kwargs = _public(_inputs((tokens, 8, 2, 128, 128, False), seed=3))

    def call(t):
        a = contract.check_inputs(**t, eps=1e-6, weight_offset=0.0, rounding="fused", rope=contract.Rope(**kwargs))
        impl.fn(*_positional(a))

    static = clone_inputs(tensors)
    call(clone_inputs(tensors))  # build and load outside capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        call(static)
    torch.cuda.current_stream().wait_stream(stream)
    for name in ("q", "k"):
        static[name].copy_(tensors[name])
    static["positions"].copy_(tensors["positions"].flip(0))  # new positions, same buffer
    graph.replay()
    expected = clone_inputs(tensors)
    expected["positions"] = tensors["positions"].flip(0).contiguous()
    call(expected)
    torch.cuda.synchronize()
    assert torch.equal(static["q"], expected["q"]) and torch.equal(static["k"], expected["k"])


@pytest.mark.parametrize("impl", COMPILED)
def test_opcheck(impl):
    from cookbook import cuda

    op = cuda.load_extension(impl.extension)
    x = _inputs((16, 4, 2, 128, 64, True), seed=4)
    args = (x["q"], x["k"], x["q_weight"], x["k_weight"], x["cos_sin_cache"], x["positions"], 1e-6, 0.0, True, 64, 0,
            False)
    torch.library.opcheck(op.default, args)


SANITIZED = """
import torch
from cookbook import registry
from cookbook.ops import qk_norm_rope as contract
from cookbook.testing import agreement
for impl in registry.implementations("qk_norm_rope", registry.COMPILED_LEVELS):
    # one block; more rows than a persistent grid holds (the walks take several steps and stop at
    # the last row); a grid of no whole tokens (the steps walk); out-of-range positions read nothing
    for tokens, heads, is_neox in ((5, (24, 8), False), (5, (24, 8), True), (700, (24, 8), True),
                                   (3001, (8, 1), False), (3001, (64, 8), True)):
        x = contract.make_inputs(tokens, *heads, 128, 64, is_neox, torch.bfloat16, "cuda", seed=tokens, fused_qkv=True,
                                 max_position=tokens + 1)
        x["positions"][0] = 100000
        a = contract.check_inputs(**x, eps=1e-6, weight_offset=0.0, rounding="fused")
        impl.fn(a.q, a.k, a.q_weight, a.k_weight, a.cos_sin_cache, a.positions, a.eps, a.weight_offset, a.rounding,
                a.is_neox, a.rope_dim, a.position_offset)
    x = contract.make_inputs(9, 4, 2, 96, 80, True, torch.float16, "cuda", fused_qkv=True)  # the general path
    a = contract.check_inputs(**x, eps=1e-6, weight_offset=1.0, rounding="hf")
    impl.fn(a.q, a.k, a.q_weight, a.k_weight, a.cos_sin_cache, a.positions, a.eps, a.weight_offset, a.rounding,
            a.is_neox, a.rope_dim, a.position_offset)
torch.cuda.synchronize()
print("sanitized run done")
"""


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not on PATH")
def test_compute_sanitizer_memcheck():
    from cookbook import cuda

    cuda.build([impl.extension for impl in registry.implementations(OP, registry.COMPILED_LEVELS)])  # outside the sanitizer
    run = subprocess.run(
        ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1", sys.executable, "-c", SANITIZED],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0 and "ERROR SUMMARY: 0 errors" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
