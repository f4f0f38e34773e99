"""qk_norm_rope_cache on a real GPU: every rung and the tuned kernel at decode and prefill sizes, odd
shapes, both caches (FP8 stored bytes equal to torch's conversion of the k each kernel wrote, bit
for bit), skipped and out-of-range slots untouched, strided caches and rows off 16-byte
boundaries (the split path); the tuned kernel's policy (the kernel a call launches is the one its
plan names; the GPU's explain equals the host's); torch.compile, CUDA graphs, opcheck,
compute-sanitizer.

Skipped on machines without a CUDA GPU (CI); run on an H100/H200."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys

import pytest
import torch

import cookbook
from cookbook import registry
from cookbook.ops import qk_norm_rope_cache as contract
from helpers import ON_GPU, fields, kernel_impls, launched_kernels, require
from test_qk_norm_rope_cache import _as_bits, _clone, _public, check_run

pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
OP = "qk_norm_rope_cache"
FP8 = contract.FP8
COMPILED = [pytest.param(impl, id=impl.name) for impl in registry.implementations(OP, registry.COMPILED_LEVELS)]

# (tokens, q heads, kv heads, head_dim, rope_dim, is_neox): Qwen3-8B decode and prefill, partial
# and interleaved rope, head_dim 64 and 256, and what the vector kernels do not compile (head_dim
# 96, rope_dim 24: the split path).
SHAPES = [
    (1, 32, 8, 128, 128, True),
    (256, 32, 8, 128, 128, True),
    (4096, 32, 8, 128, 128, True),
    (333, 5, 1, 256, 96, False),
    (3001, 7, 3, 64, 32, True),
    (129, 4, 2, 96, 80, True),
    (65, 6, 2, 128, 24, True),
]


def _inputs(shape, fp8, dtype=torch.bfloat16, seed=11, **kwargs):
    t, hq, hk, d, rope_dim, is_neox = shape
    return contract.make_inputs(t, hq, hk, d, fp8, dtype, "cuda", rope_dim=rope_dim, is_neox=is_neox, seed=seed,
                                fused_qkv=True, **kwargs)


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("fp8", [False, True], ids=["act_cache", "fp8_cache"])
@pytest.mark.parametrize("dtype, rounding", [(torch.bfloat16, "fused"), (torch.bfloat16, "hf"), (torch.float16, "fused"),
                                             (torch.float32, "fused")], ids=lambda v: str(v).removeprefix("torch."))
def test_shapes_at_scale(impl, shape, fp8, dtype, rounding):
    require(impl)
    inputs = _inputs(shape, fp8, dtype, skipped=shape[0] // 7, slot_dtype=torch.int32, position_dtype=torch.int32)
    check_run(impl.fn, inputs, rounding=rounding, name=impl.name)


@pytest.mark.parametrize("impl", COMPILED)
@pytest.mark.parametrize("fp8", [False, True], ids=["act_cache", "fp8_cache"])
def test_every_table_storage_and_layout(impl, fp8):
    for seed, (weights, cos_sin, is_neox) in enumerate([(torch.float32, torch.float32, True), (None, torch.bfloat16, False),
                                                        (torch.float32, torch.bfloat16, True), (None, torch.float32, False)]):
        inputs = _inputs((77, 8, 2, 128, 128, is_neox), fp8, seed=seed, weight_dtype=weights, cos_sin_dtype=cos_sin)
        check_run(impl.fn, inputs, weight_offset=1.0, name=impl.name)


@pytest.mark.parametrize("impl", COMPILED)
@pytest.mark.parametrize("block_size", [1, 3, 16, 544])
def test_any_block_size(impl, block_size):
    """A slot's block and offset for any block_size (the tuned kernel divides by multiply-high)."""
    inputs = _inputs((300, 8, 2, 128, 128, True), block_size % 2 == 1, seed=block_size, block_size=block_size)
    check_run(impl.fn, inputs, name=impl.name)


