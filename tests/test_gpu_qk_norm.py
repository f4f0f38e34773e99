"""qk_norm on a real GPU: every rung and the tuned kernel at scale, the tuned kernel's policy,
torch.compile, CUDA graphs, opcheck, 64-bit strides, compute-sanitizer.

Skipped on machines without a CUDA GPU (CI); run on an H100/H200 through the device tool."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

import cookbook
from cookbook import registry
from cookbook.ops import qk_norm as contract
from helpers import ON_GPU, check_dispatch, clone_inputs, kernel_impls, launched_kernels, require, run_and_compare

pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
OP = "qk_norm"
COMPILED = [pytest.param(impl, id=impl.name) for impl in registry.implementations(OP, registry.COMPILED_LEVELS)]


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("shape", [(8192, 8, 1, 128), (333, 5, 3, 256), (7, 3, 1, 1024), (64, 4, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_shapes_at_scale(impl, shape, dtype):
    require(impl)
    inputs = contract.make_inputs(*shape, dtype, "cuda", seed=11, fused_qkv=True)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.0, rounding="fused")


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("tokens", [1, 5, 300, 2049, 3001])
@pytest.mark.parametrize("rounding, weight_offset", [("fused", 0.0), ("hf", 1.0)])
def test_one_wave_to_many(impl, tokens, rounding, weight_offset):
    """From one block to several waves of them, the last block partly empty: every row right, in
    both rounding orders (3001 x 9 heads: the tuned kernel's two vectors per lane with the next
    wave warmed)."""
    require(impl)
    inputs = contract.make_inputs(tokens, 8, 1, 128, torch.bfloat16, "cuda", seed=tokens, fused_qkv=True,
                                  kind="zero_rows")
    run_and_compare(OP, impl, inputs, eps=0.0, weight_offset=weight_offset, rounding=rounding)


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("heads", [(1, 1), (2, 1), (3, 1), (7, 5), (40, 8), (96, 32), (127, 1)], ids=str)
def test_row_to_token_division(impl, heads):
    """Every (token, head) lands on its own row, for head counts that are and are not powers of
    two (the tuned kernel divides by a host-computed magic number)."""
    require(impl)
    inputs = contract.make_inputs(333, *heads, 128, torch.bfloat16, "cuda", seed=sum(heads), fused_qkv=True)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.0, rounding="fused")


def _weights_laid_out(inputs, weights):
    """The inputs with both weights in float32 and/or one element off 16 bytes into their buffer."""
    dtype = torch.float32 if weights.startswith("float32") else inputs["q"].dtype
    for name in ("q_weight", "k_weight"):
        w = inputs[name].to(dtype)
        if weights.endswith("misaligned"):
            buffer = torch.empty(w.numel() + 1, dtype=dtype, device="cuda")
            buffer[1:].copy_(w)
            w = buffer[1:]
        inputs[name] = w
    return inputs


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("weights", ["misaligned", "float32", "float32_misaligned"])
@pytest.mark.parametrize("tokens", [1, 5, 3001])
def test_weights_of_every_layout(impl, weights, tokens):
    """A row's weight is read as 16-byte vectors where both weights are 16-byte aligned and element
    by element otherwise, in the activation dtype or float32."""
    require(impl)
    inputs = contract.make_inputs(tokens, 16, 4, 128, torch.bfloat16, "cuda", seed=tokens, fused_qkv=True)
    run_and_compare(OP, impl, _weights_laid_out(inputs, weights), eps=1e-6, weight_offset=1.0, rounding="hf")


# The tuned kernel pads a row's lane group to a power of two where the head is a whole number of
# 16-byte vectors that is not one (80, 96, 160 and 192 elements: 10, 12, 20 and 24 bf16 vectors,
# twice that in float32), so the lanes past the last vector must load, weigh and store nothing.
# The rungs run these head_dims on rung 2's warp per row. 112 is compiled by no vector kernel.
PADDED_HEAD_DIMS = [80, 96, 112, 160, 192]


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("head_dim", PADDED_HEAD_DIMS)
@pytest.mark.parametrize("dtype, rounding", [(torch.bfloat16, "fused"), (torch.float16, "hf"), (torch.float32, "fused")],
                         ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("tokens", [1, 5, 2500])
def test_padded_lane_groups(impl, head_dim, dtype, rounding, tokens):
    require(impl)
    inputs = contract.make_inputs(tokens, 8, 1, head_dim, dtype, "cuda", seed=head_dim + tokens, fused_qkv=True,
                                  kind="zero_rows")
    run_and_compare(OP, impl, inputs, eps=0.0, weight_offset=0.5, rounding=rounding)


@pytest.mark.parametrize("impl", kernel_impls(OP))
def test_rows_off_16_bytes(impl):
    """q and k whose rows do not start on 16-byte boundaries take the general path."""
    require(impl)
    qkv = torch.randn(64, 1 + 12 * 128, dtype=torch.bfloat16, device="cuda")
    q = qkv[:, 1 : 1 + 8 * 128].view(64, 8, 128)
    k = qkv[:, 1 + 8 * 128 : 1 + 10 * 128].view(64, 2, 128)
    w = torch.rand(128, dtype=torch.bfloat16, device="cuda") + 0.5
    run_and_compare(OP, impl, dict(q=q, k=k, q_weight=w, k_weight=w.clone()), eps=1e-6, weight_offset=0.0,
                    rounding="fused")


TUNED_KERNEL = "qk_norm_tuned_kernel<__nv_bfloat16, "
WARM = "(cookbook::qk_norm::tuned::Warm)"
LOAD = "(cookbook::qk_norm::tuned::WeightLoad)"


# The tuned kernel's policy (kernels_cuda/qk_norm/tuned.cuh): two vectors per lane from one wave
# of one-vector blocks up (16896 rows of 128 or 96 bf16 elements on a 132-SM H100/H200), and the
# next wave warmed at two to eight waves of the blocks launched. Shapes far from the edges:
# 8193 x 9 heads of 128 is about 3 waves of two-vector blocks, 8192 x 72 heads over 20 of them,
# 256 x 72 heads two vectors in less than one of their waves, 64 tokens and 1024 x 9 heads of 96
# less than a wave of one-vector blocks.
@pytest.mark.parametrize("shape, vectors, warm_next_wave", [
    ((8193, 8, 1, 128), 2, True), ((2049, 16, 4, 256), 2, True), ((8192, 64, 8, 128), 2, False),
    ((256, 64, 8, 128), 2, False), ((2048, 8, 1, 96), 2, False), ((1024, 8, 1, 96), 1, False),
    ((64, 64, 8, 128), 1, False)], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_tuned_policy(shape, vectors, warm_next_wave):
    def make(seed, weight_dtype):
        return contract.make_inputs(*shape, torch.bfloat16, "cuda", seed=seed, fused_qkv=True, kind="zero_rows",
                                    weight_dtype=weight_dtype)

    def picked(names):
        tuned = [name for name in names if TUNED_KERNEL in name]
        return len(tuned) == 1 and f", {vectors}, {WARM}{int(warm_next_wave)}, {LOAD}1>" in tuned[0]

    check_dispatch(OP, "cuda_tuned", make, picked)


def test_tuned_loads_misaligned_weights_element_by_element():
    from cookbook import cuda

    impl = registry.get(OP, "cuda_tuned")
    cuda.load_extension(impl.extension)
    x = _weights_laid_out(contract.make_inputs(5, 16, 4, 128, torch.bfloat16, "cuda", seed=1), "misaligned")
    names = launched_kernels(lambda: impl.fn(x["q"], x["k"], x["q_weight"], x["k_weight"], 1e-6, 0.0, "fused"))
    assert any(TUNED_KERNEL in name and f"{LOAD}0>" in name for name in names), names


@pytest.mark.parametrize("head_dim, kernel", [(96, TUNED_KERNEL + "(cookbook::Rounding)0, 96,"),
                                              (112, "qk_norm_v2_kernel")])
def test_tuned_head_dims(head_dim, kernel):
    """The tuned kernel runs the padded head_dims it compiles on the vector path; others (112 is 14
    vectors) run rung 2's warp per row."""
    from cookbook import cuda

    impl = registry.get(OP, "cuda_tuned")
    cuda.load_extension(impl.extension)
    x = contract.make_inputs(5, 8, 1, head_dim, torch.bfloat16, "cuda", seed=3, fused_qkv=True)
    names = launched_kernels(lambda: impl.fn(x["q"], x["k"], x["q_weight"], x["k_weight"], 1e-6, 0.0, "fused"))
    assert any(kernel in name for name in names), names


