"""qk_norm_rope_cache: every registered implementation agrees with the contract (q and k within the
tolerances, the caches bit for bit what the contract stores for the k it wrote and for v, every
other slot untouched); deliberately wrong cache writes (swapped slot arithmetic, a missing or
inverted scale, the k before its norm, a -1 slot written) are caught; bad inputs get a clear error
and leave every tensor untouched on every backend; FP8 rounding matches torch's, in nvcc's
conversion and in the Numba encoder; the host policy picks its paths."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cookbook
from cookbook import registry
from cookbook.ops import qk_norm_rope_cache as contract
from cookbook.testing import agreement
from helpers import BACKENDS, DEVICE, ON_GPU, assert_rejected_untouched, bad_case, fields, kernel_impls, require

OP = "qk_norm_rope_cache"
FP8 = contract.FP8
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _clone(inputs):
    return {name: (t.clone() if isinstance(t, torch.Tensor) else t) for name, t in inputs.items()}


def _as_bits(t):
    """The bits of a tensor, for exact comparisons (NaN == NaN where the bits agree)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def check_run(fn, inputs, *, eps=1e-6, weight_offset=0.0, rounding="fused", name="impl"):
    """Run `fn` (the registry's calling convention) on `inputs` in place; assert q and k agree with
    the contract's expected values, and each cache holds exactly what the contract stores for the
    k `fn` wrote (and for v) at every written slot, and its former bytes everywhere else."""
    expected = contract.expected(_clone(inputs), eps, weight_offset, rounding)
    before = {c: inputs[c].clone() for c in ("k_cache", "v_cache")}
    args = contract.check_inputs(**inputs, eps=eps, weight_offset=weight_offset, rounding=rounding)
    fn(*fields(args))
    for out in ("q", "k"):
        exact, rounded = expected[out]
        result = agreement(f"{name}:{out}", inputs[out], exact, rounded, rounding, contract.TOLERANCES[inputs[out].dtype])
        assert result.ok, result.message
    for cache, x, scale in (("k_cache", args.k, args.k_scale), ("v_cache", args.v, args.v_scale)):
        want = before[cache].clone()
        contract.write_cache(x, want, args.slot_mapping, scale)  # from the k as written: bit for bit
        got = inputs[cache]
        same = _as_bits(got) == _as_bits(want)
        if not bool(same.all()):
            bad = (~same).nonzero()[0].tolist()
            raise AssertionError(f"{name}:{cache} [{got.dtype}]: {int((~same).sum())} elements differ from the "
                                 f"contract's store (first at {tuple(bad)}: got {got[tuple(bad)].float().item()!r}, "
                                 f"want {want[tuple(bad)].float().item()!r})")


def build(shape, case):
    tokens, hq, hk, head_dim, rope_dim, block_size = shape
    return contract.make_inputs(
        tokens, hq, hk, head_dim, case["fp8"], case["dtype"], DEVICE, rope_dim=rope_dim, is_neox=case["is_neox"],
        seed=case["seed"], fused_qkv=case["fused_qkv"], weight_dtype=torch.float32 if case["fp32_weight"] else None,
        kind=case["kind"], block_size=block_size, slot_dtype=case["slot_dtype"],
        skipped=case["skipped"], cos_sin_dtype=torch.float32 if case["fp32_cos_sin"] else case["dtype"])


