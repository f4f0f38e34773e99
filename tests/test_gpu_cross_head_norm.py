"""cross_head_norm on a real GPU: every rung and the tuned kernel at scale and around the per-CTA
limits, the tuned kernel's policy through the kernels a call launches (and its explain op against
the policy compiled for the host), torch.compile, CUDA graphs, opcheck, 64-bit strides,
compute-sanitizer.

Skipped on machines without a CUDA GPU (CI); run on an H100/H200."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

import cookbook
from cookbook import explainer, registry
from cookbook.ops import cross_head_norm as contract
from cross_head_norm_plans import BENCH_PLANS, EDGE_PLANS, as_launched, choice_of_plan, launched_choices
from helpers import ON_GPU, check_dispatch, clone_inputs, kernel_impls, launched_kernels, require, run_and_compare

pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
OP = "cross_head_norm"
COMPILED = [pytest.param(impl, id=impl.name) for impl in registry.implementations(OP, registry.COMPILED_LEVELS)]
SHAPE_ID = lambda v: "x".join(map(str, v)) if isinstance(v, tuple) and isinstance(v[0], int) else str(v).removeprefix("torch.")  # noqa: E731


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("shape", [(2048, 8192, 8192), (4096, 6144, 1024), (333, 5120, 1024), (7, 1024, 32768), (3, 65536, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_shapes_at_scale(impl, shape, dtype):
    require(impl)
    inputs = contract.make_inputs(*shape, dtype, "cuda", seed=11, fused_qkv=True)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.0, rounding="fused")


# Rungs 3-7 and the tuned kernel hold a row in registers up to kMaxThreads x 8 16-byte vectors
# per thread: 4096, 8192, 16384, 32768 elements of a 16-bit dtype at 1, 2, 4, 8 vectors (half that
# in float32); one vector more changes the kernel or, past the last, takes rung 2's strided kernel
# (the tuned kernel: the staged row, where the shared memory takes it; 65536 float32 elements are
# past that too).
CTA_LIMIT_WIDTHS = [w + extra for w in (2048, 4096, 8192, 16384, 32768) for extra in (-8, 0, 8)] + [65536]


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("width", CTA_LIMIT_WIDTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_widths_near_cta_limits(impl, width, dtype):
    require(impl)
    inputs = contract.make_inputs(5, width, 1024, dtype, "cuda", seed=width, fused_qkv=True)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=1.0, rounding="hf")


# Rung 7 and the tuned kernel run a warp per token where the wider row is at most 256 16-byte
# vectors (the tuned kernel: and the call has at least 18 tokens per vector of a token). These
# token counts are above that in every dtype listed, odd (a last CTA with idle warps), and the
# widths take each of its kernels: 1, 2, 4 and 8 vectors per lane in 16-bit dtypes, 1, 4 and 8 in
# float32; (5187, 2048, 256) in float32 is past 256 vectors, and (4099, 2048, 2) not 16-byte
# aligned: a CTA per row.
NARROW_ROWS = [(401, 64, 8), (2593, 512, 64), (4033, 768, 128), (5187, 2048, 256), (4099, 2048, 2)]
DTYPE_ROUNDINGS = [(torch.bfloat16, "fused"), (torch.float16, "hf"), (torch.float32, "fused"), (torch.float32, "hf")]


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("shape", NARROW_ROWS, ids=SHAPE_ID)
@pytest.mark.parametrize("dtype, rounding", DTYPE_ROUNDINGS, ids=SHAPE_ID)
def test_narrow_rows_at_many_tokens(impl, shape, dtype, rounding):
    """Zero rows at eps=0 too (they must come out zero), float32 weights in the fused order."""
    require(impl)
    inputs = contract.make_inputs(*shape, dtype, "cuda", seed=shape[0], fused_qkv=True, kind="zero_rows",
                                  weight_dtype=torch.float32 if rounding == "fused" else None)
    run_and_compare(OP, impl, inputs, eps=0.0, weight_offset=0.5, rounding=rounding)


# The tuned kernel's grids and warms: the token-major grid (fused views, three waves or more: 2049 x
# 8192/1024 and 4097 x 6144/1024), the (tokens, 2) grid with the next wave warmed (1025 x 4096), below
# a wave (77 x 4096/512); odd token counts, unequal widths, both layouts, zero rows at eps=0.
@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("shape", [(2049, 8192, 1024), (4097, 6144, 1024), (1025, 4096, 4096), (77, 4096, 512)], ids=SHAPE_ID)
@pytest.mark.parametrize("fused_qkv", [True, False], ids=["fused_qkv", "separate"])
def test_grids_and_waves(impl, shape, fused_qkv):
    require(impl)
    inputs = contract.make_inputs(*shape, torch.bfloat16, "cuda", seed=shape[0], fused_qkv=fused_qkv, kind="zero_rows")
    run_and_compare(OP, impl, inputs, eps=0.0, weight_offset=0.5, rounding="hf")


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
@pytest.mark.parametrize("tokens", [1, 1030])
def test_weights_of_every_layout(impl, weights, tokens):
    """The vector paths load 16-byte weight vectors; a weight off 16 bytes takes the strided kernel."""
    require(impl)
    inputs = contract.make_inputs(tokens, 4096, 1024, torch.bfloat16, "cuda", seed=tokens, fused_qkv=True)
    run_and_compare(OP, impl, _weights_laid_out(inputs, weights), eps=1e-6, weight_offset=1.0, rounding="hf")


# ---- the tuned kernel's policy, through the kernels a call launches ------------------------------
def _inputs(shape, dtype=torch.bfloat16, layout="fused_qkv", seed=0, weight_dtype=None):
    return contract.make_inputs(*shape, dtype, "cuda", seed=seed, fused_qkv=layout == "fused_qkv", kind="zero_rows",
                                weight_dtype=weight_dtype)


def _launched(inputs, rounding="fused"):
    tuned = registry.get(OP, "cuda_tuned")
    args = contract.check_inputs(**inputs, eps=1e-6, weight_offset=0.0, rounding=rounding)
    return launched_choices(launched_kernels(lambda: tuned.fn(args.q, args.k, args.q_weight, args.k_weight, args.eps,
                                                               args.weight_offset, args.rounding)))


def _requires_132_sms():
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the edges are set for a GPU of 132 SMs (H100 SXM, H200)")


@pytest.mark.parametrize("shape", contract.BENCH_SHAPES, ids=SHAPE_ID)
def test_tuned_policy_at_the_bench_shapes(shape):
    """The former fastest version's choices, made by the tuned kernel's policy, in both roundings."""
    _requires_132_sms()
    t, q_hidden, k_hidden, *layout = shape
    expected = as_launched(BENCH_PLANS[tuple(shape)])

    def make(seed, weight_dtype):
        return _inputs((t, q_hidden, k_hidden), layout="separate" if layout else "fused_qkv", seed=seed,
                       weight_dtype=weight_dtype)

    check_dispatch(OP, "cuda_tuned", make, lambda names: launched_choices(names) == [expected])


@pytest.mark.parametrize("shape, dtype, layout, expected", EDGE_PLANS, ids=SHAPE_ID)
def test_tuned_policy_edges(shape, dtype, layout, expected):
    _requires_132_sms()

    def make(seed, weight_dtype):
        return _inputs(shape, dtype, layout, seed, weight_dtype)

    check_dispatch(OP, "cuda_tuned", make, lambda names: launched_choices(names) == [as_launched(expected)])


SHAPES_TO_EXPLAIN = [(tuple(s[:3]), "separate" if len(s) > 3 else "fused_qkv", torch.bfloat16) for s in contract.BENCH_SHAPES] + \
    [(shape, layout, dtype) for shape, dtype, layout, _ in EDGE_PLANS]


@pytest.mark.parametrize("shape, layout, dtype", SHAPES_TO_EXPLAIN, ids=SHAPE_ID)
@pytest.mark.parametrize("rounding", ["fused", "hf"])
def test_explain_on_the_gpu_is_the_policy_on_the_host_and_what_runs(shape, layout, dtype, rounding):
    """The tuned extension's explain op (the launcher's own plan, the driver's occupancy) equals the
    policy compiled for the host for this GPU (nvcc's registers, the occupancy calculator), and the
    kernel it names is the kernel the call launches."""
    inputs = _inputs(shape, dtype, layout)
    on_gpu = explainer.explain(OP, *inputs.values(), rounding=rounding)
    on_host = explainer.explain(OP, *inputs.values(), rounding=rounding, gpu=explainer.Gpu.of_device())
    assert on_gpu.source.startswith("the GPU") and on_host.source.startswith("the policy compiled for the host")
    assert on_gpu.plan == on_host.plan, (on_gpu.plan, on_host.plan)
    assert _launched(inputs, rounding) == [as_launched(choice_of_plan(on_gpu.plan))]


# The first CTAs of a launch warm their own row into L2 before griddepcontrol.wait, while the kernel
# before them may still be writing those rows. Two calls chained on the same tensors (the second
# normalizes the first's output), back to back and replayed from a CUDA graph, must give the bytes of
# the same two calls with the device synchronized between them: a load moved before the wait would
# read the first call's input instead.
@pytest.mark.parametrize("shape", [(2048, 4096, 1024), (1025, 4096, 4096), (1536, 8192, 8192)],
                         ids=["many-waves", "two-waves", "like-rows"])
def test_chained_calls_read_the_previous_calls_output(shape):
    inputs = contract.make_inputs(*shape, torch.bfloat16, "cuda", seed=5, fused_qkv=True)

    def twice(x, synchronize):
        for _ in range(2):
            cookbook.cross_head_norm(**x, backend="cuda")
            if synchronize:
                torch.cuda.synchronize()

    expected = clone_inputs(inputs)
    twice(expected, synchronize=True)
    eager = clone_inputs(inputs)
    twice(eager, synchronize=False)
    static = clone_inputs(inputs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        twice(static, synchronize=False)
    torch.cuda.current_stream().wait_stream(stream)
    for name in ("q", "k"):
        static[name].copy_(inputs[name])
    graph.replay()
    torch.cuda.synchronize()
    for got in (eager, static):
        assert torch.equal(got["q"], expected["q"]) and torch.equal(got["k"], expected["k"])
    assert not torch.equal(expected["q"], inputs["q"])  # the calls wrote


@pytest.mark.parametrize("impl", kernel_impls(OP))
def test_token_stride_beyond_int32(impl):
    """A token stride over 2^31 elements must not overflow the kernels' index arithmetic."""
    require(impl)
    hidden = 1024
    stride = 2**31 + 8 * hidden  # elements; keeps 16-byte alignment so the vector paths run
    try:
        storage = torch.zeros(stride + hidden, dtype=torch.bfloat16, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("needs about 4 GiB of GPU memory")
    q = storage.as_strided((2, hidden), (stride, 1))
    q.copy_(torch.randn(2, hidden, device="cuda"))
    k = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    q_w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    k_w = torch.rand(256, device="cuda", dtype=torch.bfloat16) + 0.5
    run_and_compare(OP, impl, dict(q=q, k=k, q_weight=q_w, k_weight=k_w), eps=1e-6, weight_offset=0.0, rounding="fused")
    del storage, q
    torch.cuda.empty_cache()


# Seen on an H200 with torch 2.11: under torch.compile, when q and k are two 2-D column slices of
# one fused qkv tensor, k comes back wrong even when the PyTorch reference runs inside the opaque
# op (tools/diag_compile.py prints which tensor is off, per backend). Separate tensors, and the
# per-head [T, H, D] views of qk_norm, compile correctly. Kept visible as a non-strict xfail.
FUSED_COMPILE = pytest.mark.xfail(reason="torch.compile with aliasing 2-D q/k slices of one tensor (see comment)", strict=False)


@pytest.mark.parametrize("fused_qkv", [False, pytest.param(True, marks=FUSED_COMPILE)], ids=["separate", "fused_qkv"])
def test_torch_compile_fullgraph(fused_qkv):
    inputs = contract.make_inputs(64, 4096, 1024, torch.bfloat16, "cuda", seed=2, fused_qkv=fused_qkv)
    eager = clone_inputs(inputs)
    cookbook.cross_head_norm(**eager, backend="cuda")

    @torch.compile(fullgraph=True)
    def step(q, k, q_weight, k_weight):
        return cookbook.cross_head_norm(q, k, q_weight, k_weight, backend="cuda")

    step(**inputs)
    assert torch.equal(inputs["q"], eager["q"]) and torch.equal(inputs["k"], eager["k"])


@pytest.mark.parametrize("shape", [(256, 8192, 1024), (4096, 6144, 1024), (16384, 768, 128)], ids=SHAPE_ID)
def test_cuda_graph_capture_and_replay(shape):
    inputs = contract.make_inputs(*shape, torch.bfloat16, "cuda", seed=3, fused_qkv=True)
    static = clone_inputs(inputs)
    cookbook.cross_head_norm(**clone_inputs(inputs), backend="cuda")  # build and load outside capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        cookbook.cross_head_norm(**static, backend="cuda")
    torch.cuda.current_stream().wait_stream(stream)
    for name in ("q", "k"):
        static[name].copy_(inputs[name])
    graph.replay()
    expected = clone_inputs(inputs)
    cookbook.cross_head_norm(**expected, backend="cuda")
    torch.cuda.synchronize()
    assert torch.equal(static["q"], expected["q"]) and torch.equal(static["k"], expected["k"])


@pytest.mark.parametrize("impl", COMPILED)
def test_opcheck(impl):
    from cookbook import cuda

    op = cuda.load_extension(impl.extension)
    inputs = contract.make_inputs(16, 2048, 512, torch.bfloat16, "cuda", seed=4)
    args = (inputs["q"], inputs["k"], inputs["q_weight"], inputs["k_weight"], 1e-6, 0.0, False)
    torch.library.opcheck(op.default, args)


def test_auto_and_cuda_run_the_tuned_kernel():
    tuned = registry.get(OP, "cuda_tuned")
    assert registry.resolve(OP, "auto", "cuda") is tuned and registry.resolve(OP, "cuda", "cuda") is tuned


SANITIZED = """
import torch
from cookbook import registry
from cookbook.ops import cross_head_norm as contract
cases = [(3, 4096, 1024, True), (3, 4096, 1024, False), (3, 32776, 96, True), (3, 65536, 8, True),  # strided, staged
         (801, 256, 64, True),  # a warp per token
         (1100, 4096, 1024, True), (1025, 4096, 4096, False),  # a wave and more: held weights, the next wave warmed
         (1100, 7176, 6144, False), (2049, 8192, 1024, True)]  # like rows, partly filled; the token-major grid
for impl in registry.implementations("cross_head_norm", registry.COMPILED_LEVELS):
    for t, q_hidden, k_hidden, fused in cases:
        x = contract.make_inputs(t, q_hidden, k_hidden, torch.bfloat16, "cuda", seed=t, fused_qkv=fused)
        args = contract.check_inputs(**x, eps=1e-6, weight_offset=0.0, rounding="fused")
        impl.fn(args.q, args.k, args.q_weight, args.k_weight, args.eps, args.weight_offset, args.rounding)
    x = contract.make_inputs(3, 130, 64, torch.float16, "cuda", fused_qkv=True)
    args = contract.check_inputs(**x, eps=1e-6, weight_offset=1.0, rounding="hf")
    impl.fn(args.q, args.k, args.q_weight, args.k_weight, args.eps, args.weight_offset, args.rounding)
torch.cuda.synchronize()
print("sanitized run done")
"""


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not on PATH")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_compute_sanitizer(tool):
    from cookbook import cuda

    cuda.build([impl.extension for impl in registry.implementations(OP, registry.COMPILED_LEVELS)])  # outside the sanitizer
    run = subprocess.run(
        ["compute-sanitizer", "--tool", tool, "--error-exitcode", "1", sys.executable, "-c", SANITIZED],
        capture_output=True, text=True, timeout=600,
    )
    clean = "ERROR SUMMARY: 0 errors" in run.stdout or "RACECHECK SUMMARY: 0 hazards displayed (0 errors" in run.stdout
    assert run.returncode == 0 and clean, run.stdout[-4000:] + run.stderr[-2000:]
