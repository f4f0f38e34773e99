"""qk_norm_rope on a real GPU: diffusion shapes for every version, torch.compile, CUDA graphs,
opcheck, compute-sanitizer.

Skipped on machines without a CUDA GPU (CI); run on an H100/H200 through the device tool."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

import cookbook
from cookbook import registry
from cookbook.ops import qk_norm_rope as contract
from helpers import ON_GPU, clone_inputs, kernel_impls, launched_kernels, require, run_and_compare

pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
OP = "qk_norm_rope"

# (tokens, q heads, kv heads, head_dim, rope_dim, is_neox): FLUX, Qwen-Image (full and partial
# rope), decode with GQA, an interleaved case, a wide head with a non-power-of-two rope_dim.
SHAPES = [
    (4096, 24, 24, 128, 128, True),
    (4096, 24, 24, 128, 128, False),
    (4096, 32, 32, 128, 64, True),
    (64, 32, 8, 128, 128, True),
    (333, 5, 1, 256, 96, True),
    (7, 3, 1, 512, 384, False),
    (129, 4, 2, 96, 80, True),
]


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rounding", ["fused", "hf"])
def test_shapes_at_scale(impl, shape, dtype, rounding):
    require(impl)
    t, hq, hk, d, rope_dim, is_neox = shape
    inputs = contract.make_inputs(t, hq, hk, d, rope_dim, is_neox, dtype, "cuda", seed=11, fused_qkv=True,
                                  position_dtype=torch.int32, position_offset=7)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.0, rounding=rounding)


def _shifted(t, elements):
    """A copy of `t` that starts `elements` past a fresh allocation: contiguous but not 16-byte
    aligned, so the vector paths must step aside for the general one."""
    flat = torch.zeros(t.numel() + elements, dtype=t.dtype, device=t.device)
    view = flat[elements:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("table", ["cos_sin_cache", "weights"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_neox", [True, False])
def test_misaligned_cache_and_weights(impl, table, cache_dtype, is_neox):
    require(impl)
    inputs = contract.make_inputs(300, 6, 2, 128, 128, is_neox, torch.bfloat16, "cuda", seed=5, fused_qkv=True,
                                  cache_dtype=cache_dtype, weight_dtype=torch.float32)
    if table == "cos_sin_cache":
        inputs["cos_sin_cache"] = _shifted(inputs["cos_sin_cache"], 1)
    else:
        inputs["q_weight"] = _shifted(inputs["q_weight"], 1)
        inputs["k_weight"] = _shifted(inputs["k_weight"], 3)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.0, rounding="fused")


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rounding", ["fused", "hf"])
def test_cache_in_activation_dtype(impl, dtype, is_neox, rounding):
    require(impl)
    inputs = contract.make_inputs(515, 8, 2, 128, 64, is_neox, dtype, "cuda", seed=6, fused_qkv=True, cache_dtype=dtype,
                                  weight_dtype=dtype)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=1.0, rounding=rounding)


def _public(inputs):
    inputs = dict(inputs)
    rope = inputs.pop("rope")
    return inputs, dict(is_neox=rope.is_neox, rope_dim=rope.rope_dim, position_offset=rope.position_offset)


def test_torch_compile_fullgraph():
    tensors, kwargs = _public(contract.make_inputs(64, 8, 2, 128, 64, True, torch.bfloat16, "cuda", seed=2, fused_qkv=True))
    eager = clone_inputs(tensors)
    cookbook.qk_norm_rope(**eager, **kwargs, backend="cuda")

    @torch.compile(fullgraph=True)
    def step(q, k, q_weight, k_weight, cos_sin_cache, positions):
        return cookbook.qk_norm_rope(q, k, q_weight, k_weight, cos_sin_cache, positions, **kwargs, backend="cuda")

    step(**tensors)
    assert torch.equal(tensors["q"], eager["q"]) and torch.equal(tensors["k"], eager["k"])


@pytest.mark.parametrize("version", [1, 3, 4, 5, 7, 8])
def test_cuda_graph_capture_and_replay(version):
    tensors, kwargs = _public(contract.make_inputs(256, 8, 2, 128, 128, False, torch.bfloat16, "cuda", seed=3, fused_qkv=True))
    impl = registry.get(OP, f"cuda_v{version}")

    def call(t):
        a = contract.check_inputs(**t, eps=1e-6, weight_offset=0.0, rounding="fused", rope=contract.Rope(**kwargs))
        impl.fn(a.q, a.k, a.q_weight, a.k_weight, a.cos_sin_cache, a.positions, a.eps, a.weight_offset, a.rounding,
                a.is_neox, a.rope_dim, a.position_offset)

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


# qk_norm_rope_v5_kernel<T, head_dim, hf, neox, programmatic, walk>: walk 0 is v4's, 1 v7's with the
# launcher's steps, 2 one row per lane group (v7 where the rows fit in one trip of the grid), 3 the
# same with the tables warmed before the wait (v8).
@pytest.mark.parametrize("version, tokens, is_neox, walk", [
    (7, 4096, True, 1), (7, 4096, False, 1), (7, 64, True, 2), (7, 1, False, 2), (6, 4096, True, 0), (6, 64, True, 0),
    (8, 4096, True, 1), (8, 64, True, 3), (8, 1, False, 3), (9, 64, True, 3)])
def test_v7_dispatch(version, tokens, is_neox, walk):
    """v7 walks a persistent grid with the launcher's steps where the rows need several trips of
    it (4096 tokens x 48 heads), and gives each lane group one row where they fit in one (decode);
    v8 warms the tables of that one-row kernel only, and v9 keeps it."""
    from cookbook import cuda

    cuda.load(OP)
    x = contract.make_inputs(tokens, 24, 24, 128, 128, is_neox, torch.bfloat16, "cuda", seed=5)
    names = launched_kernels(lambda: cuda.qk_norm_rope(x["q"], x["k"], x["q_weight"], x["k_weight"], x["cos_sin_cache"],
                                                       x["positions"], 1e-6, 0.0, "fused", is_neox, 128, 0,
                                                       version=version))
    kernel = f"qk_norm_rope_v5_kernel<__nv_bfloat16, 128, false, {str(is_neox).lower()}, true, {walk}>"
    assert any(kernel in name for name in names), names


def test_opcheck():
    from cookbook import cuda

    cuda.load(OP)
    x = contract.make_inputs(16, 4, 2, 128, 64, True, torch.bfloat16, "cuda", seed=4)
    args = (x["q"], x["k"], x["q_weight"], x["k_weight"], x["cos_sin_cache"], x["positions"], 1e-6, 0.0, True, 64, 0,
            False, 3)
    torch.library.opcheck(torch.ops.cookbook.qk_norm_rope.default, args)


def test_auto_backend_is_the_last_cuda_version():
    assert registry.resolve(OP, "auto", "cuda") is registry.latest(OP, "cuda")


SANITIZED = """
import torch, cookbook, cookbook.cuda
from cookbook import registry
from cookbook.ops import qk_norm_rope as contract
for version in [impl.version for impl in registry.implementations("qk_norm_rope", ("cuda",))]:
    # 700 tokens x 32 heads: more rows than a persistent grid holds, so the row walks take
    # several steps and stop at the last row.
    for tokens, is_neox in ((5, False), (5, True), (700, True)):
        x = contract.make_inputs(tokens, 24, 8, 128, 64, is_neox, torch.bfloat16, "cuda", seed=version, fused_qkv=True,
                                 max_position=tokens + 1)
        x["positions"][0] = 100000  # out of range: must read nothing
        cookbook.cuda.qk_norm_rope(x["q"], x["k"], x["q_weight"], x["k_weight"], x["cos_sin_cache"], x["positions"],
                                   1e-6, 0.0, "fused", is_neox, 64, 0, version=version)
