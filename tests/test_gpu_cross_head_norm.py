"""cross_head_norm on a real GPU: every version at scale and around the per-CTA limits,
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
from cookbook.ops import cross_head_norm as contract
from helpers import ON_GPU, check_dispatch, clone_inputs, kernel_impls, launched_kernels, require, run_and_compare

pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
OP = "cross_head_norm"


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("shape", [(2048, 8192, 8192), (4096, 6144, 1024), (333, 5120, 1024), (7, 1024, 32768), (3, 65536, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_shapes_at_scale(impl, shape, dtype):
    require(impl)
    inputs = contract.make_inputs(*shape, dtype, "cuda", seed=11, fused_qkv=True)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.0, rounding="fused")


# v3 holds a row in registers up to 512 threads x kVecsPerThread x 16 bytes: 4096, 8192, 16384,
# 32768 elements of a 16-bit dtype (half that in float32); one vector more changes the template
# or, past the last, falls back to v2's streaming loop. v4 stages the row in shared memory up to
# the opt-in limit (227 KiB on sm_90): 65536 float32 elements are past it and run v3's path.
CTA_LIMIT_WIDTHS = [w + extra for w in (2048, 4096, 8192, 16384, 32768) for extra in (-8, 0, 8)] + [65536]


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("width", CTA_LIMIT_WIDTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_widths_near_cta_limits(impl, width, dtype):
    require(impl)
    inputs = contract.make_inputs(5, width, 1024, dtype, "cuda", seed=width, fused_qkv=True)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=1.0, rounding="hf")


# v8 runs one warp per token where the wider row is at most 256 16-byte vectors and the call has
# at least 18 tokens per vector of a token (kV8TokensPerVector). These token counts are above that
# in every dtype listed, odd (a last CTA with idle warps), and the widths take each of its kernels:
# 1, 2, 4 and 8 vectors per lane in 16-bit dtypes, 1, 4 and 8 in float32 (4 elements a vector);
# (5187, 2048, 256) in float32 is past 256 vectors, and (4099, 2048, 2) not 16-byte aligned: v7.
NARROW_ROWS = [(401, 64, 8), (2593, 512, 64), (4033, 768, 128), (5187, 2048, 256), (4099, 2048, 2)]
DTYPE_ROUNDINGS = [(torch.bfloat16, "fused"), (torch.float16, "hf"), (torch.float32, "fused"), (torch.float32, "hf")]


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("shape", NARROW_ROWS, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype, rounding", DTYPE_ROUNDINGS, ids=lambda v: str(v).removeprefix("torch."))
def test_narrow_rows_at_many_tokens(impl, shape, dtype, rounding):
    """Zero rows at eps=0 too (they must come out zero), float32 weights in the fused order."""
    require(impl)
    inputs = contract.make_inputs(*shape, dtype, "cuda", seed=shape[0], fused_qkv=True, kind="zero_rows",
                                  weight_dtype=torch.float32 if rounding == "fused" else None)
    run_and_compare(OP, impl, inputs, eps=0.0, weight_offset=0.5, rounding=rounding)


# v9 launches v7's kernels on a (token, tensor) grid where q and k share a token stride wider than
# either row (views of one fused tensor) and the rows fill the GPU at least kV9MinWaves (3) times,
# and on v2-v8's (tokens, 2) grid otherwise. 2049 x 8192/1024 and 4097 x 6144/1024 are 3.9 and 7.8
# waves of v7's 8-vector CTAs on a 132-SM H100/H200, 77 x 4096/512 less than one; odd token
# counts, unequal widths, both layouts, zero rows at eps=0.
@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("shape", [(2049, 8192, 1024), (4097, 6144, 1024), (77, 4096, 512)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fused_qkv", [True, False], ids=["fused_qkv", "separate"])
def test_token_major_grid(impl, shape, fused_qkv):
    require(impl)
    inputs = contract.make_inputs(*shape, torch.bfloat16, "cuda", seed=shape[0], fused_qkv=fused_qkv, kind="zero_rows")
    run_and_compare(OP, impl, inputs, eps=0.0, weight_offset=0.5, rounding="hf")


def template_args(kernel_name: str) -> list[str]:
    """The template arguments of a profiler kernel name such as `ns::kernel<a, b>(Params)`."""
    return [a.strip() for a in kernel_name.split(">(")[0].split("<", 1)[1].split(",")]


def zero_row_inputs(shape, dtype=torch.bfloat16, fused_qkv=True):
    """check_dispatch's `make`: the contract's inputs at `shape`, zero rows included."""
    def make(seed, weight_dtype):
        return contract.make_inputs(*shape, dtype, "cuda", seed=seed, fused_qkv=fused_qkv, kind="zero_rows",
                                    weight_dtype=weight_dtype)

    return make


def v3_kernel_args(names):
    """The template arguments of each cross_head_norm_v3_kernel among the launched kernels."""
    return [template_args(n) for n in names if "cross_head_norm_v3_kernel" in n]


@pytest.mark.parametrize("shape, fused_qkv, token_major", [((2048, 8192, 8192), True, True),
                                                     ((2048, 8192, 8192), False, False),
                                                     ((1024, 5120, 1024), True, False)])  # 1.9 waves
def test_v9_dispatch(shape, fused_qkv, token_major):
    """v9's grid is token-major (the kernel's kTokenMajor template argument) exactly for fused views of
    calls of three waves or more."""
    from cookbook import cuda

    cuda.load(OP)
    x = contract.make_inputs(*shape, torch.bfloat16, "cuda", seed=1, fused_qkv=fused_qkv)
    names = launched_kernels(lambda: cuda.cross_head_norm(x["q"], x["k"], x["q_weight"], x["k_weight"], 1e-6, 0.0,
                                                          "fused", version=9))
    v3 = [n for n in names if "cross_head_norm_v3_kernel" in n]
    assert len(v3) == 1, names
    assert template_args(v3[0])[5] == ("true" if token_major else "false"), v3  # kTokenMajor


# v10 launches v3's kernel with the weights loaded with the row (its last template argument) where
# a call is fewer than kV9MinWaves (3) waves of resident CTAs at up to 4 vectors per thread: one
# token (2 vectors of 512 threads in bf16, 4 in float32), 1024 x 4096 in bf16 (1-2 waves),
# 300 x 1024/256; not at 8 vectors per thread (1024 x 4096 in float32, 32768-wide bf16 rows; the
# float32 ones take the bulk copy) nor at 8192 x 4096 (many waves: v9's token-major grid).
@pytest.mark.parametrize("shape, held", [((1, 8192, 8192), {torch.bfloat16: True, torch.float32: True}),
                                         ((1024, 4096, 4096), {torch.bfloat16: True, torch.float32: False}),
                                         ((300, 1024, 256), {torch.bfloat16: True, torch.float32: True}),
                                         ((2, 32768, 1024), {torch.bfloat16: False, torch.float32: False}),
                                         ((8192, 4096, 4096), {torch.bfloat16: False, torch.float32: False})],
                         ids=["1x8192", "1024x4096", "300x1024x256", "2x32768x1024", "8192x4096"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda v: str(v).removeprefix("torch."))
def test_v10_dispatch(shape, held, dtype):
    """v10 holds the weights with the row exactly in small calls at up to 4 vectors per thread, and
    agrees with the reference in both roundings with either weight storage."""
    from cookbook import cuda

    cuda.load(OP)
    for rounding, weight_dtype in (("fused", torch.float32), ("hf", None)):
        x = contract.make_inputs(*shape, dtype, "cuda", seed=2, fused_qkv=True, kind="zero_rows",
                                 weight_dtype=weight_dtype)
        names = launched_kernels(lambda: cuda.cross_head_norm(x["q"], x["k"], x["q_weight"], x["k_weight"], 1e-6,
                                                              0.5, rounding, version=10))
        v3 = v3_kernel_args(names)
        assert any(args[6] == "true" for args in v3) == held[dtype], names  # kWeightsWithRow
        x = contract.make_inputs(*shape, dtype, "cuda", seed=3, fused_qkv=True, kind="zero_rows",
                                 weight_dtype=weight_dtype)
        run_and_compare(OP, registry.get(OP, "cuda_v10"), x, eps=0.0, weight_offset=0.5, rounding=rounding)


# v11 warms the row a wave ahead (the kernel's last template argument) where v9 keeps the (tokens,
# 2) grid with at least one wave and fewer than kV9MinWaves (3): 1025 x 4096 (v10's held kernel,
# 1.9 waves) and 1023 x 5120/1024 (8 vectors per thread, not held), not at one token (below a
# wave) nor at 2048 x 8192 fused (3.9 waves, token-major).
@pytest.mark.parametrize("shape, ahead", [((1025, 4096, 4096), True), ((1023, 5120, 1024), True),
                                          ((1, 8192, 8192), False), ((2048, 8192, 8192), False)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_v11_dispatch(shape, ahead):
    def picked(names):  # one v3 kernel, its kWarmAhead flag as expected
        v3 = v3_kernel_args(names)
        return len(v3) == 1 and (v3[0][7] == "true") == ahead

    check_dispatch(OP, 11, zero_row_inputs(shape), picked)


# v12 launches v9's token-major kernel compiled for kV7Threads (its last template argument, 128)
# where v9 takes the token-major grid (fused views of three waves or more; 6144/1024 included, where
# v7 would launch 96 threads) and 128 threads hold the wider row: not float32 rows of 8192 (16
# vectors per thread at 128 threads; v9's 256-thread kernel), separate tensors or 1.9-wave calls.
@pytest.mark.parametrize("shape, dtype, fused_qkv, fixed",
                         [((2048, 8192, 8192), torch.bfloat16, True, True),
                          ((4096, 6144, 1024), torch.bfloat16, True, True),
                          ((2048, 4096, 1024), torch.float32, True, True),
                          ((2048, 8192, 8192), torch.float32, True, False),
                          ((2048, 8192, 8192), torch.bfloat16, False, False),
                          ((1023, 5120, 1024), torch.bfloat16, True, False)],
                         ids=["2048x8192-fused", "4096x6144x1024-fused", "2048x4096x1024-fp32-fused",
                              "2048x8192-fp32-fused", "2048x8192-separate", "1023x5120x1024-fused"])
def test_v12_dispatch(shape, dtype, fused_qkv, fixed):
    def picked(names):  # one v3 kernel, its kBlockThreads as expected
        v3 = v3_kernel_args(names)
        return len(v3) == 1 and v3[0][8] == ("128" if fixed else "0")

    check_dispatch(OP, 12, zero_row_inputs(shape, dtype, fused_qkv), picked)


# v13 launches every kernel of launch_v7_if_rows_fill_gpu with kWarmOwnRow (its last template
# argument): calls of a wave of CTAs or more, on either grid, in both dtypes; how many CTAs warm
# is a launch parameter (none past kV13MaxCallBytes), so 8192 x 8192 (512 MiB) launches the same
# kernel. Not at one token (below a wave) nor at narrow rows of many tokens (v8's warp per token).
@pytest.mark.parametrize("shape, dtype, fused_qkv, warm",
                         [((2048, 8192, 8192), torch.bfloat16, True, True),
                          ((1025, 4096, 4096), torch.bfloat16, True, True),
                          ((2048, 8192, 8192), torch.float32, True, True),
                          ((2048, 8192, 8192), torch.bfloat16, False, True),
                          ((8192, 8192, 8192), torch.bfloat16, True, True),
                          ((1, 8192, 8192), torch.bfloat16, True, False),
                          ((8192, 2048, 256), torch.bfloat16, True, False)],
                         ids=["2048x8192-fused", "1025x4096-fused", "2048x8192-fp32-fused", "2048x8192-separate",
                              "8192x8192-fused", "1x8192", "8192x2048x256-fused"])
def test_v13_dispatch(shape, dtype, fused_qkv, warm):
    def picked(names):  # one warming v3 kernel, or none that warms
        v3 = v3_kernel_args(names)
        return (len(v3) == 1 and v3[0][9] == "true") if warm else all(args[9] == "false" for args in v3)

    check_dispatch(OP, 13, zero_row_inputs(shape, dtype, fused_qkv), picked)


# v14 launches v3's two-vector kernel warming its row (its second and last template arguments)
# off v9's token-major grid, at rows of 513 to 1024 vectors (4097-8192 bf16, 2049-4096 float32)
# with q and k within 2x of each other, in calls of a wave of v7's CTAs or more: fused views below
# three waves, separate tensors at any count. Not on the token-major grid (2048 x 8192 fused), not
# past the width ratio (8192/4088 bf16: 1024 against 511 vectors; GQA 6144/1024), not at 4096 bf16
# (4 vectors per thread in v7's CTA) nor below a wave (one token).
@pytest.mark.parametrize("shape, dtype, fused_qkv, v3_cta",
                         [((1536, 8192, 8192), torch.bfloat16, True, True),
                          ((2048, 8192, 8192), torch.bfloat16, False, True),
                          ((1536, 8192, 4096), torch.bfloat16, False, True),
                          ((1024, 7168, 7168), torch.bfloat16, False, True),
                          ((2048, 4096, 4096), torch.float32, False, True),
                          ((2048, 8192, 8192), torch.bfloat16, True, False),
                          ((1536, 8192, 4088), torch.bfloat16, False, False),
                          ((1024, 6144, 1024), torch.bfloat16, True, False),
                          ((2048, 4096, 4096), torch.bfloat16, False, False),
                          ((1, 8192, 8192), torch.bfloat16, False, False)],
                         ids=["1536x8192-fused", "2048x8192-separate", "1536x8192x4096-separate",
                              "1024x7168-separate", "2048x4096-fp32-separate", "2048x8192-fused",
                              "1536x8192x4088-separate", "1024x6144x1024-fused", "2048x4096-separate", "1x8192"])
def test_v14_dispatch(shape, dtype, fused_qkv, v3_cta):
    def picked(names):  # one v3 kernel at two vectors per thread warming its row, or no such kernel
        v14_kernel = lambda args: args[1] == "2" and args[9] == "true"  # noqa: E731
        v3 = v3_kernel_args(names)
        return (len(v3) == 1 and v14_kernel(v3[0])) if v3_cta else not any(v14_kernel(args) for args in v3)

    check_dispatch(OP, 14, zero_row_inputs(shape, dtype, fused_qkv), picked)


# v13's first CTAs prefetch their rows before griddepcontrol.wait, while the kernel before them
# may still be writing those rows. Two calls chained on the same tensors (the second normalizes
# the first's output), eagerly and replayed from a CUDA graph, must give v12's bytes exactly (the
# same arithmetic): a load moved before the wait would read the first call's input instead.
@pytest.mark.parametrize("shape", [(2048, 4096, 1024), (1025, 4096, 4096)], ids=["many-waves", "two-waves"])
def test_v13_chained_calls_read_the_previous_calls_output(shape):
    from cookbook import cuda

    cuda.load(OP)
    inputs = contract.make_inputs(*shape, torch.bfloat16, "cuda", seed=5, fused_qkv=True)

    def twice(x, version):
        for _ in range(2):
            cuda.cross_head_norm(x["q"], x["k"], x["q_weight"], x["k_weight"], 1e-6, 0.0, "fused", version=version)

    expected = clone_inputs(inputs)
    twice(expected, 12)
    eager = clone_inputs(inputs)
    twice(eager, 13)
    static = clone_inputs(inputs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        twice(static, 13)
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
    stride = 2**31 + 8 * hidden  # elements; keeps 16-byte alignment so v3 takes its vector path
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


def test_cuda_graph_capture_and_replay():
    inputs = contract.make_inputs(256, 8192, 1024, torch.bfloat16, "cuda", seed=3, fused_qkv=True)
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


@pytest.mark.parametrize("version", [impl.version for impl in registry.implementations(OP, ("cuda",))])
def test_opcheck(version):
    from cookbook import cuda

    cuda.load(OP)
    inputs = contract.make_inputs(16, 2048, 512, torch.bfloat16, "cuda", seed=4)
    args = (inputs["q"], inputs["k"], inputs["q_weight"], inputs["k_weight"], 1e-6, 0.0, False, version)
    torch.library.opcheck(torch.ops.cookbook.cross_head_norm.default, args)


def test_auto_backend_is_the_last_cuda_version():
    assert registry.resolve(OP, "auto", "cuda") is registry.latest(OP, "cuda")


SANITIZED = """
import torch, cookbook, cookbook.cuda
from cookbook import registry
from cookbook.ops import cross_head_norm as contract
for version in [impl.version for impl in registry.implementations("cross_head_norm", ("cuda",))]:
    for fused in (False, True):
        for q_hidden, k_hidden in ((4096, 1024), (32776, 96)):
            x = contract.make_inputs(3, q_hidden, k_hidden, torch.bfloat16, "cuda", seed=version, fused_qkv=fused)
            cookbook.cuda.cross_head_norm(x["q"], x["k"], x["q_weight"], x["k_weight"], 1e-6, 0.0, "fused", version=version)
    x = contract.make_inputs(801, 256, 64, torch.bfloat16, "cuda", seed=version, fused_qkv=True)  # v8's warp per token
    cookbook.cuda.cross_head_norm(x["q"], x["k"], x["q_weight"], x["k_weight"], 1e-6, 0.0, "fused", version=version)
    x = contract.make_inputs(1100, 4096, 1024, torch.bfloat16, "cuda", seed=version, fused_qkv=True)  # a wave or more
    cookbook.cuda.cross_head_norm(x["q"], x["k"], x["q_weight"], x["k_weight"], 1e-6, 0.0, "fused", version=version)
    x = contract.make_inputs(1100, 7176, 6144, torch.bfloat16, "cuda", seed=version)  # v14's v3 CTA, partly filled
    cookbook.cuda.cross_head_norm(x["q"], x["k"], x["q_weight"], x["k_weight"], 1e-6, 0.0, "fused", version=version)
x = contract.make_inputs(3, 130, 64, torch.float16, "cuda", fused_qkv=True)
cookbook.cross_head_norm(**x, backend="cuda", rounding="hf")
torch.cuda.synchronize()
print("sanitized run done")
"""


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not on PATH")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_compute_sanitizer(tool):
    from cookbook import cuda

    cuda.load(OP)  # build outside the sanitizer (much faster), the child reuses the cache
    run = subprocess.run(
        ["compute-sanitizer", "--tool", tool, "--error-exitcode", "1", sys.executable, "-c", SANITIZED],
        capture_output=True, text=True, timeout=600,
    )
    clean = "ERROR SUMMARY: 0 errors" in run.stdout or "RACECHECK SUMMARY: 0 hazards displayed (0 errors" in run.stdout
    assert run.returncode == 0 and clean, run.stdout[-4000:] + run.stderr[-2000:]