def shape_strategy(impl):
    """(tokens, q heads, kv heads, head_dim, rope_dim, block_size): tiny under the simulator; on a GPU
    odd token counts, full and partial rope, the vector kernels' head_dims and others."""
    simulated = impl.level == "numba" and not ON_GPU
    tokens = st.sampled_from([1, 2, 3] if simulated else [1, 2, 127, 129])
    heads = st.integers(1, 2 if simulated else 9)
    head_dim = st.sampled_from([32, 64] if simulated else [64, 128, 256, 96, 80, 130])

    @st.composite
    def shapes(draw):
        d = draw(head_dim)
        rope_dim = max(2, draw(st.sampled_from([d, 2 * (d // 4), 2 * (d // 3), 2])))
        return draw(tokens), draw(heads), draw(heads), d, rope_dim, draw(st.sampled_from([1, 4, 16]))

    return shapes()


def case_strategy():
    return st.fixed_dictionaries(dict(
        dtype=st.sampled_from(DTYPES), is_neox=st.booleans(), fp32_weight=st.booleans(), fp32_cos_sin=st.booleans(),
        fused_qkv=st.booleans(), fp8=st.booleans(), kind=st.sampled_from(contract.INPUT_KINDS),
        rounding=st.sampled_from(["fused", "hf"]), weight_offset=st.sampled_from([0.0, 1.0]),
        slot_dtype=st.sampled_from([torch.int32, torch.int64]), skipped=st.integers(0, 2),
        seed=st.integers(0, 2**16)))


@pytest.mark.parametrize("impl", kernel_impls(OP))
def test_agrees_with_contract(impl):
    require(impl)

    @given(shape=shape_strategy(impl), case=case_strategy())
    def check(shape, case):
        check_run(impl.fn, build(shape, case), weight_offset=case["weight_offset"], rounding=case["rounding"],
                  name=impl.name)

    check()


# Fixed cases every implementation meets (on the simulator too): both cache dtypes, both layouts,
# partial rope, skipped tokens, a cache whose blocks are views of one [blocks, 2, ...] tensor.
FIXED = [
    # (tokens, hq, hk, head_dim, rope_dim, is_neox, dtype, fp8, rounding, block_size, skipped)
    (3, 2, 1, 64, 64, True, torch.bfloat16, False, "fused", 2, 1),
    (3, 2, 1, 64, 48, True, torch.bfloat16, True, "hf", 4, 0),
    (2, 2, 1, 64, 40, False, torch.float16, True, "fused", 1, 1),
    (2, 1, 1, 32, 32, True, torch.float32, True, "fused", 16, 0),
    (1, 2, 2, 64, 2, False, torch.bfloat16, False, "hf", 3, 0),
]


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("case", FIXED, ids=lambda c: f"T{c[0]}-D{c[3]}-rope{c[4]}-{str(c[6])[6:]}-{'fp8' if c[7] else 'act'}-{c[8]}")
def test_fixed_cases(impl, case):
    require(impl)
    t, hq, hk, d, rope_dim, is_neox, dtype, fp8, rounding, block_size, skipped = case
    inputs = contract.make_inputs(t, hq, hk, d, fp8, dtype, DEVICE, rope_dim=rope_dim, is_neox=is_neox, seed=9,
                                  fused_qkv=True, block_size=block_size, skipped=skipped,
                                  slot_dtype=torch.int32, position_dtype=torch.int32)
    check_run(impl.fn, inputs, weight_offset=1.0, rounding=rounding, name=impl.name)


@pytest.mark.parametrize("impl", kernel_impls(OP))
def test_caches_as_views_of_one_kv_tensor(impl):
    """k_cache and v_cache as kv[:, 0] and kv[:, 1] of one [blocks, 2, block_size, heads, head_dim]
    tensor (strided blocks), FP8: the other half of each block is never touched."""
    require(impl)
    inputs = contract.make_inputs(3, 2, 1, 64, True, torch.bfloat16, DEVICE, seed=3, block_size=2)
    kv = torch.zeros((inputs["k_cache"].shape[0], 2, *inputs["k_cache"].shape[1:]), dtype=FP8, device=DEVICE)
    kv[:, 0], kv[:, 1] = inputs["k_cache"], inputs["v_cache"]
    inputs["k_cache"], inputs["v_cache"] = kv[:, 0], kv[:, 1]
    check_run(impl.fn, inputs, name=impl.name)


@pytest.mark.parametrize("impl", kernel_impls(OP))
def test_slots_of_minus_one_and_out_of_range_write_nothing(impl):
    """-1 skips a token; a slot out of range (not validated) writes nothing either: no backend ever
    writes outside the cache. q and k are still normalized and rotated."""
    require(impl)
    inputs = contract.make_inputs(4, 2, 1, 64, False, torch.bfloat16, DEVICE, is_neox=False, seed=6, block_size=2,
                                  num_blocks=3)
    inputs["slot_mapping"] = torch.tensor([-1, 6, 5, -1], device=DEVICE)  # 6 slots: 6 is out of range
    before = {c: inputs[c].clone() for c in ("k_cache", "v_cache")}
    check_run(impl.fn, inputs, name=impl.name)
    for c in ("k_cache", "v_cache"):
        changed = (inputs[c] != before[c]).flatten(2).any(-1)  # [blocks, block_size]
        assert changed.nonzero().tolist() == [[2, 1]], f"{c}: only slot 5 (block 2, row 1) may change"


# ------------------------------------------------------------------------------------------
# Deliberately wrong cache writes: the same check must reject each.
# ------------------------------------------------------------------------------------------
def _reference_then(write):
    """The reference's q and k, then `write(x, cache, slots, scale)` for k and v."""
    def run(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slots, k_scale, v_scale, eps,
            weight_offset, rounding, is_neox, rope_dim):
        from cookbook.ops import qk_norm_rope as rope
        rope.reference(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox,
                       rope_dim, 0)
        write(k, k_cache, slots, k_scale)
        write(v, v_cache, slots, v_scale)
    return run


def _write_with(block_of, offset_of, store):
    def write(x, cache, slots, scale):
        bs = cache.shape[1]
        keep = slots >= 0
        s = slots[keep].long()
        values = store(x[keep], cache, scale)
        target = cache.view(torch.uint8) if cache.dtype == FP8 else cache
        target[block_of(s, bs), offset_of(s, bs)] = values.view(torch.uint8) if cache.dtype == FP8 else values
    return write


def _right_store(x, cache, scale):
    return contract.cache_values(x, cache.dtype, scale)


def _unscaled(x, cache, scale):
    return x.float().clamp(-contract.FP8_MAX, contract.FP8_MAX).to(FP8) if cache.dtype == FP8 else x


def _times_scale(x, cache, scale):
    return (x.float() * scale).clamp(-contract.FP8_MAX, contract.FP8_MAX).to(FP8) if cache.dtype == FP8 else x


def _unrounded_k(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slots, k_scale, v_scale,
                 eps, weight_offset, rounding, is_neox, rope_dim):
    """The k cache written from the input k, before its norm and rope."""
    from cookbook.ops import qk_norm_rope as rope
    k_in = k.clone()
    rope.reference(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox, rope_dim, 0)
    contract.write_cache(k_in, k_cache, slots, k_scale)
    contract.write_cache(v, v_cache, slots, v_scale)


def _minus_one_wraps(q, k, v, *rest):
    """Slot -1 used as an index: Python's wraparound writes the last slot."""
    args = (q, k, v, *rest)
    _reference_then(_write_with(lambda s, bs: s // bs, lambda s, bs: s % bs, _right_store))(*args)
    k_cache, v_cache, slots = rest[4], rest[5], rest[6]
    if bool((slots == -1).any()):
        t = int((slots == -1).nonzero()[0])
        k_cache.view(-1, *k_cache.shape[2:])[-1] = contract.cache_values(k[t:t + 1], k_cache.dtype, rest[7])[0]


WRONG = {
    "swapped slot arithmetic": _reference_then(_write_with(lambda s, bs: s % bs, lambda s, bs: s // bs, _right_store)),
    "missing scale": _reference_then(_write_with(lambda s, bs: s // bs, lambda s, bs: s % bs, _unscaled)),
    "scale multiplied": _reference_then(_write_with(lambda s, bs: s // bs, lambda s, bs: s % bs, _times_scale)),
    "k before norm and rope": _unrounded_k,
    "slot -1 written": _minus_one_wraps,
}


def test_the_right_write_passes_the_check():
    inputs = contract.make_inputs(5, 2, 1, 32, True, torch.bfloat16, seed=2, block_size=3,
                                  skipped=1)
    check_run(_reference_then(_write_with(lambda s, bs: s // bs, lambda s, bs: s % bs, _right_store)), inputs)


@pytest.mark.parametrize("wrong", WRONG, ids=list(WRONG))
def test_wrong_cache_write_is_rejected(wrong):
    inputs = contract.make_inputs(5, 2, 1, 32, True, torch.bfloat16, seed=2, block_size=3,
                                  skipped=1)
    with pytest.raises(AssertionError):
        check_run(WRONG[wrong], inputs)


# ------------------------------------------------------------------------------------------
# FP8: the rounding every backend must share with torch.
# ------------------------------------------------------------------------------------------
def fp8_probe_values() -> torch.Tensor:
    """Every bf16 value in e4m3's range and past it (so every e4m3 value and the values between),
    the midpoints between neighbouring e4m3 values (ties), and random float32s."""
    every_bf16 = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    finite = every_bf16[every_bf16.isfinite() & (every_bf16.abs() < 1024)]
    grid = torch.arange(0, 256, dtype=torch.int16).to(torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    ties = torch.cat([ties, -ties])
    rand = torch.randn(20000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 3, 20000)
    return torch.cat([finite, ties, rand, torch.tensor([float("inf"), -float("inf"), 448.0, 464.0, -464.0, 0.0, -0.0])])


FP8_HOST_PROGRAM = r"""
#include <cuda_fp8.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
int main() {  // float32 bits in hex, one per line -> the e4m3 byte nvcc's conversion gives, saturated
  unsigned bits;
  while (std::scanf("%x", &bits) == 1) {
    float x;
    std::memcpy(&x, &bits, sizeof x);
    std::printf("%u\n", static_cast<unsigned>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)));
  }
}
"""


def test_nvcc_fp8_conversion_matches_torch(tmp_path):
    """__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) (the kernels' conversion, here its host
    version) gives torch's x.clamp(-448, 448).to(float8_e4m3fn) for every probe value: nearest,
    ties to even, saturated. The GPU tests compare the device's conversion, bit for bit."""
    import subprocess

    from cookbook import nvcc_report

    if nvcc_report.nvcc() is None:
        pytest.skip("nvcc not on PATH")
    source, program = tmp_path / "fp8.cu", tmp_path / "fp8"
    source.write_text(FP8_HOST_PROGRAM)
    build_run = subprocess.run([nvcc_report.nvcc(), "-std=c++17", "-o", str(program), str(source)], capture_output=True,
                               text=True)
    assert build_run.returncode == 0, build_run.stderr[-3000:]
    values = fp8_probe_values()
    text = "\n".join(f"{b & 0xFFFFFFFF:x}" for b in values.view(torch.int32).tolist()) + "\n"
    out = subprocess.run([str(program)], input=text, capture_output=True, text=True, check=True).stdout
    got = torch.tensor([int(line) for line in out.split()], dtype=torch.int16).to(torch.uint8)
    want = values.clamp(-contract.FP8_MAX, contract.FP8_MAX).to(FP8).view(torch.uint8)
    bad = (got != want).nonzero()
    assert not bad.numel(), [(values[i].item(), int(got[i]), int(want[i])) for i in bad.view(-1)[:5].tolist()]


def test_numba_fp8_encoder_matches_torch():
    """kernels_numba's e4m3_bits, run as Python (the simulator's device functions), on the probes."""
    import kernels_numba
    if not kernels_numba.simulator():
        pytest.skip("runs the encoder as plain Python: under the simulator")
    import numpy as np

    from kernels_numba.qk_norm_rope_cache import e4m3_bits

    values = fp8_probe_values()[::7]  # a seventh of them: each call is a Python loop
    want = values.clamp(-contract.FP8_MAX, contract.FP8_MAX).to(FP8).view(torch.uint8).tolist()
    got = [e4m3_bits(np.float32(x)) for x in values.tolist()]
    bad = [(x, g, w) for x, g, w in zip(values.tolist(), got, want) if g != w]
    assert not bad, bad[:5]


# ------------------------------------------------------------------------------------------
# The public function, and bad input: a clear error naming the argument, and nothing written.
# ------------------------------------------------------------------------------------------
def _public(inputs):
    tensors = dict(inputs)
    rope = tensors.pop("rope")
    return tensors, dict(is_neox=rope.is_neox, rope_dim=rope.rope_dim)


def test_public_api_returns_the_same_tensors():
    """The public function (backend "auto": the reference on a CPU, the tuned kernel on a GPU) writes
    q and k in place, returns those tensors, and stores the caches as the contract does."""
    inputs = contract.make_inputs(4, 2, 1, 64, True, torch.float32, DEVICE, seed=1, skipped=1)
    returned = []

    def public(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, k_scale,
               v_scale, eps, weight_offset, rounding, is_neox, rope_dim):
        out = cookbook.qk_norm_rope_cache(
            q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, eps, is_neox=is_neox,
            rope_dim=rope_dim, k_scale=k_scale, v_scale=v_scale, weight_offset=weight_offset, rounding=rounding,
            validate_slots=True)
        returned.append(out[0] is q and out[1] is k)

    check_run(public, inputs, name="public")
    assert returned == [True]


def test_leading_token_dims():
    """`[batch, seq, heads, head_dim]` q, k, v with positions and slots `[batch, seq]`."""
    inputs = contract.make_inputs(6, 2, 1, 64, False, torch.float32, DEVICE, seed=3, block_size=4)
    tensors, kwargs = _public(inputs)
    flat = _clone(tensors)
    cookbook.qk_norm_rope_cache(**flat, **kwargs, backend="reference")
    four = {name: (t.view(2, 3, *t.shape[1:]) if name in ("q", "k", "v", "positions", "slot_mapping") else t)
            for name, t in tensors.items()}
    cookbook.qk_norm_rope_cache(**four, **kwargs, backend="reference")
    for name in ("q", "k", "k_cache", "v_cache"):
        assert torch.equal(tensors[name], flat[name]), name


def _good(fp8=True, device=DEVICE):
    inputs = contract.make_inputs(3, 4, 2, 64, fp8, torch.bfloat16, device, rope_dim=32, seed=5, block_size=2)
    tensors, kwargs = _public(inputs)
    return dict(tensors, **kwargs)


def _bad_cases():
    with_ = functools.partial(bad_case, _good)
    plain = functools.partial(bad_case, functools.partial(_good, False))

    return [
        ("v not a tensor", with_(v=lambda a: a["v"].tolist()), TypeError, "v: expected a torch.Tensor"),
        ("v dtype", with_(v=lambda a: a["v"].half()), TypeError, "v: expected [tokens...=(3,), num_kv_heads=2, head_dim=64]"),
        ("v heads", with_(v=lambda a: a["v"][:, :1]), ValueError, "v: expected [tokens...=(3,), num_kv_heads=2"),
        ("v strided last dim", with_(v=lambda a: a["v"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
         "v: expected"),
        ("cache rank", with_(k_cache=lambda a: a["k_cache"].flatten(0, 1)), ValueError,
         "k_cache: expected [num_blocks, block_size, num_kv_heads=2, head_dim=64]"),
        ("cache heads", with_(v_cache=lambda a: a["v_cache"][:, :, :1]), ValueError,
         "v_cache: expected [num_blocks, block_size, num_kv_heads=2, head_dim=64]"),
        ("cache head_dim", with_(k_cache=lambda a: a["k_cache"][..., :32]), ValueError, "head_dim=64"),
        ("cache layout [blocks, heads, block_size, head_dim]",
         with_(k_cache=lambda a: torch.zeros(3, 2, 4, 64, dtype=FP8, device=DEVICE)), ValueError,
         "k_cache: expected [num_blocks, block_size, num_kv_heads=2"),
        ("cache last dim strided", with_(k_cache=lambda a: torch.zeros(3, 2, 2, 128, dtype=FP8, device=DEVICE)[..., ::2]),
         ValueError, "k_cache: expected"),
        ("cache dtype", with_(k_cache=lambda a: a["k_cache"].float(), v_cache=lambda a: a["v_cache"].float()), TypeError,
         "k_cache: expected [num_blocks, block_size, num_kv_heads=2, head_dim=64] in torch.bfloat16 or torch.float8_e4m3fn"),
        ("caches of two dtypes", plain(v_cache=lambda a: a["v_cache"].to(FP8), v_scale=torch.ones(1, device=DEVICE)),
         TypeError, "v_cache: expected the dtype of k_cache"),
        ("caches of two shapes", with_(v_cache=lambda a: a["v_cache"][:2]), ValueError, "v_cache: expected the shape of k_cache"),
        ("no blocks", with_(k_cache=lambda a: a["k_cache"][:0], v_cache=lambda a: a["v_cache"][:0]), ValueError,
         "num_blocks >= 1"),
        ("slots float", with_(slot_mapping=lambda a: a["slot_mapping"].float()), TypeError,
         "slot_mapping: expected [tokens...=(3,)] int32 or int64"),
        ("slots length", with_(slot_mapping=lambda a: a["slot_mapping"][:2]), ValueError, "slot_mapping: expected [tokens...=(3,)]"),
        ("slots strided", with_(slot_mapping=lambda a: torch.arange(6, device=DEVICE)[::2]), ValueError, "contiguous"),
        ("fp8 without k_scale", with_(k_scale=None), ValueError, "k_scale: expected a float32 tensor of one element"),
        ("fp8 without v_scale", with_(v_scale=None), ValueError, "v_scale: expected a float32 tensor of one element"),
        ("scale dtype", with_(k_scale=lambda a: a["k_scale"].half()), TypeError, "k_scale: expected a float32 tensor"),
        ("scale of two elements", with_(v_scale=torch.ones(2, device=DEVICE)), ValueError, "v_scale: expected a float32 tensor of one element"),
        ("scale given for a bf16 cache", plain(k_scale=torch.ones(1, device=DEVICE)), ValueError,
         "k_scale: expected None with a torch.bfloat16 cache"),
        ("k_cache is q's memory", plain(k_cache=lambda a: a["q"].view(3, 2, 2, 64)), ValueError,
         "k_cache: expected memory disjoint from q (both are written in place)"),
        ("v inside v_cache", plain(v=lambda a: a["v_cache"][:, 0]), ValueError,
         "v: expected memory disjoint from v_cache (v_cache is written in place)"),
        ("k_cache is v_cache", plain(v_cache=lambda a: a["k_cache"]), ValueError,
         "v_cache: expected memory disjoint from k_cache (both are written in place)"),
        ("k inside k_cache", plain(k=lambda a: a["k_cache"][:, 0]), ValueError,
         "k_cache: expected memory disjoint from k (both are written in place)"),
        ("slot out of range, validated", with_(slot_mapping=lambda a: torch.tensor([0, 6, 1], device=DEVICE),
                                               validate_slots=True), ValueError,
         "slot_mapping: expected every slot -1 (skip) or in [0, num_blocks * block_size=6), got slot_mapping[1] = 6"),
        ("slot below -1, validated", with_(slot_mapping=lambda a: torch.tensor([0, -2, 1], device=DEVICE),
                                           validate_slots=True), ValueError, "got slot_mapping[1] = -2"),
        ("duplicate slots, validated", with_(slot_mapping=lambda a: torch.tensor([4, 1, 4], device=DEVICE),
                                             validate_slots=True), ValueError,
         "slot_mapping: expected each slot at most once (but -1) in one call, got slot 4 at tokens 0 and 2"),
        ("q dtype", with_(q=lambda a: a["q"].float()), TypeError, "k: expected the dtype of q"),
        ("rope_dim not the table width", with_(rope_dim=16), ValueError, "rope_dim is the cache width"),
        ("bad rounding", with_(rounding="bf16"), ValueError, "rounding: expected one of"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label,make,error,fragment", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_is_rejected_untouched(backend, label, make, error, fragment):
    assert_rejected_untouched(cookbook.qk_norm_rope_cache, make(), error, fragment, backend=backend)


def test_repeated_minus_one_slots_pass_validation():
    args = _good()
    args["slot_mapping"] = torch.tensor([-1, 3, -1], device=DEVICE)
    cookbook.qk_norm_rope_cache(**args, validate_slots=True)


@pytest.mark.skipif(ON_GPU, reason="checks the CPU-tensor error of the CUDA backend")
def test_cpu_tensors_with_cuda_backend():
    fragment = "backend='cuda': expected CUDA tensors, got tensors on cpu"
    assert_rejected_untouched(cookbook.qk_norm_rope_cache, _good(), ValueError, fragment, backend="cuda")


# ------------------------------------------------------------------------------------------
# The benchmark's shapes, and the tuned kernel's host policy compiled for the host alone.
# ------------------------------------------------------------------------------------------
def test_bench_shapes_hold_qwen3_8b_decode_and_prefill_with_both_caches():
    wanted = [(t, 32, 8, 128, fp8) for t in (1, 8, 32, 128, 256, 4096, 8192) for fp8 in (0, 1)]
    assert sorted(contract.BENCH_SHAPES) == sorted(wanted)
    labels = [contract.bench_case(shape, torch.bfloat16, "meta")[1] for shape in contract.BENCH_SHAPES]
    assert len(set(labels)) == len(labels), "every bench shape has its own label"


def test_bench_case_slots_and_bytes():
    decode, _ = contract.bench_case((8, 4, 2, 64, 1), torch.bfloat16, "cpu")
    assert decode["slot_mapping"].tolist() == [16 * t + 3 for t in range(8)] and decode["k_cache"].dtype == FP8
    prefill, _ = contract.bench_case((512, 4, 2, 64, 0), torch.bfloat16, "cpu")
    assert prefill["positions"].tolist() == list(range(512)) and prefill["slot_mapping"].tolist() == list(range(512))
    a = contract.check_inputs(**prefill, eps=1e-6, weight_offset=0.0, rounding="fused", validate_slots=True)
    rope_bytes = 2 * 2 * 512 * 6 * 64 + 512 * (8 + 64 * 4) + 2 * 64 * 2
    assert contract.bytes_moved(a.q, a.k, a.v, a.q_weight, a.k_weight, a.cos_sin_cache, a.positions, a.k_cache,
                                a.slot_mapping) == rope_bytes + 512 * 2 * 64 * 2 + 2 * 512 * 2 * 64 * 2 + 512 * 8


POLICY_DRIVER = r"""
#include <iostream>
#include <sstream>
#include <string>
#include "qk_norm_rope_cache/policy.h"
using namespace cookbook::qk_norm_rope_cache;
using namespace cookbook::qk_norm_rope_cache::tuned;
int main() {  // per line: T Hq Hk D rope neox fp8 rows_aligned tables_aligned caches_aligned sms blocks_per_sm [slots]
  long t, slots; int hq, hk, d, rope, neox, fp8, rows, tables, caches, sms, bps;
  for (std::string line; std::getline(std::cin, line);) {
    std::istringstream in(line);
    if (!(in >> t >> hq >> hk >> d >> rope >> neox >> fp8 >> rows >> tables >> caches >> sms >> bps)) continue;
    if (!(in >> slots)) slots = t + 32;  // room for every token
    const Call call{cookbook::DType::kBFloat16, cookbook::Rounding::kFused, t, hq, hk, d, rope,
                    neox ? Layout::kNeox : Layout::kInterleaved, TableDtype::kActivation, TableDtype::kFloat32,
                    fp8 ? CacheDtype::kFp8E4m3 : CacheDtype::kActivation, rows != 0, tables != 0, caches != 0, slots};
    std::cout << describe(plan(call, sms, [&](const Kernel&) { return bps; })) << "---\n";
  }
}
"""


@functools.cache
def _policy_driver(tmp_dir):
    import shutil
    import subprocess
    from pathlib import Path

    from kernels_cuda import KERNEL_DIR

    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler")
    source, program = Path(tmp_dir) / "driver.cpp", Path(tmp_dir) / "driver"
    source.write_text(POLICY_DRIVER)
    # The host compiler alone, with no CUDA include folder: policy.h is plain C++.
    run = subprocess.run([compiler, "-std=c++20", "-Wall", "-Werror", f"-I{KERNEL_DIR}", str(source), "-o", str(program)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return program


def _plans(tmp_path_factory, lines):
    import subprocess

    program = _policy_driver(str(tmp_path_factory.mktemp("policy")))
    out = subprocess.run([str(program)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True).stdout
    return [dict(line.split("=", 1) for line in block.strip().splitlines()) for block in out.split("---") if block.strip()]


@pytest.mark.parametrize("line, grid, waves", [
    ("1 32 8 128 128 1 0 1 1 1 132 3", 2, 1),          # decode: 48 rows of 8 lanes, 32 rows a block
    ("256 32 8 128 128 1 1 1 1 1 132 3", 384, 1),
    ("8192 32 8 128 128 1 1 1 1 1 132 3", 12288, 32),
    ("396 32 8 128 128 1 0 1 1 1 132 3", 396, 2),      # just past one wave (132 x 3 blocks of 32 rows): a bf16 cache walks
    ("8192 32 8 128 128 1 0 1 1 1 132 3", 396, 32),    # on the resident blocks, 32 rows per lane group
])
def test_policy_one_pass(tmp_path_factory, line, grid, waves):
    (plan,) = _plans(tmp_path_factory, [line])
    assert plan["path"] == "one_pass" and int(plan["grid"]) == grid and int(plan["waves"]) == waves, plan
    assert plan["walk"] == ("false" if line.split()[6] == "1" else "true")
    assert plan["programmatic"] == "true" and plan["block"] == "256" and plan["off_vectors"] == "none"
    assert plan["cache"] == ("CacheDtype::kFp8E4m3" if line.split()[6] == "1" else "CacheDtype::kActivation")


@pytest.mark.parametrize("line, why", [("64 8 2 96 96 1 0 1 1 1 132 3", "head_dim_not_compiled"),
                                       ("64 8 2 128 24 1 0 1 1 1 132 3", "rope_dim_not_whole_units"),
                                       ("64 8 2 128 128 1 0 0 1 1 132 3", "rows_unaligned"),
                                       ("64 8 2 128 128 1 0 1 0 1 132 3", "tables_unaligned"),
                                       ("64 8 2 128 128 1 1 1 1 0 132 3", "caches_unaligned"),
                                       ("64 8 2 128 128 1 0 1 1 1 132 3 2147483649", "index_over_31_bits")])
def test_policy_splits_off_the_vectors(tmp_path_factory, line, why):
    (plan,) = _plans(tmp_path_factory, [line])
    assert plan["path"] == "split" and plan["off_vectors"] == why, plan
    assert plan["kernel"].endswith("copy::qk_norm_rope_cache_copy_kernel") and int(plan["grid"]) == 64 * 2 // 8


def test_policy_one_pass_up_to_2_to_the_31_rows_and_slots(tmp_path_factory):
    """The one-pass kernel indexes rows and slots in 32 bits: up to 2^31 of each it runs, one more splits."""
    heads = 32 + 2 * 8
    most = 2**31 // heads  # tokens whose rows stay within 2^31
    lines = [f"{most} 32 8 128 128 1 0 1 1 1 132 4 {2**31}", f"{most + 1} 32 8 128 128 1 0 1 1 1 132 4"]
    inside, too_many_rows = _plans(tmp_path_factory, lines)
    assert inside["path"] == "one_pass" and int(inside["rows"]) == most * heads <= 2**31, inside
    assert too_many_rows["path"] == "split" and too_many_rows["off_vectors"] == "index_over_31_bits", too_many_rows


def test_policy_kernel_names_its_template_arguments(tmp_path_factory):
    (plan, empty) = _plans(tmp_path_factory, ["4096 32 8 128 128 0 1 1 1 1 132 3", "0 32 8 128 128 0 1 1 1 1 132 3"])
    assert plan["template_values"] == "__nv_bfloat16,0,128,0,0,1,1"
    assert plan["template_arguments"] == ("T=__nv_bfloat16, kRounding=Rounding::kFused, kHeadDim=128, "
                                          "kLayout=Layout::kInterleaved, kWeights=TableDtype::kActivation, "
                                          "kCosSin=TableDtype::kFloat32, kCache=CacheDtype::kFp8E4m3")
    assert empty["rows"] == "0" and empty["grid"] == "0"


def test_registry_lists_the_split_paths_and_the_ladder():
    names = [impl.name for impl in registry.implementations(OP)]
    assert {"reference", "numba_v1", "cuda_v1", "cuda_v2", "cuda_v3", "cuda_tuned", "torch_compile",
            "ours_then_index_copy", "ours_then_flashinfer_append", "sglang_qknorm_rope_then_store"} <= set(names)
