"""`cookbook.explain` without a GPU: the tuned kernel's policy compiled for the host answers which
kernel a call runs, with the numbers that decided it. Needs nvcc (CI has it); the GPU test
(tests/test_gpu_explain.py) proves the answer equal to the one the GPU's own launcher gives."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import cookbook
import nvcc_jobs
from cookbook import explainer, nvcc_report, registry
from cookbook.ops import qk_norm as contract

needs_nvcc = pytest.mark.skipif(nvcc_report.nvcc() is None, reason="nvcc not on PATH")
pytestmark = [needs_nvcc, pytest.mark.nvcc("compile_extension", "qk_norm_tuned")]
TUNED = "cookbook::qk_norm::tuned::qk_norm_tuned_kernel"
WARP_PER_ROW = "cookbook::qk_norm::v2::qk_norm_v2_kernel"


def ask(shape, **kwargs):
    nvcc_jobs.result(nvcc_report.compile_extension, "qk_norm_tuned")  # the report the answer reads
    return explainer.explain("qk_norm", shape=shape, gpu=kwargs.pop("gpu", "h100"), **kwargs)


@pytest.mark.parametrize("shape", contract.BENCH_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bench_shapes_follow_the_policy(shape):
    """At every bench shape the plan keeps the policy's own rules: two vectors per lane from one
    wave of one-vector blocks, the next wave warmed in (1, 8] waves, a block per rows_per_block rows,
    and the registers of the kernel it names."""
    answer = ask(shape)
    p = {key: value for key, value in answer.plan.items()}
    rows = int(p["rows"])
    assert p["kernel"] == TUNED
    assert rows == shape[0] * (shape[1] + shape[2])
    one, two = int(p["one_vector_wave"]), int(p["two_vector_wave"])
    vectors = 2 if rows >= one else 1
    wave = two if vectors == 2 else one
    assert (", kVecsPerLane=2," in p["template_arguments"]) == (vectors == 2 and one != two)
    warm = 1 < rows / wave <= 8
    assert p["warm_next_wave"] == ("true" if warm else "false")
    assert ("Warm::kWeightsAndNextWave" in p["template_arguments"]) == warm
    assert int(p["grid"]) == -(-rows // int(p["rows_per_block"]))
    assert int(p["one_vector_wave"]) == 132 * int(p["one_vector_blocks_per_sm"]) * (256 // int(p["lanes_per_row"])) \
        or vectors == 2
    kernels = {(name, values): k for k in nvcc_report.compile_extension("qk_norm_tuned")
               if (split := explainer._split_template(k.kernel)) for name, values in [split]}
    assert int(p["registers"]) == kernels[(p["kernel"], p["template_values"])].registers


@pytest.mark.parametrize("shape, vectors, warm", [
    ((8193, 8, 1, 128), 2, True), ((2049, 16, 4, 256), 2, True), ((8192, 64, 8, 128), 2, False),
    ((256, 64, 8, 128), 2, False), ((1024, 8, 1, 96), 1, False), ((1, 64, 8, 128), 1, False)],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_policy_edges_on_an_h100(shape, vectors, warm):
    """The choices the GPU tests check through the profiler (test_gpu_qk_norm.test_tuned_policy),
    answered without a GPU."""
    p = ask(shape).plan
    assert f"kVecsPerLane={vectors}," in p["template_arguments"]
    assert ("kWarm=Warm::kWeightsAndNextWave" in p["template_arguments"]) == warm


def test_fewer_sms_move_the_edges():
    """A wave is the GPU's: the same call is two waves on 66 SMs and one on 132."""
    shape = (2048, 8, 1, 128)  # 18,432 rows
    full, half = ask(shape).plan, ask(shape, gpu=None, sms=66).plan
    assert int(half["one_vector_wave"]) * 2 == int(full["one_vector_wave"])
    assert full["warm_next_wave"] == "false" and half["warm_next_wave"] == "true"