torch.cuda.synchronize()
print("sanitized run done")
"""


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not on PATH")
def test_compute_sanitizer_memcheck():
    from cookbook import cuda

    cuda.load(OP)
    run = subprocess.run(
        ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1", sys.executable, "-c", SANITIZED],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0 and "ERROR SUMMARY: 0 errors" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]


# qk_norm_rope_v9_kernel<T, head_dim, hf, neox, weight storage, cache storage>: v9's walk, compiled
# per storage pair, where the rows need several trips of the grid (4096 tokens x 48 heads).
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("weight_dtype, cache_dtype, pair", [
    (None, torch.float32, "__nv_bfloat16, float"), (torch.float32, torch.bfloat16, "float, __nv_bfloat16")])
def test_v9_dispatch(is_neox, weight_dtype, cache_dtype, pair):
    from cookbook import cuda

    cuda.load(OP)
    x = contract.make_inputs(4096, 24, 24, 128, 128, is_neox, torch.bfloat16, "cuda", seed=5, weight_dtype=weight_dtype,
                             cache_dtype=cache_dtype)
    names = launched_kernels(lambda: cuda.qk_norm_rope(x["q"], x["k"], x["q_weight"], x["k_weight"], x["cos_sin_cache"],
                                                       x["positions"], 1e-6, 0.0, "fused", is_neox, 128, 0, version=9))
    kernel = f"qk_norm_rope_v9_kernel<__nv_bfloat16, 128, false, {str(is_neox).lower()}, {pair}>"
    assert any(kernel in name for name in names), names


# v9's walk reads a lane group's weight once, from its first row's head: every head of both
# tensors must come out with its own tensor's weight. q's and k's weights far apart, head
# counts whose grid of whole tokens is close to the resident one (32 + 8 heads) and one where it
# may not be (40 + 1: with four blocks per SM on 132 SMs the cut keeps 492 of 528 and v8's walk
# runs; with five it keeps 656 of 660), 16-bit and float32 weights, both roundings, both layouts,
# zero rows at eps = 0, an odd token count.
@pytest.mark.parametrize("heads", [(32, 8), (40, 1)], ids=["40_heads", "41_heads"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rounding", ["fused", "hf"])
@pytest.mark.parametrize("weight_dtype", [None, torch.float32], ids=["weights_bf16", "weights_fp32"])
def test_v9_held_weights(heads, is_neox, rounding, weight_dtype):
    impl = registry.get(OP, "cuda_v9")
    require(impl)
    inputs = contract.make_inputs(2049, *heads, 128, 128, is_neox, torch.bfloat16, "cuda", seed=19, fused_qkv=True,
                                  kind="zero_rows", position_offset=5, weight_dtype=weight_dtype)
    inputs["q_weight"].copy_(torch.linspace(0.25, 2.0, 128, device="cuda"))
    inputs["k_weight"].copy_(torch.linspace(-1.5, -0.125, 128, device="cuda"))
    run_and_compare(OP, impl, inputs, eps=0.0, weight_offset=0.5, rounding=rounding)