@pytest.mark.parametrize("impl", COMPILED)
def test_minus_one_and_out_of_range_slots_are_untouched(impl):
    inputs = _inputs((64, 8, 2, 128, 128, True), True, seed=5, block_size=16, num_blocks=8)
    slots = torch.arange(64, device="cuda") * 2
    slots[::3] = -1
    slots[1] = 8 * 16 + 5  # out of range: written nowhere
    inputs["slot_mapping"] = slots
    before = {c: inputs[c].clone() for c in ("k_cache", "v_cache")}
    check_run(impl.fn, inputs, name=impl.name)
    written = set(slots[(slots >= 0) & (slots < 128)].tolist())
    for c in ("k_cache", "v_cache"):
        changed = (_as_bits(inputs[c]) != _as_bits(before[c])).flatten(2).any(-1).flatten().nonzero().view(-1).tolist()
        assert set(changed) <= written, f"{c}: slots {sorted(set(changed) - written)} written"


@pytest.mark.parametrize("impl", COMPILED)
def test_caches_as_views_of_one_kv_tensor_and_rows_off_16_bytes(impl):
    """vLLM's [blocks, 2, block_size, heads, head_dim] kv tensor (k and v caches: strided views), and
    q, k, v one element off 16-byte boundaries (every kernel then takes the split path)."""
    inputs = _inputs((300, 8, 2, 128, 128, True), True, seed=6, block_size=16)
    kv = torch.zeros((inputs["k_cache"].shape[0], 2, *inputs["k_cache"].shape[1:]), dtype=FP8, device="cuda")
    inputs["k_cache"], inputs["v_cache"] = kv[:, 0], kv[:, 1]
    check_run(impl.fn, inputs, name=impl.name)
    qkv = torch.randn(300, 1 + 12 * 128, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    inputs = _inputs((300, 8, 2, 128, 128, True), False, seed=7)
    inputs["q"] = qkv[:, 1: 1 + 8 * 128].view(300, 8, 128)
    inputs["k"] = qkv[:, 1 + 8 * 128: 1 + 10 * 128].view(300, 2, 128)
    inputs["v"] = qkv[:, 1 + 10 * 128:].view(300, 2, 128)
    check_run(impl.fn, inputs, name=impl.name)


def test_fp8_bytes_equal_torchs_conversion_at_saturation():
    """k and v far past 448 * scale and tiny (e4m3 subnormals): every kernel's bytes are torch's."""
    for impl in registry.implementations(OP, ("numba",) + registry.COMPILED_LEVELS):
        inputs = _inputs((256, 8, 2, 128, 128, True), True, seed=8, kind="huge")
        inputs["k_scale"].fill_(1e-3)
        inputs["v_scale"].fill_(1e-7)
        check_run(impl.fn, inputs, name=impl.name)
        inputs = _inputs((256, 8, 2, 128, 128, False), True, seed=9, kind="tiny")
        inputs["v_scale"].fill_(1e-12)
        check_run(impl.fn, inputs, name=impl.name)


def _every_value(dtype, n):
    """n values of dtype: every finite bf16 or fp16 value and both infinities (NaN patterns as 1),
    or random float32 bits (NaN as 1)."""
    if dtype == torch.float32:
        bits = torch.randint(-2**31, 2**31, (n,), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
        x = bits.to(torch.int32).view(torch.float32)
    else:
        x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    assert x.numel() == n
    return torch.where(torch.isnan(x), torch.ones_like(x), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_fp8_bytes_equal_torchs_for_every_value_and_scale(dtype):
    """v holds every bf16 or fp16 value (float32: random bits), at scales across float32's range,
    negative, subnormal, zero and infinite ones too: every kernel's bytes are torch's (the tuned
    kernel multiplies by the scale's inverse and corrects the product; the others divide)."""
    t, hk, d = 64, 8, 128
    values = _every_value(dtype, t * hk * d)
    scales = [1.0, 0.1, -0.37, 1 / 448, 3.0e-5, 2.0**-70, 3.0e-39, 2.0**-149, 7.0e30, 3.0e38, 0.0, float("inf")]
    for impl in registry.implementations(OP, ("numba",) + registry.COMPILED_LEVELS):
        for scale in scales:
            inputs = contract.make_inputs(t, 8, hk, d, True, dtype, "cuda", seed=12, fused_qkv=True)
            v = values.clone()
            if scale == 0.0:  # 0 / 0 is a NaN, whose sign no contract fixes
                v = torch.where(v == 0, torch.ones_like(v), v)
            if scale == float("inf"):  # inf / inf too
                v = torch.where(torch.isinf(v), torch.ones_like(v), v)
            inputs["v"].copy_(v.view(t, hk, d))
            inputs["k_scale"].fill_(scale if math.isfinite(scale) and scale != 0.0 else 1.0)
            inputs["v_scale"].fill_(scale)
            check_run(impl.fn, inputs, name=f"{impl.name} (scale {scale!r})")


# ---- the tuned kernel's policy: what it launches is what its plan names ------------------------
def _plan(a):
    from cookbook import cuda

    cuda.load_extension(registry.get(OP, "cuda_tuned").extension)
    text = torch.ops.cookbook.qk_norm_rope_cache_tuned_explain(
        a.q, a.k, a.v, a.q_weight, a.k_weight, a.cos_sin_cache, a.positions, a.k_cache, a.v_cache, a.slot_mapping,
        a.k_scale, a.v_scale, a.eps, a.weight_offset, a.is_neox, a.rope_dim, a.rounding == "hf")
    return dict(line.split("=", 1) for line in text.strip().splitlines())


@pytest.mark.parametrize("shape, path", [((1, 32, 8, 128, 128, True), "one_pass"), ((8192, 32, 8, 128, 128, True), "one_pass"),
                                         ((64, 16, 4, 256, 256, False), "one_pass"), ((64, 6, 2, 96, 96, True), "split"),
                                         ((64, 6, 2, 128, 24, True), "split")],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
@pytest.mark.parametrize("fp8", [False, True], ids=["act_cache", "fp8_cache"])
def test_tuned_launches_what_its_plan_names(shape, path, fp8):
    from cookbook import explainer

    impl = registry.get(OP, "cuda_tuned")
    inputs = _inputs(shape, fp8, seed=shape[0])
    a = contract.check_inputs(**inputs, eps=1e-6, weight_offset=0.0, rounding="fused")
    plan = _plan(a)
    names = launched_kernels(lambda: impl.fn(*fields(a)))
    assert plan["path"] == path and (plan["kernel"], plan["template_values"]) in {
        explainer._split_template(n) for n in names}, (plan, names)
    check_run(impl.fn, _inputs(shape, fp8, seed=shape[0] + 1), name=impl.name)


@pytest.mark.parametrize("shape", contract.BENCH_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_gpus_explain_is_the_hosts(shape):
    from cookbook import explainer

    on_gpu = explainer.explain(OP, shape=shape)
    on_host = explainer.explain(OP, shape=shape, sms=torch.cuda.get_device_properties(0).multi_processor_count)
    keep = lambda plan: {k: v for k, v in plan.items() if k != "registers"}  # noqa: E731
    assert keep(on_gpu.plan) == keep(on_host.plan)


def test_auto_and_cuda_run_the_tuned_kernel():
    tuned = registry.get(OP, "cuda_tuned")
    assert registry.resolve(OP, "auto", "cuda") is tuned and registry.resolve(OP, "cuda", "cuda") is tuned


# ---- torch.compile, CUDA graphs, opcheck, compute-sanitizer -----------------------------------
@pytest.mark.parametrize("fp8", [False, True], ids=["act_cache", "fp8_cache"])
def test_torch_compile_fullgraph(fp8):
    tensors, kwargs = _public(_inputs((64, 8, 2, 128, 64, True), fp8, seed=2))
    eager = _clone(tensors)
    cookbook.qk_norm_rope_cache(**eager, **kwargs, backend="cuda")

    @torch.compile(fullgraph=True)
    def step(t):
        return cookbook.qk_norm_rope_cache(**t, **kwargs, backend="cuda")

    step(tensors)
    for name in ("q", "k", "k_cache", "v_cache"):
        assert torch.equal(_as_bits(tensors[name]), _as_bits(eager[name])), name


@pytest.mark.parametrize("impl", COMPILED)
@pytest.mark.parametrize("tokens", [8, 3001])
def test_cuda_graph_capture_and_replay(impl, tokens):
    """Every compiled kernel captured in a graph and replayed on new rows, new positions and new
    slots (and a new FP8 scale) in the same buffers."""
    tensors, kwargs = _public(_inputs((tokens, 8, 2, 128, 128, False), True, seed=3))
    rope = contract.Rope(**kwargs)

    def call(t):
        impl.fn(*fields(contract.check_inputs(**t, eps=1e-6, weight_offset=0.0, rounding="fused", rope=rope)))

    static = _clone(tensors)
    call(_clone(tensors))  # build and load outside capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        call(static)
    torch.cuda.current_stream().wait_stream(stream)
    fresh = _clone(tensors)
    fresh["positions"] = tensors["positions"].flip(0).contiguous()
    fresh["slot_mapping"] = tensors["slot_mapping"].flip(0).contiguous()
    fresh["k_scale"] = tensors["k_scale"] * 2
    for name, t in fresh.items():
        static[name].copy_(t)
    graph.replay()
    call(fresh)
    torch.cuda.synchronize()
    for name in ("q", "k", "k_cache", "v_cache"):
        assert torch.equal(_as_bits(static[name]), _as_bits(fresh[name])), name


@pytest.mark.parametrize("impl", COMPILED)
@pytest.mark.parametrize("fp8", [False, True], ids=["act_cache", "fp8_cache"])
def test_opcheck(impl, fp8):
    from cookbook import cuda

    op = cuda.load_extension(impl.extension)
    x = _inputs((16, 4, 2, 128, 64, True), fp8, seed=4)
    args = (x["q"], x["k"], x["v"], x["q_weight"], x["k_weight"], x["cos_sin_cache"], x["positions"], x["k_cache"],
            x["v_cache"], x["slot_mapping"], x.get("k_scale"), x.get("v_scale"), 1e-6, 0.0, True, 64, False)
    # opcheck's schema test compares each argument before and after the call with torch.allclose,
    # which torch does not implement for float8 tensors on CUDA ("mul_cuda" not implemented for
    # 'Float8_e4m3fn'); the schema is the same for both caches, so the activation-dtype case tests it.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic") if fp8 else \
        ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op.default, args, test_utils=utils)


SANITIZED = """
import torch
from cookbook import registry
from cookbook.ops import qk_norm_rope_cache as contract
for impl in registry.implementations("qk_norm_rope_cache", registry.COMPILED_LEVELS):
    # decode and prefill sizes, both caches, slots -1 and out of range (written nowhere), the split path
    for tokens, heads, d, fp8 in ((1, (32, 8), 128, True), (5, (24, 8), 128, False), (3001, (32, 8), 128, True),
                                  (700, (8, 1), 256, False), (33, (4, 2), 96, True)):
        x = contract.make_inputs(tokens, *heads, d, fp8, torch.bfloat16, "cuda", seed=tokens, fused_qkv=True,
                                 skipped=tokens // 3, block_size=16)
        x["slot_mapping"][-1] = 10**9
        a = contract.check_inputs(**x, eps=1e-6, weight_offset=0.0, rounding="fused")
        impl.fn(a.q, a.k, a.v, a.q_weight, a.k_weight, a.cos_sin_cache, a.positions, a.k_cache, a.v_cache,
                a.slot_mapping, a.k_scale, a.v_scale, a.eps, a.weight_offset, a.rounding, a.is_neox, a.rope_dim)
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