def test_paths_off_the_vectors():
    """head_dim 112 has no vector kernel; a row off a 16-byte boundary cannot be read as vectors;
    a float32 weight one element into its buffer is loaded element by element."""
    assert ask((5, 8, 1, 112)).plan["kernel"] == WARP_PER_ROW
    qkv = torch.empty(64, 1 + 12 * 128, dtype=torch.bfloat16, device="meta")
    q, k = qkv[:, 1: 1 + 8 * 128].view(64, 8, 128), qkv[:, 1 + 8 * 128: 1 + 10 * 128].view(64, 2, 128)
    w = torch.empty(128, dtype=torch.bfloat16, device="meta")
    answer = explainer.explain("qk_norm", q, k, w, w, gpu="h100")
    assert answer.plan["kernel"] == WARP_PER_ROW
    assert "16-byte boundary" in dict(answer.policy)["path"]
    buffer = torch.empty(129, dtype=torch.float32, device="meta")
    q, k = torch.empty(5, 16, 128, dtype=torch.bfloat16, device="meta"), torch.empty(5, 4, 128, dtype=torch.bfloat16, device="meta")
    answer = explainer.explain("qk_norm", q, k, buffer[1:], buffer[1:], gpu="h100")
    assert "kWeightLoad=WeightLoad::kPerElement" in answer.plan["template_arguments"]


def test_explains_a_call_of_cpu_tensors():
    """The call's own tensors, on the CPU: the answer is for a GPU, and says what CPU tensors run."""
    inputs = contract.make_inputs(3, 4, 2, 128, torch.bfloat16, "cpu", seed=0)
    nvcc_jobs.result(nvcc_report.compile_extension, "qk_norm_tuned")
    answer = cookbook.explain("qk_norm", **inputs, rounding="hf")
    assert answer.plan["kernel"] == TUNED and "kRounding=Rounding::kHf" in answer.plan["template_arguments"]
    assert "CPU tensors: the reference" in answer.auto and answer.cuda == registry.fastest("qk_norm").name
    text = str(answer)
    for part in ("kernel:", "launch: grid 2 x block 256", "vectors per lane", "warm next wave", "weight loads"):
        assert part in text, text


def test_no_rows_launch_nothing():
    answer = ask((0, 8, 1, 128))
    assert answer.plan["grid"] == "0" and "nothing" in str(answer)


@pytest.mark.parametrize("kwargs, message", [
    (dict(shape=(8, 8, 1)), "shape: expected 4 sizes"),
    (dict(shape=(8, 8, 1, 128), gpu="a100"), "gpu: expected one of"),
    (dict(shape=(8, 8, 1, 128), sms=0), "sms: expected a positive"),
    (dict(shape=(8, 8, 1, 128), layout="interleaved"), "layout: expected one of"),
    (dict(shape=(8, 8, 1, 127)), "head_dim=127"),
])
def test_bad_questions_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        explainer.explain("qk_norm", **kwargs)


def test_unknown_op():
    with pytest.raises(ValueError, match="op: expected one of"):
        explainer.explain("layer_norm", shape=(1, 1, 1, 2))


def test_command_line():
    nvcc_jobs.result(nvcc_report.compile_extension, "qk_norm_tuned")
    run = subprocess.run([sys.executable, "-m", "cookbook", "explain", "qk_norm", "--shape", "8192,8,1,128",
                          "--dtype", "bfloat16", "--gpu", "h200"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "qk_norm_tuned_kernel<T=__nv_bfloat16" in run.stdout and "kVecsPerLane=2" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "cookbook", "explain", "qk_norm", "--shape", "8192,x"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--shape" in bad.stderr


def test_template_arguments_are_read_from_nvccs_names():
    name = ("void cookbook::qk_norm::tuned::qk_norm_tuned_kernel<__nv_bfloat16, (cookbook::Rounding)1, 192, 1, "
            "(cookbook::qk_norm::tuned::Warm)0, (cookbook::qk_norm::tuned::WeightLoad)1>(cookbook::qk_norm::Params, "
            "unsigned int, cookbook::FastDivisor, unsigned int)")
    assert explainer._split_template(name) == ("cookbook::qk_norm::tuned::qk_norm_tuned_kernel", "__nv_bfloat16,1,192,1,0,1")
    lean = "cookbook::tp_qk_norm::v7::lean_rows_kernel"
    for bools in ("true, false", "(bool)1, (bool)0"):  # c++filt's spelling, then cu++filt's
        assert explainer._split_template(f"void {lean}<__nv_bfloat16, {bools}>(cookbook::tp_qk_norm::FusedParams)") == \
            (lean, "__nv_bfloat16,true,false")