@pytest.mark.parametrize("impl", kernel_impls(OP))
def test_token_stride_beyond_int32(impl):
    """A row stride over 2^31 elements must not overflow the kernels' index arithmetic."""
    require(impl)
    heads, head_dim = 2, 64
    stride = 2**31 + 8 * head_dim  # elements; keeps 16-byte alignment so the vector paths run
    try:
        storage = torch.zeros(stride + heads * head_dim, dtype=torch.bfloat16, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("needs about 4 GiB of GPU memory")
    q = storage.as_strided((2, heads, head_dim), (stride, head_dim, 1))
    q.copy_(torch.randn(2, heads, head_dim, device="cuda"))
    k = torch.randn(2, 1, head_dim, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(head_dim, device="cuda", dtype=torch.bfloat16) + 0.5
    run_and_compare(OP, impl, dict(q=q, k=k, q_weight=w, k_weight=w), eps=1e-6, weight_offset=0.0, rounding="fused")
    del storage, q
    torch.cuda.empty_cache()


def test_torch_compile_fullgraph():
    inputs = contract.make_inputs(64, 8, 2, 128, torch.bfloat16, "cuda", seed=2, fused_qkv=True)
    eager = clone_inputs(inputs)
    cookbook.qk_norm(**eager, backend="cuda")

    @torch.compile(fullgraph=True)
    def step(q, k, q_weight, k_weight):
        return cookbook.qk_norm(q, k, q_weight, k_weight, backend="cuda")

    step(**inputs)
    assert torch.equal(inputs["q"], eager["q"]) and torch.equal(inputs["k"], eager["k"])


def test_cuda_graph_capture_and_replay():
    inputs = contract.make_inputs(256, 8, 2, 128, torch.bfloat16, "cuda", seed=3, fused_qkv=True)
    static = clone_inputs(inputs)
    cookbook.qk_norm(**clone_inputs(inputs), backend="cuda")  # build and load outside capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        cookbook.qk_norm(**static, backend="cuda")
    torch.cuda.current_stream().wait_stream(stream)
    for name in ("q", "k"):
        static[name].copy_(inputs[name])
    graph.replay()
    expected = clone_inputs(inputs)
    cookbook.qk_norm(**expected, backend="cuda")
    torch.cuda.synchronize()
    assert torch.equal(static["q"], expected["q"]) and torch.equal(static["k"], expected["k"])


@pytest.mark.parametrize("impl", COMPILED)
def test_opcheck(impl):
    from cookbook import cuda

    op = cuda.load_extension(impl.extension)
    inputs = contract.make_inputs(16, 4, 2, 128, torch.bfloat16, "cuda", seed=4)
    args = (inputs["q"], inputs["k"], inputs["q_weight"], inputs["k_weight"], 1e-6, 0.0, False)
    torch.library.opcheck(op.default, args)


def test_auto_and_cuda_run_the_tuned_kernel():
    tuned = registry.get(OP, "cuda_tuned")
    assert registry.resolve(OP, "auto", "cuda") is tuned and registry.resolve(OP, "cuda", "cuda") is tuned


SANITIZED = """
import torch, cookbook
from cookbook import registry
from cookbook.ops import qk_norm as contract
for impl in registry.implementations("qk_norm", registry.COMPILED_LEVELS):
    # one block, a wave, several waves with the next one warmed (3001 x 9 heads), fused-qkv views
    for tokens, heads, fused in ((5, (32, 8), False), (5, (32, 8), True), (500, (32, 8), True), (3001, (8, 1), True)):
        x = contract.make_inputs(tokens, *heads, 128, torch.bfloat16, "cuda", seed=tokens, fused_qkv=fused)
        impl.fn(x["q"], x["k"], x["q_weight"], x["k_weight"], 1e-6, 0.0, "fused")
    for tokens in (3, 2000):  # padded lane groups
        x = contract.make_inputs(tokens, 8, 1, 96, torch.float16, "cuda", fused_qkv=True)
        impl.fn(x["q"], x["k"], x["q_weight"], x["k_weight"], 1e-6, 1.0, "hf")
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
