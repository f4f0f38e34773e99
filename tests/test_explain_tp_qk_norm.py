"""`cookbook.explain("tp_qk_norm", ...)` without a GPU: the tuned kernel's policy (policy.h)
compiled for the host answers for one rank's call at a world size, for an H100 (132 SMs, the
kernels' registers from nvcc's report). tests/test_gpu_explain.py proves the answer equal to the
one the GPU's own launcher gives."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import nvcc_jobs
from cookbook import explainer, nvcc_report, tp_workspace
from cookbook.ops import tp_qk_norm as contract

needs_nvcc = pytest.mark.skipif(nvcc_report.nvcc() is None, reason="nvcc not on PATH")
pytestmark = [needs_nvcc, pytest.mark.nvcc("compile_extension", "tp_qk_norm_tuned")]
OP = "tp_qk_norm"
LEAN = "cookbook::tp_qk_norm::v7::lean_rows_kernel"
PAIRED = "cookbook::tp_qk_norm::v8::paired_rows_kernel"
WALK = "cookbook::tp_qk_norm::v5::lagged_rows_kernel"
TILES = ("cookbook::tp_qk_norm::fused_kernel", "cookbook::tp_qk_norm::fused_v3_kernel")
SMS = 132


def ask(tokens, q_hidden=6144, k_hidden=1024, world=2, **kwargs):
    nvcc_jobs.result(nvcc_report.compile_extension, "tp_qk_norm_tuned")  # the report the answer reads
    kwargs.setdefault("gpu", "h100")
    return explainer.explain(OP, shape=(tokens, q_hidden, k_hidden), world=world, **kwargs)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shape", contract.BENCH_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bench_shapes_follow_the_policy(shape, world):
    """At every bench shape, TP=2 and TP=4: up to lean_tokens_per_sm tokens per SM rung 7's kernel
    (a token per CTA) up to its resident CTAs, rung 8's (two tokens per exchange) above them, above it rung 5's walk on exactly its resident grid
    where the call has a token per resident CTA, else rung 4's tiles; the registers of the kernel
    it names."""
    tokens, q_hidden, k_hidden = shape
    p = ask(tokens, q_hidden, k_hidden, world).plan
    vecs = (q_hidden + k_hidden) // world // 8
    assert int(p["vecs"]) == vecs and int(p["tokens_per_sm"]) == -(-tokens // SMS)
    resident = int(p["resident"])
    if -(-tokens // SMS) <= int(p["lean_tokens_per_sm"]):
        if p["kernel"] == LEAN:
            assert int(p["grid"]) == tokens <= resident and int(p["block"]) == max(64, -(-vecs // 32) * 32), p
        else:
            assert p["kernel"] == PAIRED and int(p["grid"]) == min(tokens, resident), p
            assert int(p["block"]) == max(96, -(-vecs // 32) * 32)
            lean_resident = ask(1, q_hidden, k_hidden, world).plan["resident"]
            assert tokens > int(lean_resident), (p, lean_resident)
    elif tokens >= resident:
        assert p["kernel"] == WALK and int(p["grid"]) == resident, p
    else:
        assert p["kernel"] in TILES, p
    kernels = {explainer._split_template(k.kernel): k for k in nvcc_report.compile_extension("tp_qk_norm_tuned")}
    assert int(p["registers"]) == kernels[(p["kernel"], p["template_values"])].registers


def test_world_moves_the_shards_and_the_walk():
    """The same call: shards of 448 vectors at TP=2, 224 at TP=4 (the walk's 4 and 2 vectors per
    thread); at TP=8 above the walk's measured world sizes: the tiles."""
    two, four, eight = (ask(16384, world=w).plan for w in (2, 4, 8))
    assert (two["vecs"], four["vecs"], eight["vecs"]) == ("448", "224", "112")
    assert "kVecsPerThread=4" in two["template_arguments"] and "kVecsPerThread=2" in four["template_arguments"]
    assert eight["kernel"] in TILES and int(eight["lagged_max_world"]) < 8


def test_fewer_sms_move_the_lean_band():
    """Tokens per SM are the GPU's: 1024 tokens are 8 per SM on 132 SMs (the lean band: above rung
    7's 264 resident CTAs of the TP=2 shard, so rung 8's kernel), 16 on 66 (the walk)."""
    assert ask(1024).plan["kernel"] == PAIRED and ask(264).plan["kernel"] == LEAN
    assert ask(1024, gpu=None, sms=66).plan["kernel"] == WALK


def test_unaligned_shards_take_one_element_tiles():
    """A q shard one element into its buffer is off the 16-byte boundary: rung 4's tiles, kElems=1."""
    buffer = torch.empty(64 * (3072 + 512) + 1, dtype=torch.bfloat16, device="meta")
    qkv = buffer[1:].view(64, 3072 + 512)
    q, k = qkv[:, :3072], qkv[:, 3072:]
    w_q, w_k = torch.empty(3072, dtype=torch.bfloat16, device="meta"), torch.empty(512, dtype=torch.bfloat16, device="meta")
    nvcc_jobs.result(nvcc_report.compile_extension, "tp_qk_norm_tuned")
    answer = explainer.explain(OP, q, k, w_q, w_k, world=2, gpu="h100")
    assert answer.plan["kernel"] in TILES and "kElems=1," in answer.plan["template_arguments"]
    assert "one element per pack" in dict(answer.policy)["path"]


def test_a_call_longer_than_the_workspace_is_explained_by_its_first_chunk():
    capacity = tp_workspace.CAPACITY_TOKENS
    answer = ask(capacity + 5)
    assert answer.plan["tokens_per_sm"] == str(-(-capacity // SMS))
    assert "the first of 2 chunks" in dict(answer.policy)["chunk"]


def test_an_empty_call_still_launches():
    """No tokens: one CTA still publishes the header and advances the epoch."""
    answer = ask(0)
    assert answer.plan["grid"] == "1" and answer.plan["kernel"] in TILES
    assert "launch: grid 1 x block 256" in str(answer) and "publishes the header" in str(answer)


@pytest.mark.parametrize("kwargs, message", [
    (dict(shape=(8, 6144, 1024), world=1), "world: expected the group's size"),
    (dict(shape=(8, 6144, 1024), world=9), "world: expected the group's size"),
    (dict(shape=(8, 6144, 1026), world=4), "k_hidden 1026 does not split into 4"),
    (dict(shape=(8, 6144)), "shape: expected 3 sizes"),
])
def test_bad_questions_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        explainer.explain(OP, gpu="h100", **kwargs)


def test_world_is_refused_for_a_single_gpu_op():
    with pytest.raises(ValueError, match="world: only tp_qk_norm takes a world size"):
        explainer.explain("cross_head_norm", shape=(8, 4096, 1024), world=2, gpu="h100")


def test_command_line():
    nvcc_jobs.result(nvcc_report.compile_extension, "tp_qk_norm_tuned")
    run = subprocess.run([sys.executable, "-m", "cookbook", "explain", OP, "--shape", "16384,6144,1024", "--world", "4",
                          "--gpu", "h200"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "over 4 ranks (shards 1536/256)" in run.stdout and "lagged_rows_kernel<T=__nv_bfloat16, kVecsPerThread=2" in run.stdout
