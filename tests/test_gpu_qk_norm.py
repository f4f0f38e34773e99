"""qk_norm on a real GPU: torch.compile, CUDA graphs, opcheck, 64-bit strides, compute-sanitizer.

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


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("shape", [(8192, 8, 1, 128), (333, 5, 3, 256), (7, 3, 1, 1024), (64, 4, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_shapes_at_scale(impl, shape, dtype):
    require(impl)
    inputs = contract.make_inputs(*shape, dtype, "cuda", seed=11, fused_qkv=True)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.0, rounding="fused")


def two_trip_token_counts(heads, head_dim):
    """Token counts around v7's two-rows-per-group band on this GPU: more rows than v6's grid of
    6 blocks x (256 / lanes per row) groups per SM holds, at most twice that (both edges, odd
    counts, and one past the band, where v7 runs v6's kernel again)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lanes_per_row = min(head_dim // 8, 32)  # 16-byte bf16 vectors, at most a warp per row
    one_trip = sms * 6 * (256 // lanes_per_row)
    first, last = one_trip // heads + 1, 2 * one_trip // heads
    return [first, (first + last) // 2 | 1, last, last + 1]


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("heads, head_dim", [((64, 8), 128), ((16, 4), 256), ((32, 8), 64)])
@pytest.mark.parametrize("rounding, weight_offset", [("fused", 0.0), ("hf", 1.0)])
def test_one_to_two_trips_of_the_grid(impl, heads, head_dim, rounding, weight_offset):
    """v7 covers calls of one to two trips of v6's grid with two rows per lane group: every row,
    the group's second row past the last one included, comes out right."""
    require(impl)
    for tokens in two_trip_token_counts(sum(heads), head_dim):
        inputs = contract.make_inputs(tokens, *heads, head_dim, torch.bfloat16, "cuda", seed=tokens, fused_qkv=True)
        run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=weight_offset, rounding=rounding)


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("heads", [(1, 1), (2, 1), (3, 1), (7, 5), (40, 8), (96, 32), (127, 1)], ids=str)
def test_row_to_token_division(impl, heads):
    """v8 divides rows by the head count with a host-computed magic number: every (token, head)
    must land on its own row, for head counts that are and are not powers of two."""
    require(impl)
    inputs = contract.make_inputs(333, *heads, 128, torch.bfloat16, "cuda", seed=sum(heads), fused_qkv=True)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.0, rounding="fused")


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("weights", ["misaligned", "float32", "float32_misaligned"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_decode_weights_of_every_layout(impl, weights, tokens):
    """v9's one-trip kernel reads a row's weight as 16-byte vectors where both weights are 16-byte
    aligned and element by element otherwise, in the activation dtype or float32."""
    require(impl)
    inputs = contract.make_inputs(tokens, 16, 4, 128, torch.bfloat16, "cuda", seed=tokens, fused_qkv=True)
    dtype = torch.float32 if weights.startswith("float32") else torch.bfloat16
    for name in ("q_weight", "k_weight"):
        w = inputs[name].to(dtype)
        if weights.endswith("misaligned"):  # one element into its buffer: 2 or 4 bytes off 16
            buffer = torch.empty(w.numel() + 1, dtype=dtype, device="cuda")
            buffer[1:].copy_(w)
            w = buffer[1:]
        inputs[name] = w
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=1.0, rounding="hf")


# v10 pads a row's lane group to a power of two where the head is a whole number of 16-byte
# vectors that is not one (80, 96, 160 and 192 elements: 10, 12, 20 and 24 bf16 vectors, twice
# that in float32), so the lanes past the last vector must load, weigh and store nothing. One
# token and five take the one-trip kernel, 2000 tokens x 9 heads the persistent loop.
PADDED_HEAD_DIMS = [80, 96, 160, 192]


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("head_dim", PADDED_HEAD_DIMS)
@pytest.mark.parametrize("dtype, rounding", [(torch.bfloat16, "fused"), (torch.float16, "hf"), (torch.float32, "fused")],
                         ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("tokens", [1, 5, 2000])
def test_padded_lane_groups(impl, head_dim, dtype, rounding, tokens):
    require(impl)
    inputs = contract.make_inputs(tokens, 8, 1, head_dim, dtype, "cuda", seed=head_dim + tokens, fused_qkv=True,
                                  kind="zero_rows")
    run_and_compare(OP, impl, inputs, eps=0.0, weight_offset=0.5, rounding=rounding)


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("weights", ["misaligned", "float32"])
def test_padded_lane_groups_weight_layouts(impl, weights):
    """The one-trip kernel's weight loads at a padded head: vectors, or elements off 16 bytes."""
    require(impl)
    inputs = contract.make_inputs(3, 16, 4, 96, torch.bfloat16, "cuda", seed=7, fused_qkv=True)
    dtype = torch.float32 if weights == "float32" else torch.bfloat16
    for name in ("q_weight", "k_weight"):
        w = inputs[name].to(dtype)
        if weights == "misaligned":
            buffer = torch.empty(w.numel() + 1, dtype=dtype, device="cuda")
            buffer[1:].copy_(w)
            w = buffer[1:]
        inputs[name] = w
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=1.0, rounding="hf")


@pytest.mark.parametrize("version, head_dim, tokens, kernel", [
    (10, 96, 1, "qk_norm_one_trip_kernel<__nv_bfloat16, 96,"), (10, 96, 2000, "qk_norm_v3_kernel<__nv_bfloat16, 96,"),
    (10, 160, 2000, "qk_norm_v3_kernel<__nv_bfloat16, 160,"), (9, 96, 1, "qk_norm_v2_kernel"),
    (10, 112, 1, "qk_norm_v2_kernel")])
def test_padded_dispatch(version, head_dim, tokens, kernel):
    """v10 runs the vector kernels at the padded head_dims it compiles; v9, and v10 at others (112
    is 14 vectors, not compiled), keep v2's general path."""
    from cookbook import cuda

    cuda.load(OP)
    x = contract.make_inputs(tokens, 8, 1, head_dim, torch.bfloat16, "cuda", seed=3, fused_qkv=True)
    names = launched_kernels(lambda: cuda.qk_norm(x["q"], x["k"], x["q_weight"], x["k_weight"], 1e-6, 0.0, "fused",
                                                  version=version))
    assert any(kernel in name for name in names), names


@pytest.mark.parametrize("version, tokens, kernel", [
    (11, 8192, "qk_norm_one_trip_kernel<__nv_bfloat16, 128,"), (10, 8192, "qk_norm_v3_kernel<__nv_bfloat16, 128,"),
    (11, 1, "qk_norm_one_trip_kernel<__nv_bfloat16, 128,"),
    (12, 1, "qk_norm_one_trip_kernel<__nv_bfloat16, 128, false, true, true, false, 1>"),
    (12, 8192, "qk_norm_one_trip_kernel<__nv_bfloat16, 128, false, true, true, false, 1>"),
    (11, 8192, "qk_norm_one_trip_kernel<__nv_bfloat16, 128, false, true, false, false, 1>"),
    (13, 1, "qk_norm_one_trip_kernel<__nv_bfloat16, 128, false, true, true, false, 1>"),
    (13, 8192, "qk_norm_one_trip_kernel<__nv_bfloat16, 128, false, true, true, false, 1>")])
def test_grid_of_all_rows_dispatch(version, tokens, kernel):
    """v11 runs the one-trip kernel at every size; v10 only where the rows fit in one trip of its
    persistent grid (8192 tokens x 72 heads walk it several times); v12 is v11's kernel with the
    weights warmed, at every size; v13 keeps it at one wave and at many (35 waves here)."""
    from cookbook import cuda

    cuda.load(OP)
    x = contract.make_inputs(tokens, 64, 8, 128, torch.bfloat16, "cuda", seed=3, fused_qkv=True)
    names = launched_kernels(lambda: cuda.qk_norm(x["q"], x["k"], x["q_weight"], x["k_weight"], 1e-6, 0.0, "fused",
                                                  version=version))
    assert any(kernel in name for name in names), names


# v13 warms the row a wave ahead (the kernel's last template argument) in calls of two to
# kV13MaxWaves (8) waves: 8193 tokens x 8/1 heads is 4.4 waves of 16-row blocks on a 132-SM
# H100/H200, 2049 x 16/4 heads of 256 (8-row blocks) 4.9; 8192 x 64/8 is 35 waves and 64 tokens
# less than one. Odd token counts, zero rows at eps=0, float32 weights, both roundings.
@pytest.mark.parametrize("shape, ahead", [((8193, 8, 1, 128), True), ((2049, 16, 4, 256), True),
                                          ((8192, 64, 8, 128), False), ((64, 64, 8, 128), False)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_v13_rows_ahead(shape, ahead):
    def make(seed, weight_dtype):
        return contract.make_inputs(*shape, torch.bfloat16, "cuda", seed=seed, fused_qkv=True, kind="zero_rows",
                                    weight_dtype=weight_dtype)

    def picked(names):  # the one-trip kernel with the weights warmed, its kWarmAhead flag as expected
        trip = [n for n in names if "qk_norm_one_trip_kernel" in n]
        return len(trip) == 1 and trip[0].split(">(")[0].endswith(f"true, true, {str(ahead).lower()}, 1")

    check_dispatch(OP, 13, make, picked)


# v14 takes two vectors per lane (the kernel's last template argument) from one wave of v13's
# blocks up (16896 rows of 128 or 96 elements, 8448 of 256, on a 132-SM H100/H200) and warms the
# row a wave of its own blocks ahead at two to eight of those waves (21120 rows of 128: 8193 x
# 8/1 heads is 3.5, 2049 x 16/4 heads of 256 3.9); 256 tokens x 64/8 (18432 rows) and 2048 x 8/1
# heads of 96 take two vectors in less than one of their waves, 64 tokens and 1024 x 8/1 heads of
# 96 (9216 rows) keep one. Odd token counts, zero rows at eps=0, float32 weights, both roundings.
@pytest.mark.parametrize("shape, vectors, ahead", [
    ((8193, 8, 1, 128), 2, True), ((2049, 16, 4, 256), 2, True), ((8192, 64, 8, 128), 2, False),
    ((256, 64, 8, 128), 2, False), ((2048, 8, 1, 96), 2, False), ((1024, 8, 1, 96), 1, False),
    ((64, 64, 8, 128), 1, False)], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_v14_dispatch(shape, vectors, ahead):
    def make(seed, weight_dtype):
        return contract.make_inputs(*shape, torch.bfloat16, "cuda", seed=seed, fused_qkv=True, kind="zero_rows",
                                    weight_dtype=weight_dtype)

    def picked(names):  # the one-trip kernel, weights warmed, its kWarmAhead and vectors per lane as expected
        trip = [n for n in names if "qk_norm_one_trip_kernel" in n]
        return len(trip) == 1 and trip[0].split(">(")[0].endswith(f"true, true, {str(ahead).lower()}, {vectors}")

    check_dispatch(OP, 14, make, picked)


@pytest.mark.parametrize("impl", kernel_impls(OP))
def test_token_stride_beyond_int32(impl):
    """A row stride over 2^31 elements must not overflow the kernels' index arithmetic."""
    require(impl)
    heads, head_dim = 2, 64
    stride = 2**31 + 8 * head_dim  # elements; keeps 16-byte alignment so v3 takes its vector path
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


def test_opcheck():
    from cookbook import cuda

    cuda.load(OP)
    inputs = contract.make_inputs(16, 4, 2, 128, torch.bfloat16, "cuda", seed=4)
    args = (inputs["q"], inputs["k"], inputs["q_weight"], inputs["k_weight"], 1e-6, 0.0, False, 3)
    torch.library.opcheck(torch.ops.cookbook.qk_norm.default, args)


def test_auto_backend_is_the_last_cuda_version():
    assert registry.resolve(OP, "auto", "cuda") is registry.latest(OP, "cuda")


SANITIZED = """
import torch, cookbook, cookbook.cuda
from cookbook import registry
from cookbook.ops import qk_norm as contract
for version in [impl.version for impl in registry.implementations("qk_norm", ("cuda",))]:
    # 800 tokens x 40 heads: more rows than a persistent grid holds, so the row walks take
    # several steps and stop at the last row.
    # 500 tokens x 40 heads: one to two trips of v6's grid (v7's two rows per lane group on an H100/H200).
    for tokens, fused in ((5, False), (5, True), (500, True), (800, True)):
        x = contract.make_inputs(tokens, 32, 8, 128, torch.bfloat16, "cuda", seed=version, fused_qkv=fused)
        cookbook.cuda.qk_norm(x["q"], x["k"], x["q_weight"], x["k_weight"], 1e-6, 0.0, "fused", version=version)
x = contract.make_inputs(3, 2, 1, 96, torch.float16, "cuda", fused_qkv=True)
cookbook.qk_norm(**x, backend="cuda", rounding="hf")
for tokens in (3, 2000):  # v10's padded lane groups: the one-trip kernel, then the persistent loop
    x = contract.make_inputs(tokens, 8, 1, 96, torch.bfloat16, "cuda", fused_qkv=True)
    cookbook.qk_norm(**x, backend="cuda")
torch.cuda.synchronize()
print("sanitized run done")
"""


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not on PATH")
def test_compute_sanitizer_memcheck():
    from cookbook import cuda

    cuda.load(OP)  # build outside the sanitizer (much faster), the child reuses the cache
    run = subprocess.run(
        ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1", sys.executable, "-c", SANITIZED],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0 and "ERROR SUMMARY: 0 errors" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
