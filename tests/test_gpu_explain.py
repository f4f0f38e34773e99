"""`cookbook.explain` on a real GPU: the answer from the GPU's own launcher (the tuned extension's
explain op) equals the answer of the policy compiled for the host for this GPU (its SMs and
limits, registers from nvcc's report), at every bench shape and over a sweep of shapes, so the two
cannot drift; and the kernel explained is the kernel the call launches.

Skipped on machines without a CUDA GPU (CI); needs nvcc (the extension's build needs it too)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import cookbook
from cookbook import explainer
from cookbook.ops import qk_norm as contract
from cookbook.ops import tp_qk_norm as tp_contract
from helpers import ON_GPU, launched_kernels

pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def both_answers(inputs, **kwargs):
    on_gpu = explainer.explain("qk_norm", *inputs.values(), **kwargs)
    on_host = explainer.explain("qk_norm", *inputs.values(), gpu=explainer.Gpu.of_device(), **kwargs)
    return on_gpu, on_host


def assert_same_plan(on_gpu, on_host):
    """The same plan, key by key. Registers: the GPU's are its build's ptxas, the host's the local
    nvcc's (a patch release apart they can differ by a register or two); what the policy reads of
    them, the resident CTAs, is in the plan and compared."""
    gpu_plan, host_plan = ({k: v for k, v in e.plan.items() if k != "registers"} for e in (on_gpu, on_host))
    assert gpu_plan == host_plan, (on_gpu.plan, on_host.plan)
    assert int(on_gpu.plan["registers"]) > 0 and int(on_host.plan["registers"]) > 0


def assert_same(inputs, **kwargs):
    on_gpu, on_host = both_answers(inputs, **kwargs)
    assert on_gpu.source.startswith("the GPU") and on_host.source.startswith("the policy compiled for the host")
    assert_same_plan(on_gpu, on_host)
    return on_gpu


@pytest.mark.parametrize("shape", contract.BENCH_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rounding", ["fused", "hf"])
def test_bench_shapes_answer_the_same_on_gpu_and_host(shape, rounding):
    inputs = contract.make_inputs(*shape, torch.bfloat16, "cuda", seed=1, fused_qkv=True)
    answer = assert_same(inputs, rounding=rounding)
    names = launched_kernels(lambda: cookbook.qk_norm(**inputs, rounding=rounding, backend="cuda"))
    launched = {explainer._split_template(name) for name in names}
    assert (answer.plan["kernel"], answer.plan["template_values"]) in launched, (answer.plan, names)


HEAD_DIMS = [2, 34, 64, 80, 96, 100, 112, 128, 160, 192, 256, 512, 1024]


@given(tokens=st.integers(0, 6000), q_heads=st.integers(1, 40), kv_heads=st.integers(1, 8),
       head_dim=st.sampled_from(HEAD_DIMS), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       rounding=st.sampled_from(["fused", "hf"]), fused_qkv=st.booleans(), offset=st.sampled_from([0, 1, 8]),
       weight=st.sampled_from(["same", "float32", "float32 misaligned"]))
def test_any_call_answers_the_same_on_gpu_and_host(tokens, q_heads, kv_heads, head_dim, dtype, rounding, fused_qkv,
                                                   offset, weight):
    """Shapes across the policy's edges (less than a wave to several), every head_dim class
    (vector, padded, none), dtypes, layouts, rows and weights on and off 16-byte boundaries."""
    width = (q_heads + 2 * kv_heads) * head_dim
    if tokens * width > 64 * 2**20:
        tokens = 64 * 2**20 // width
    buffer = torch.empty(tokens * width + offset, dtype=dtype, device="cuda")
    qkv = buffer[offset:].view(tokens, width)
    if fused_qkv:
        q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
        k = qkv[:, q_heads * head_dim: (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    else:
        q = buffer[offset: offset + tokens * q_heads * head_dim].view(tokens, q_heads, head_dim)
        k = torch.empty(tokens, kv_heads, head_dim, dtype=dtype, device="cuda")
    w_dtype = dtype if weight == "same" else torch.float32
    w_buffer = torch.ones(head_dim + 1, dtype=w_dtype, device="cuda")
    w = w_buffer[1:] if weight.endswith("misaligned") else w_buffer[:head_dim]
    assert_same(dict(q=q, k=k, q_weight=w, k_weight=w), rounding=rounding)


# ---- tp_qk_norm: the plan reads the group only as its size, so one GPU asks it at any world ----
TP_WIDTHS = [(6144, 1024), (4096, 512), (2048, 256), (16384, 2048), (256, 64)]


def tp_shards(tokens, q_hidden, k_hidden, world, dtype=torch.bfloat16, offset=0, weight=torch.bfloat16):
    """One rank's shards as views of a fused qkv shard, `offset` elements into its buffer."""
    qs, ks = q_hidden // world, k_hidden // world
    buffer = torch.empty(tokens * (qs + 2 * ks) + offset, dtype=dtype, device="cuda")
    qkv = buffer[offset:].view(tokens, qs + 2 * ks)
    return [qkv[:, :qs], qkv[:, qs: qs + ks], torch.ones(qs, dtype=weight, device="cuda"),
            torch.ones(ks, dtype=weight, device="cuda")]


def assert_tp_same(shards, world, **kwargs):
    on_gpu = explainer.explain("tp_qk_norm", *shards, world=world, **kwargs)
    on_host = explainer.explain("tp_qk_norm", *shards, world=world, gpu=explainer.Gpu.of_device(), **kwargs)
    assert on_gpu.source.startswith("the GPU") and on_host.source.startswith("the policy compiled for the host")
    assert_same_plan(on_gpu, on_host)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("shape", tp_contract.BENCH_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tp_bench_shapes_answer_the_same_on_gpu_and_host(shape, world):
    assert_tp_same(tp_shards(*shape, world), world, rounding="hf")


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(0, 40000), widths=st.sampled_from(TP_WIDTHS), world=st.sampled_from([2, 3, 4, 8]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), rounding=st.sampled_from(["fused", "hf"]),
       offset=st.sampled_from([0, 1]), fp32_weights=st.booleans())
def test_tp_any_call_answers_the_same_on_gpu_and_host(tokens, widths, world, dtype, rounding, offset, fp32_weights):
    """Across the lean band's edge, the walk's resident grid, chunks past the workspace's capacity,
    every dtype, unaligned shards and float32 weights."""
    q_hidden, k_hidden = widths
    if q_hidden % (2 * world) or k_hidden % (2 * world):
        q_hidden, k_hidden = q_hidden * 3, k_hidden * 3  # world 3: shards of even width
    tokens = min(tokens, 64 * 2**20 // (q_hidden + 2 * k_hidden))
    shards = tp_shards(tokens, q_hidden, k_hidden, world, dtype, offset, torch.float32 if fp32_weights else dtype)
    assert_tp_same(shards, world, rounding=rounding)
