"""tp_qk_norm on a CPU: the sharded algorithm equals cross_head_norm on the full rows.

Single process: `virtual_tp` (the sharded algorithm on full tensors) agrees with the contract,
plausible wrong sharded variants are caught, bad input gets a clear error naming the argument and
leaves every tensor untouched, and without torch.distributed the op is cross_head_norm.

Several processes: 2 and 4 gloo ranks (`distributed.GlooPool`, kept alive across tests), each
building the same full inputs from one seed and keeping its shard (`tp.shard_of`). Every
CPU-runnable implementation - the reference, the Numba pipeline under the CUDA simulator, the
all-gather baseline - matches the rank's columns of the full result and of virtual TP; ranks that
disagree on the token count or a shard width all raise (no hang) and leave their shards untouched.
Hypothesis draws each case in the test process and sends it to the ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import cookbook
from cookbook import registry
from cookbook.ops import cross_head_norm as cross
from cookbook.ops import tp_qk_norm as tp
from cookbook.testing import agreement
from distributed import GlooPool, gloo_unavailable
from helpers import assert_rejected_untouched, BACKENDS, bad_case, DEVICE, fields, ON_GPU, require

OP = "tp_qk_norm"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OUTPUTS = ("q_shard", "k_shard")
# Two rounded results of float32 sums that differ only in their order (virtual TP sums shards in
# one order, gloo and the Numba block reduction in others): within the dtype's hf_ulp of each
# other. No bit-identical share is asked: a rounding flip is legitimate, and the shards of these
# tiny tests hold too few elements for a share to mean anything.
ORDER_ONLY = {dtype: dataclasses.replace(tol, hf_exact_share=0.0) for dtype, tol in tp.TOLERANCES.items()}

GLOO_REASON = gloo_unavailable()
needs_gloo = pytest.mark.skipif(GLOO_REASON is not None, reason=GLOO_REASON or "")


def at_least(n):
    """Cheap (pure PyTorch) properties: at least `n` examples, more under a larger profile."""
    return settings(max_examples=max(n, settings.default.max_examples))


def at_most(n):
    """Simulated, multi-process properties: at most `n` examples whatever the profile, and no
    shrinking (each example takes seconds; the failing case is printed as drawn)."""
    return settings(max_examples=min(n, settings.default.max_examples), phases=(Phase.explicit, Phase.generate))


def full_inputs(case, device="cpu"):
    return tp.make_full_inputs(case["tokens"], case["q_width"], case["k_width"], case["dtype"], device,
                               seed=case["seed"], weight_dtype=torch.float32 if case["fp32_weight"] else None,
                               kind=case["kind"])


def run_virtual(full, tp_size, case):
    """virtual_tp on copies of the full q and k; returns (q, k)."""
    q, k = full["q"].clone(), full["k"].clone()
    return tp.virtual_tp(q, k, full["q_weight"], full["k_weight"], tp_size, case["eps"],
                         weight_offset=case["weight_offset"], rounding=case["rounding"])


def reports(name, outputs, want, rounding, versus=None):
    """(ok, message) of each output against `want` ({output: (exact, hf reference)}) and, when
    given, against `versus` = (its name, {output: tensor}): an implementation of the same float32
    arithmetic that sums in another order."""
    found = []
    for out, actual in outputs.items():
        exact, rounded = want[out]
        found.append(agreement(f"{name}:{out}", actual, exact, rounded, rounding, tp.TOLERANCES[actual.dtype]))
        if versus is not None:
            other, value = versus[0], versus[1][out]
            found.append(agreement(f"{name}:{out} vs {other}", actual, value.double(), value, "hf",
                                   ORDER_ONLY[actual.dtype]))
    return [(r.ok, r.message) for r in found]


def assert_all_ok(found):
    """Every (ok, message) is ok; else fail with the messages of those that are not."""
    assert found, "nothing was compared"
    bad = [message for ok, message in found if not ok]
    if bad:
        pytest.fail(f"{len(bad)} of {len(found)} checks failed:\n" + "\n".join(bad), pytrace=False)


# ==========================================================================================
# Single process: virtual TP
# ==========================================================================================
@st.composite
def virtual_cases(draw):
    """Widths divisible by 2 * tp (even shards) and at most 128, T from 0."""
    tp_size = draw(st.integers(1, 4))
    width = st.integers(1, 128 // (2 * tp_size)).map(lambda m: 2 * tp_size * m)
    return dict(
        tp=tp_size, tokens=draw(st.integers(0, 4)), q_width=draw(width), k_width=draw(width),
        dtype=draw(st.sampled_from(DTYPES)), fp32_weight=draw(st.booleans()), fused_qkv=draw(st.booleans()),
        kind=draw(st.sampled_from(cross.INPUT_KINDS)), rounding=draw(st.sampled_from(["fused", "hf"])),
        weight_offset=draw(st.sampled_from([0.0, 1.0])), eps=draw(st.sampled_from([1e-6, 1e-5, 0.0])),
        seed=draw(st.integers(0, 2**16)),
    )


@at_least(40)
@given(case=virtual_cases())
def test_virtual_tp_equals_cross_head_norm(case):
    """The sharded algorithm (partial sums per shard, summed, each shard scaled by its weight
    slice) agrees with the float64 full-row norm (or its HF-order reference), and with the
    cross_head_norm reference on the same tensors up to the order of the float32 sums; fused
    qkv views and contiguous tensors alike, and v (the rest of qkv) is left alone."""
    full = full_inputs(case, DEVICE)
    if not case["fused_qkv"]:
        full = dict(full, q=full["q"].clone(), k=full["k"].clone())
    eps, offset, rounding = case["eps"], case["weight_offset"], case["rounding"]
    want = tp.expected(full, 0, 1, eps, offset, rounding)
    crossed = cookbook.cross_head_norm(full["q"].clone(), full["k"].clone(), full["q_weight"], full["k_weight"], eps,
                                    weight_offset=offset, rounding=rounding, backend="reference")
    qkv, v_from = full["q"]._base, case["q_width"] + case["k_width"]
    v_before = None if qkv is None else qkv[:, v_from:].clone()

    q, k = full["q"], full["k"]
    out = tp.virtual_tp(q, k, full["q_weight"], full["k_weight"], case["tp"], eps, weight_offset=offset,
                        rounding=rounding)
    assert out[0] is q and out[1] is k, "virtual_tp returns the tensors it normalized in place"
    assert_all_ok(reports(f"virtual_tp(tp={case['tp']})", {"q_shard": q, "k_shard": k}, want, rounding,
                          versus=("cross_head_norm", dict(zip(OUTPUTS, crossed)))))
    if v_before is not None:
        assert torch.equal(qkv[:, v_from:], v_before), "v (the rest of qkv) was modified"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_virtual_tp_nan_and_overflow_reach_every_shard(dtype):
    """A NaN in one shard's columns of a row, or a sum of squares that passes float32's max only
    over the full width (each shard's part within it), makes that row NaN in every shard; the
    other rows are untouched by it (docs/edge_cases.md)."""
    full = tp.make_full_inputs(3, 64, 32, dtype, DEVICE, seed=3)
    q = full["q"]
    q[0, 5] = float("nan")  # in the first of two shards
    row = torch.randn(64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    max_sq = torch.finfo(torch.float32).max
    q[1] = (row * (1.5 * max_sq / row.square().sum().item()) ** 0.5).to(dtype)  # each half ~0.75 of the max
    assert all(torch.isfinite(half.float().square().sum()) for half in q[1].tensor_split(2))
    want = tp.expected({n: t.clone() for n, t in full.items()}, 0, 1, 1e-6, 0.0, "fused")
    tp.virtual_tp(q, full["k"], full["q_weight"], full["k_weight"], 2, 1e-6)
    assert q[0].isnan().all() and q[1].isnan().all(), "a NaN or an overflowing full row must be NaN in every shard"
    for name, out, rows in (("q", q, slice(2, 3)), ("k", full["k"], slice(None))):
        exact = want[f"{name}_shard"][0][rows]
        check = agreement(name, out[rows], exact, None, "fused", tp.TOLERANCES[dtype])
        assert check.ok, check.message


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_virtual_tp_zero_rows_with_eps_0_give_zeros(dtype):
    """eps=0: an all-zero row has rstd 0 (not inf), so it stays exactly zero, never NaN."""
    full = tp.make_full_inputs(6, 64, 32, dtype, DEVICE, seed=1, kind="zero_rows")
    zero = {n: full[n].eq(0).all(-1) for n in ("q", "k")}
    assert all(z.any() and not z.all() for z in zero.values()), "the case needs zero and non-zero rows"
    want = tp.expected(full, 0, 1, 0.0, 0.0, "fused")
    q, k = tp.virtual_tp(full["q"], full["k"], full["q_weight"], full["k_weight"], 4, 0.0)
    for name, x in (("q", q), ("k", k)):
        assert not x.isnan().any(), f"{name}: NaN"
        assert x[zero[name]].eq(0).all(), f"{name}: a zero row did not stay zero"
    assert_all_ok(reports("virtual_tp", {"q_shard": q, "k_shard": k}, want, "fused"))


# ------------------------------------------------------------------------------------------
# Negative controls: plausible wrong sharded algorithms the same checks must reject. Each
# takes full tensors and tp, as virtual_tp does, and returns (q_out, k_out).
# ------------------------------------------------------------------------------------------
def _sharded(q, k, q_w, k_w, tp_size, apply_shard):
    """Cut q, k and their weights into tp shards; `apply_shard(r, qs, ks, qws, kws, sum_sq)`
    normalizes shard r in place from the summed `[T, 2]` partial sums."""
    q, k = q.clone(), k.clone()
    q_shards, k_shards = q.tensor_split(tp_size, dim=1), k.tensor_split(tp_size, dim=1)
    sum_sq = torch.stack([tp.local_sum_sq(qs, ks) for qs, ks in zip(q_shards, k_shards)]).sum(0)
    for r, shards in enumerate(zip(q_shards, k_shards, q_w.tensor_split(tp_size), k_w.tensor_split(tp_size))):
        apply_shard(r, *shards, sum_sq)
    return q, k


def _right(q, k, q_w, k_w, tp_size, eps, offset, rounding):
    out = tp.virtual_tp(q.clone(), k.clone(), q_w, k_w, tp_size, eps, weight_offset=offset, rounding=rounding)
    return out


def _wrong_no_all_reduce(q, k, q_w, k_w, tp_size, eps, offset, rounding):
    """Each rank normalizes its shard by its own statistic (the all-reduce forgotten)."""
    def apply_shard(r, qs, ks, qws, kws, sum_sq):
        local = tp.local_sum_sq(qs, ks)
        tp.apply_sum_sq(qs, ks, qws, kws, local, qs.shape[1], ks.shape[1], eps, offset, rounding)
    return _sharded(q, k, q_w, k_w, tp_size, apply_shard)


def _wrong_shard_width_in_mean(q, k, q_w, k_w, tp_size, eps, offset, rounding):
    """The full row's sum divided by the shard width: rstd off by sqrt(tp)."""
    def apply_shard(r, qs, ks, qws, kws, sum_sq):
        tp.apply_sum_sq(qs, ks, qws, kws, sum_sq, qs.shape[1], ks.shape[1], eps, offset, rounding)
    return _sharded(q, k, q_w, k_w, tp_size, apply_shard)


def _wrong_eps_added_on_every_rank(q, k, q_w, k_w, tp_size, eps, offset, rounding):
    """Each rank adds eps to its share of the mean before the all-reduce: tp * eps in total."""
    def apply_shard(r, qs, ks, qws, kws, sum_sq):
        tp.apply_sum_sq(qs, ks, qws, kws, sum_sq, q.shape[1], k.shape[1], tp_size * eps, offset, rounding)
    return _sharded(q, k, q_w, k_w, tp_size, apply_shard)


def _wrong_first_weight_slice_everywhere(q, k, q_w, k_w, tp_size, eps, offset, rounding):
    """Every rank scales by the first slice of the weight (the weight left unsharded)."""
    def apply_shard(r, qs, ks, qws, kws, sum_sq):
        tp.apply_sum_sq(qs, ks, q_w[: qs.shape[1]], k_w[: ks.shape[1]], sum_sq, q.shape[1], k.shape[1], eps,
                        offset, rounding)
    return _sharded(q, k, q_w, k_w, tp_size, apply_shard)


def _wrong_hf_rounding_ignored(q, k, q_w, k_w, tp_size, eps, offset, rounding):
    """Always one rounding at the end, whatever `rounding` asks."""
    return _right(q, k, q_w, k_w, tp_size, eps, offset, "fused")


WRONG = [_wrong_no_all_reduce, _wrong_shard_width_in_mean, _wrong_eps_added_on_every_rank,
         _wrong_first_weight_slice_everywhere, _wrong_hf_rounding_ignored]
CONTROL_CASES = [
    (tp_size, dtype, kind, rounding, offset)
    for tp_size in (2, 4)
    for dtype in (torch.float16, torch.bfloat16)
    for kind in ("normal", "tiny")
    for rounding in ("fused", "hf")
    for offset in (0.0, 1.0)
]


def _all_pass(norm):
    for tp_size, dtype, kind, rounding, offset in CONTROL_CASES:
        full = tp.make_full_inputs(4, 128, 64, dtype, "cpu", seed=7, kind=kind)
        want = tp.expected(full, 0, 1, 1e-6, offset, rounding)
        q, k = norm(full["q"], full["k"], full["q_weight"], full["k_weight"], tp_size, 1e-6, offset, rounding)
        if not all(ok for ok, _ in reports("control", {"q_shard": q, "k_shard": k}, want, rounding)):
            return False
    return True


def test_virtual_tp_passes_the_control_cases():
    assert _all_pass(_right)


@pytest.mark.parametrize("wrong", WRONG, ids=lambda f: f.__name__.removeprefix("_wrong_"))
def test_wrong_sharded_variant_is_rejected(wrong):
    assert not _all_pass(wrong), f"{wrong.__name__} passed every check: the checks are too loose"


# ==========================================================================================
# Single process: inputs, bad input, world size 1
# ==========================================================================================
def test_shards_reassemble_the_full_inputs():
    """`shard_of` gives rank r columns r of tp; with fused_qkv, q and k are views into one qkv
    shard (a free token stride). `make_inputs` is rank 0 of those at tp=1 by default."""
    full = tp.make_full_inputs(3, 64, 32, torch.float16, seed=2)
    for fused in (True, False):
        shards = [tp.shard_of(full, r, 4, fused_qkv=fused) for r in range(4)]
        for name in ("q", "k", "q_weight", "k_weight"):
            assert torch.equal(torch.cat([s[f"{name}_shard"] for s in shards], dim=-1), full[name])
        q0, k0 = shards[0]["q_shard"], shards[0]["k_shard"]
        assert q0.shape == (3, 16) and k0.shape == (3, 8)
        if fused:
            assert q0._base is k0._base and q0.stride() == (16 + 2 * 8, 1)
        else:
            assert q0.is_contiguous() and k0.is_contiguous()
    one = tp.make_inputs(3, 64, 32, torch.float16, seed=2)
    assert torch.equal(one["q_shard"], full["q"]) and torch.equal(one["k_weight_shard"], full["k_weight"])


def _good(dtype=torch.bfloat16):
    return tp.make_inputs(2, 128, 64, dtype, DEVICE, seed=5)


def _bad_cases():
    with_ = functools.partial(bad_case, _good)

    def strided_last(a):
        q = a["q_shard"]
        return torch.randn(q.shape[:-1] + (q.shape[-1] * 2,)).to(dtype=q.dtype, device=q.device)[..., ::2]

    def uncollapsible(a):
        return torch.ones(4, 2, 128, dtype=a["q_shard"].dtype, device=a["q_shard"].device).permute(1, 0, 2)

    def zeros(*shape):
        return lambda a: a["q_shard"].new_zeros(*shape)

    return [
        ("q_shard not a tensor", with_(q_shard=lambda a: a["q_shard"].tolist()), TypeError,
         "q_shard: expected a torch.Tensor"),
        ("k_shard not a tensor", with_(k_shard=None), TypeError, "k_shard: expected a torch.Tensor"),
        ("integer q_shard", with_(q_shard=lambda a: a["q_shard"].to(torch.int32)), TypeError, "q_shard: expected"),
        ("q_shard of rank 1", with_(q_shard=lambda a: a["q_shard"][0]), ValueError, "q_shard: expected [tokens..., "),
        ("token mismatch", with_(k_shard=lambda a: a["k_shard"][:1]), ValueError,
         "k_shard: expected the token dims of q_shard"),
        ("dtype mismatch", with_(k_shard=lambda a: a["k_shard"].half()), TypeError,
         "k_shard: expected the dtype of q_shard"),
        ("odd shard width", with_(q_shard=lambda a: a["q_shard"][..., :63], q_weight_shard=lambda a: a["q_weight_shard"][:63]),
         ValueError, "q_shard: expected an even shard width"),
        ("shard width too big", with_(k_shard=zeros(2, 65538), k_weight_shard=zeros(65538)), ValueError,
         "k_shard: expected an even shard width in [2, 65536]"),
        ("strided last dim", with_(q_shard=strided_last), ValueError, "q_shard: expected [tokens..., q_shard_width] with a contiguous last dim"),
        ("uncollapsible token dims", with_(q_shard=uncollapsible, k_shard=lambda a: a["k_shard"].new_ones(2, 4, 64)),
         ValueError, "q_shard: expected [tokens..., q_shard_width] whose token dims collapse"),
        ("weight length", with_(q_weight_shard=lambda a: a["q_weight_shard"][:32]), ValueError,
         "q_weight_shard: expected [q_shard_width=128]"),
        ("weight dtype", with_(k_weight_shard=lambda a: a["k_weight_shard"].half()), TypeError,
         "k_weight_shard: expected [k_shard_width=64]"),
        ("weight not a tensor", with_(k_weight_shard=1.0), TypeError, "k_weight_shard: expected a torch.Tensor"),
        ("negative eps", with_(eps=-1e-6), ValueError, "eps: expected a finite float >= 0"),
        ("nan eps", with_(eps=float("nan")), ValueError, "eps: expected a finite float >= 0"),
        ("eps not a number", with_(eps="1e-6"), TypeError, "eps: expected a float"),
        ("bad rounding", with_(rounding="bf16"), ValueError, "rounding: expected one of"),
        ("bad weight_offset", with_(weight_offset=float("inf")), ValueError, "weight_offset"),
        ("group not a process group", with_(group="world"), TypeError,
         "group: expected a torch.distributed ProcessGroup or None, got str"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label,make,error,fragment", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_is_rejected_untouched(backend, label, make, error, fragment):
    assert_rejected_untouched(cookbook.tp_qk_norm, make(), error, fragment, backend=backend)


def test_bad_backend_name():
    assert_rejected_untouched(cookbook.tp_qk_norm, _good(), ValueError, "backend: expected one of", backend="triton")


@pytest.mark.skipif(ON_GPU, reason="checks the CPU-tensor error of the CUDA backend")
def test_cpu_tensors_with_cuda_backend():
    fragment = "backend='cuda': expected CUDA tensors, got tensors on cpu"
    assert_rejected_untouched(cookbook.tp_qk_norm, _good(), ValueError, fragment, backend="cuda")


@pytest.mark.parametrize("tp_size,q_width,k_width,fragment", [
    (4, 68, 32, "q: expected a width divisible by 2 * tp = 8"),
    (4, 64, 36, "k: expected a width divisible by 2 * tp = 8"),
    (2, 6, 4, "q: expected a width divisible by 2 * tp = 4"),
], ids=["q_width", "k_width", "odd_shards"])
def test_virtual_tp_rejects_uneven_shards_untouched(tp_size, q_width, k_width, fragment):
    """Every shard must have an even width: q's and k's widths must divide by 2 * tp."""
    full = tp.make_full_inputs(4, q_width, k_width, torch.float32, DEVICE, seed=3)
    assert_rejected_untouched(tp.virtual_tp, dict(full, tp=tp_size), ValueError, fragment)


@pytest.mark.parametrize("bad_tp", [0, -2, 2.0, True, "2", None], ids=repr)
def test_virtual_tp_rejects_bad_tp_untouched(bad_tp):
    full = tp.make_full_inputs(2, 64, 32, torch.bfloat16, DEVICE, seed=4)
    assert_rejected_untouched(tp.virtual_tp, dict(full, tp=bad_tp), ValueError, "tp: expected an int >= 1")


def test_virtual_tp_checks_its_tensors_like_cross_head_norm():
    """virtual_tp runs cross_head_norm's checks: a bad tensor is named as in that op."""
    full = tp.make_full_inputs(2, 64, 32, torch.bfloat16, DEVICE, seed=4)
    full["k_weight"] = full["k_weight"][:16]
    assert_rejected_untouched(tp.virtual_tp, dict(full, tp=2), ValueError, "k_weight: expected [k_hidden=32]")


@pytest.mark.parametrize("backend", ["auto", "reference", "numba"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_world_size_one_is_cross_head_norm(backend, dtype):
    """Without torch.distributed the group is this process alone (tp=1): the call is
    cross_head_norm on the same backend, bit for bit, returns the shards themselves and agrees
    with the contract; v (the rest of the qkv shard) is left alone."""
    assert not (dist.is_available() and dist.is_initialized()), "this test needs torch.distributed uninitialized"
    if backend == "numba":
        require(registry.latest("cross_head_norm", "numba"))
    assert tp.world_of(None) == (0, 1)
    make = dict(num_tokens=3, q_width=64, k_width=32, dtype=dtype, device=DEVICE, seed=6, weight_dtype=torch.float32,
                kind="zero_rows")
    shards = tp.make_inputs(**make)
    plain = {name.removesuffix("_shard"): t for name, t in tp.make_inputs(**make).items()}  # the same, as cross_head_norm's
    want = tp.expected(tp.make_full_inputs(**make), 0, 1, 1e-6, 1.0, "hf")
    qkv = shards["q_shard"]._base
    v_before = qkv[:, 96:].clone()

    q, k = cookbook.tp_qk_norm(**shards, weight_offset=1.0, rounding="hf", backend=backend)
    cookbook.cross_head_norm(**plain, weight_offset=1.0, rounding="hf", backend=backend)
    assert q is shards["q_shard"] and k is shards["k_shard"]
    assert torch.equal(q, plain["q"]) and torch.equal(k, plain["k"]), "tp=1 should be cross_head_norm exactly"
    assert torch.equal(qkv[:, 96:], v_before), "v (the rest of qkv) was modified"
    assert_all_ok(reports(f"tp_qk_norm(backend={backend})", {"q_shard": q, "k_shard": k}, want, "hf"))


# ==========================================================================================
# Several processes: gloo ranks. The functions named `_rank_*` run on every rank of a pool
# (by name: `distributed.GlooPool.run`) and return plain data for the test to judge.
# ==========================================================================================
BASELINE = "all_gather_norm"  # the contract's all-gather baseline (the registry's "all_gather" peer lists CUDA only)


def _cpu_implementations():
    """(name, backend) of every implementation that runs on CPU tensors: the registered reference
    and Numba versions (backend: the public op's `backend=` that picks it, None for an older
    version) and the all-gather baseline (None)."""
    found = []
    for impl in registry.implementations(OP, ("reference", "numba")):
        if impl.unavailable("cpu") is None:
            found.append((impl.name, impl.level if impl is registry.latest(OP, impl.level) else None))
    return found + [(BASELINE, None)]


def _run_impl(name, backend, shards, eps, weight_offset, rounding):
    """Through the public op where `backend=` picks it, else on the checked arguments."""
    if backend is not None:
        cookbook.tp_qk_norm(**shards, eps=eps, weight_offset=weight_offset, rounding=rounding, backend=backend)
        return
    args = tp.check_inputs(**shards, eps=eps, weight_offset=weight_offset, rounding=rounding)
    tp.check_ranks_agree(args)
    (tp.all_gather_norm if name == BASELINE else registry.get(OP, name).fn)(*fields(args))


def _rank_matches_full_norm(rank, world, case):
    """Every CPU implementation on this rank's shard against this rank's columns of the full
    float64 norm and of virtual TP; zero rows stay zero, nothing is NaN, v is left alone.
    Returns {"implementations": names, "zero_rows": count, "reports": [(ok, message)]}."""
    full = full_inputs(case)
    eps, offset, rounding = case["eps"], case["weight_offset"], case["rounding"]
    want = tp.expected(full, rank, world, eps, offset, rounding)
    virtual = dict(zip(OUTPUTS, (x.tensor_split(world, dim=-1)[rank] for x in run_virtual(full, world, case))))
    mine = tp.shard_of(full, rank, world, fused_qkv=False)
    zero = {out: mine[out].eq(0).all(-1) for out in OUTPUTS}
    found, names = [], []
    for name, backend in _cpu_implementations():
        names.append(name)
        shards = tp.shard_of(full, rank, world, fused_qkv=case["fused_qkv"])
        qkv = shards["q_shard"]._base
        v_from = sum(shards[out].shape[-1] for out in OUTPUTS)
        v_before = None if qkv is None else qkv[:, v_from:].clone()
        _run_impl(name, backend, shards, eps, offset, rounding)
        label = f"rank {rank}/{world} {name}"
        found += reports(label, {out: shards[out] for out in OUTPUTS}, want, rounding, versus=("virtual TP", virtual))
        for out in OUTPUTS:
            found.append((not shards[out].isnan().any(), f"{label}:{out}: NaN in the output"))
            found.append((shards[out][zero[out]].eq(0).all(), f"{label}:{out}: a zero row did not stay zero"))
        if v_before is not None:
            found.append((torch.equal(qkv[:, v_from:], v_before), f"{label}: v (the rest of qkv) was modified"))
    zero_rows = sum(int(z.sum()) for z in zero.values())
    return dict(implementations=names, zero_rows=zero_rows, reports=[(bool(ok), m) for ok, m in found])


def _mismatched_shape(rank, what):
    """{"tokens", "q_shard width", "k_shard width"} of this rank's call: odd ranks differ in `what`."""
    shape = {"tokens": 2, "q_shard width": 4, "k_shard width": 2}
    if rank % 2:
        shape[what] += 1 if what == "tokens" else 2
    return shape


def _rank_rejects_mismatch(rank, world, what, backend):
    """Call with this rank's (mismatched) shape; report the error, whether the shards were left
    untouched, and whether a matching call right after completes (no rank was left behind in a
    collective, so the group is still in step)."""
    tokens, q_sw, k_sw = _mismatched_shape(rank, what).values()
    shards = tp.make_inputs(tokens, q_sw * world, k_sw * world, torch.bfloat16, seed=rank, rank=rank, tp=world)
    before = {out: shards[out].clone() for out in OUTPUTS}
    error = None
    try:
        cookbook.tp_qk_norm(**shards, backend=backend)
    except Exception as e:  # judged by the test
        error = (type(e).__name__, str(e))
    untouched = all(torch.equal(shards[out], before[out]) for out in OUTPUTS)
    follow_up = tp.make_inputs(1, 4 * world, 2 * world, torch.float32, seed=9, rank=rank, tp=world)
    full = tp.make_full_inputs(1, 4 * world, 2 * world, torch.float32, seed=9)
    cookbook.tp_qk_norm(**follow_up, backend="reference")
    want = tp.expected(full, rank, world, 1e-6, 0.0, "fused")
    after = [(bool(ok), m) for ok, m in reports("follow-up call", {o: follow_up[o] for o in OUTPUTS}, want, "fused")]
    return dict(error=error, untouched=untouched, follow_up=after)


def _rank_compiled_matches(rank, world):
    """torch.compile(fullgraph=True) of a function that calls the public op: one opaque custom op
    in the graph (the group passed by name), the same result as the float64 norm."""
    full = tp.make_full_inputs(3, 8 * world, 4 * world, torch.float32, seed=21)
    shards = tp.shard_of(full, rank, world)

    def step(q, k, q_weight, k_weight):
        cookbook.tp_qk_norm(q, k, q_weight, k_weight, backend="reference")
        return q.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(shards["q_shard"], shards["k_shard"], shards["q_weight_shard"], shards["k_weight_shard"])
    want = tp.expected(full, rank, world, 1e-6, 0.0, "fused")
    return [(bool(ok), m) for ok, m in reports(f"rank {rank} compiled", {o: shards[o] for o in OUTPUTS}, want, "fused")]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def pool(request):
    """A pool of W gloo ranks for this module's tests, shut down (none left alive) at the end."""
    if GLOO_REASON:
        pytest.skip(GLOO_REASON)
    started = GlooPool(request.param)
    yield started
    started.close()
    alive = started.alive()
    assert not alive, f"worker processes still alive after shutdown: {alive}"


def _target(fn):
    return f"{fn.__module__}:{fn.__name__}"


def _rank_raises_on_odd_ranks(rank, world):
    if rank % 2:
        raise ValueError(f"rank {rank} refuses")
    return rank


def _rank_and_group_size(rank, world):
    return rank, dist.get_world_size()


def _rank_0_waits_alone(rank, world):
    """Rank 0 enters an all-reduce that no other rank joins: a hang."""
    if rank == 0:
        dist.all_reduce(torch.zeros(1))
    return rank


@needs_gloo
def test_pool_reports_errors_and_bounds_hangs():
    """The harness itself: a task that raises on some ranks fails with their tracebacks and the
    pool goes on; a task that hangs fails after the timeout, the workers are killed (none left)
    and the pool refuses further tasks at once."""
    own = GlooPool(2)  # this test's own pool: it will be killed
    try:
        with pytest.raises(AssertionError, match=r"raised on ranks \[1\]:(.|\n)*ValueError: rank 1 refuses"):
            own.run(_target(_rank_raises_on_odd_ranks))
        assert own.run(_target(_rank_and_group_size)) == [(0, 2), (1, 2)], "the pool should go on after an error"
        own.timeout = 3.0  # the workers have imported everything: only the hang is left to wait for
        with pytest.raises(AssertionError, match=r"ranks \[0\] did not finish within 3 s"):
            own.run(_target(_rank_0_waits_alone))
        assert not own.alive(), "the workers of a hung task should be killed"
        with pytest.raises(AssertionError, match="unusable"):
            own.run(_target(_rank_and_group_size))
    finally:
        own.close()
    assert not own.alive()


SHARD_WIDTHS = [2, 6, 16, 32]  # even; full widths up to 64 (2 ranks) and 128 (4 ranks)


def tp_cases():
    shard_width = st.sampled_from(SHARD_WIDTHS)
    return st.fixed_dictionaries(dict(
        tokens=st.sampled_from([0, 1, 2, 3]), q_shard_width=shard_width, k_shard_width=shard_width,
        dtype=st.sampled_from(DTYPES), fp32_weight=st.booleans(), fused_qkv=st.booleans(),
        kind=st.sampled_from(cross.INPUT_KINDS), rounding=st.sampled_from(["fused", "hf"]),
        weight_offset=st.sampled_from([0.0, 1.0]), eps=st.sampled_from([1e-6, 0.0]), seed=st.integers(0, 2**16),
    ))


def _case(tokens, q_shard_width=6, k_shard_width=2, dtype=torch.bfloat16, **more):
    return dict(dict(tokens=tokens, q_shard_width=q_shard_width, k_shard_width=k_shard_width, dtype=dtype,
                     fp32_weight=False, fused_qkv=True, kind="normal", rounding="fused", weight_offset=0.0,
                     eps=1e-6, seed=0), **more)


def _run_matches_full_norm(pool, case):
    """Send one case to every rank; assert every implementation on every rank agreed."""
    case = dict(case, q_width=case["q_shard_width"] * pool.world, k_width=case["k_shard_width"] * pool.world)
    results = pool.run(_target(_rank_matches_full_norm), case=case)
    want_names = {name for name, _ in _cpu_implementations()}
    assert want_names >= {"reference", "numba_v1", BASELINE}, want_names
    for rank, result in enumerate(results):
        assert set(result["implementations"]) == want_names, f"rank {rank} ran {result['implementations']}"
    assert_all_ok([r for result in results for r in result["reports"]])
    return results


@needs_gloo
@at_most(10)
@given(case=tp_cases())
@example(case=_case(0))
@example(case=_case(2, kind="tiny", eps=1e-6))  # mean(x^2) far below eps: eps counted once, not per rank
@example(case=_case(1, dtype=torch.float16, fp32_weight=True, rounding="hf", weight_offset=1.0, fused_qkv=False))
def test_ranks_match_the_full_norm(pool, case):
    """Each rank's shard, normalized by the reference, the Numba pipeline and the all-gather
    baseline, equals its columns of cross_head_norm on the full rows (the float64 value or the
    HF-order reference, to the contract's tolerances) and its columns of virtual TP (the same
    float32 sums up to order); T from 0, fused-qkv views or contiguous shards."""
    _run_matches_full_norm(pool, case)


@needs_gloo
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ranks_zero_rows_with_eps_0_give_zeros(pool, dtype):
    """eps=0 with all-zero rows: every rank finishes, the zero rows stay exactly zero (no NaN
    from 0 * rsqrt(0)), the other rows are right."""
    case = _case(4, q_shard_width=4, k_shard_width=2, dtype=dtype, kind="zero_rows", eps=0.0, seed=3)
    results = _run_matches_full_norm(pool, case)
    assert all(result["zero_rows"] > 0 for result in results), "the case needs all-zero rows on every rank"


@needs_gloo
@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("what,name", [("tokens", "q_shard"), ("q_shard width", "q_shard"),
                                       ("k_shard width", "k_shard")], ids=["tokens", "q_width", "k_width"])
def test_rank_mismatch_raises_on_every_rank(pool, backend, what, name):
    """Odd ranks hold one more token (or wider shards) than even ranks: every rank raises a
    ValueError naming the argument, its own value and the group's range - none waits forever for
    partial sums that never come - leaves its shards untouched, and the group stays in step (a
    matching call right after succeeds on every rank)."""
    results = pool.run(_target(_rank_rejects_mismatch), what=what, backend=backend)
    noun = "tokens" if what == "tokens" else "shard width"
    values = [_mismatched_shape(rank, what)[what] for rank in range(pool.world)]
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank}: no error"
        kind, message = result["error"]
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        assert message.startswith(f"{name}: expected the same {noun} on every rank of the group (tp={pool.world})"), message
        assert f"rank {rank} has {values[rank]}, the group has {min(values)}..{max(values)}" in message, message
        assert result["untouched"], f"rank {rank}: the shards were modified before the error"
        assert_all_ok(result["follow_up"])


@needs_gloo
def test_compiled_call_matches_the_full_norm(pool):
    """Inside torch.compile(fullgraph=True) the op is one custom op; every rank's result is right."""
    assert_all_ok([r for result in pool.run(_target(_rank_compiled_matches)) for r in result])


@needs_gloo
def test_eight_ranks():
    """tp=8 (a full node): fixed cases agree on every rank, a token mismatch
    raises on every rank, torch.compile works. Its own pool: 8 ranks for a few cases only."""
    eight = GlooPool(8)
    try:
        for case in (_case(3, q_shard_width=8, k_shard_width=4),
                     _case(2, dtype=torch.float32, rounding="hf", weight_offset=1.0, fused_qkv=False),
                     _case(4, q_shard_width=4, k_shard_width=2, kind="zero_rows", eps=0.0, seed=3)):
            _run_matches_full_norm(eight, case)
        for result in eight.run(_target(_rank_rejects_mismatch), what="tokens", backend="numba"):
            assert result["error"] is not None and result["error"][0] == "ValueError", result["error"]
            assert result["untouched"]
            assert_all_ok(result["follow_up"])
        assert_all_ok([r for result in eight.run(_target(_rank_compiled_matches)) for r in result])
    finally:
        eight.close()


# ==========================================================================================
# Collective safety: ranks that disagree on the math, a rank that rejects its call, a rank that
# never makes it, and the fused kernel's header and reports (read on a CPU).
# ==========================================================================================
# (field, the argument named in the error, what it says must be the same, odd ranks' change)
DISAGREEMENTS = [
    ("eps", "eps", "eps", dict(eps=1e-5)),
    ("weight_offset", "weight_offset", "weight_offset", dict(weight_offset=1.0)),
    ("rounding", "rounding", "rounding", dict(rounding="hf")),
    ("dtype", "q_shard", "dtype", dict(dtype=torch.float16)),
    ("weight_dtype", "k_weight_shard", "dtype (float32 or the activation dtype)", dict(k_weight_fp32=True)),
    ("backend", "backend", "implementation", dict(backend="numba")),
]


def _call_options(rank, change):
    """Keyword arguments of this rank's call: the defaults, with `change` on odd ranks."""
    options = dict(eps=1e-6, weight_offset=0.0, rounding="fused", dtype=torch.bfloat16, k_weight_fp32=False,
                   backend="reference")
    return {**options, **change} if rank % 2 else options


def _follow_up(rank, world):
    """A matching call after a failed one: [(ok, message)] (the group is still in step)."""
    full = tp.make_full_inputs(1, 4 * world, 2 * world, torch.float32, seed=9)
    shards = tp.shard_of(full, rank, world)
    cookbook.tp_qk_norm(**shards, backend="reference")
    want = tp.expected(full, rank, world, 1e-6, 0.0, "fused")
    return [(bool(ok), m) for ok, m in reports("follow-up call", {o: shards[o] for o in OUTPUTS}, want, "fused")]


def _rank_disagrees(rank, world, change):
    """This rank's call with `change` on odd ranks: the error each rank raised, whether its shards
    were left untouched, and a follow-up call's reports."""
    o = _call_options(rank, change)
    full = tp.make_full_inputs(2, 4 * world, 2 * world, o["dtype"], seed=3,
                               weight_dtype=torch.float32 if o["k_weight_fp32"] else None)
    shards = tp.shard_of(full, rank, world)
    if o["k_weight_fp32"]:  # only k's weight in float32: q's stays in the activation dtype
        shards["q_weight_shard"] = shards["q_weight_shard"].to(o["dtype"])
    before = {out: shards[out].clone() for out in OUTPUTS}
    error = None
    try:
        cookbook.tp_qk_norm(**shards, eps=o["eps"], weight_offset=o["weight_offset"], rounding=o["rounding"],
                            backend=o["backend"])
    except Exception as e:  # judged by the test
        error = (type(e).__name__, str(e))
    untouched = all(torch.equal(shards[out], before[out]) for out in OUTPUTS)
    return dict(error=error, untouched=untouched, follow_up=_follow_up(rank, world))


@needs_gloo
@pytest.mark.parametrize("field,name,what,change", DISAGREEMENTS, ids=[d[0] for d in DISAGREEMENTS])
def test_ranks_that_disagree_on_the_math_raise_on_every_rank(pool, field, name, what, change):
    """Odd ranks call with another eps, weight_offset, rounding, dtype, weight storage or backend:
    every rank raises a ValueError naming the argument before anything is written (one small
    all-reduce compares them all), and the group stays in step."""
    for rank, result in enumerate(pool.run(_target(_rank_disagrees), change=change)):
        assert result["error"] is not None, f"rank {rank}: no error"
        kind, message = result["error"]
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        assert message.startswith(f"{name}: expected the same {what} on every rank of the group (tp={pool.world})"), \
            message
        assert result["untouched"], f"rank {rank}: the shards were modified"
        assert_all_ok(result["follow_up"])


def _rank_rejects_its_call(rank, world):
    """Odd ranks pass a k_weight_shard of the wrong length: they raise their own error, and the
    others must hear of it at once (not after the wait limit, set long here)."""
    from cookbook import tp_workspace

    tp_workspace.set_wait_limit(dist.group.WORLD, 60.0)
    shards = tp.make_inputs(2, 4 * world, 2 * world, torch.bfloat16, seed=rank, rank=rank, tp=world)
    if rank % 2:
        shards["k_weight_shard"] = shards["k_weight_shard"][:1]
    before = {out: shards[out].clone() for out in OUTPUTS}
    start, error = time.monotonic(), None
    try:
        cookbook.tp_qk_norm(**shards, backend="reference")
    except Exception as e:  # judged by the test
        error = (type(e).__name__, str(e))
    seconds = time.monotonic() - start
    tp_workspace.set_wait_limit(dist.group.WORLD, tp_workspace.DEFAULT_WAIT_LIMIT_S)
    untouched = all(torch.equal(shards[out], before[out]) for out in OUTPUTS)
    return dict(error=error, seconds=seconds, untouched=untouched, follow_up=_follow_up(rank, world))


@needs_gloo
def test_a_rank_that_rejects_its_call_tells_the_others(pool):
    """A rank whose own arguments are bad raises its error, and still takes part in the call to
    say so: the other ranks raise at once (no wait), nothing is written anywhere, and the group
    stays in step for the next call."""
    for rank, result in enumerate(pool.run(_target(_rank_rejects_its_call))):
        assert result["error"] is not None, f"rank {rank}: no error"
        kind, message = result["error"]
        if rank % 2:
            assert kind == "ValueError" and message.startswith("k_weight_shard: expected"), message
        else:
            assert kind == "RuntimeError", f"rank {rank}: {kind}: {message}"
            assert message.startswith("tp_qk_norm: rank ") and "rejected its arguments" in message, message
        assert result["seconds"] < 10, f"rank {rank} took {result['seconds']:.1f} s: it waited instead of hearing"
        assert result["untouched"]
        assert_all_ok(result["follow_up"])


def _rank_refuses_meta_shards(rank, world):
    """Every rank calls with meta shards, which the Numba kernels cannot read: the error each rank
    raised, and a follow-up call's reports (the group is still in step)."""
    shards = tp.make_inputs(2, 4 * world, 2 * world, torch.bfloat16, seed=rank, rank=rank, tp=world)
    shards = {name: torch.empty_like(t, device="meta") for name, t in shards.items()}
    error = None
    try:
        cookbook.tp_qk_norm(**shards, backend="numba")
    except Exception as e:  # judged by the test
        error = (type(e).__name__, str(e))
    return dict(error=error, follow_up=_follow_up(rank, world))


@needs_gloo
def test_meta_shards_are_refused_on_every_rank(pool):
    for rank, result in enumerate(pool.run(_target(_rank_refuses_meta_shards))):
        assert result["error"] is not None, f"rank {rank}: no error"
        kind, message = result["error"]
        assert kind == "ValueError" and "backend='numba': expected CUDA tensors" in message, f"rank {rank}: {message}"
        assert "got tensors on meta" in message, message
        assert_all_ok(result["follow_up"])


WAIT_LIMIT_S = 1.0


def _rank_0_stays_away(rank, world):
    """On a group of its own, every rank but 0 calls with a short wait limit; rank 0 never does.
    Returns (the first call's error and seconds, the next call's error and seconds)."""
    from cookbook import tp_workspace

    group = dist.new_group(list(range(world)))
    tp_workspace.set_wait_limit(group, WAIT_LIMIT_S)
    outcomes = []
    if rank != 0:
        for _ in range(2):
            shards = tp.make_inputs(2, 4 * world, 2 * world, torch.float32, seed=1, rank=rank, tp=world)
            start = time.monotonic()
            try:
                cookbook.tp_qk_norm(**shards, group=group, backend="reference")
                outcomes.append((None, time.monotonic() - start))
            except Exception as e:  # judged by the test
                outcomes.append(((type(e).__name__, str(e)), time.monotonic() - start))
    dist.barrier()  # (on the default group) every other rank has given up ...
    if rank == 0:  # ... so rank 0 completes their pending exchange: nothing is left in flight
        dist.all_reduce(torch.zeros(2 * len(tp.AGREED), dtype=torch.int64), op=dist.ReduceOp.MAX, group=group)
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    return outcomes


@needs_gloo
def test_a_rank_that_never_calls_makes_the_others_fail_in_bounded_time(pool):
    """A rank that never makes the call (it left the op early without telling, or crashed): the
    others raise a RuntimeError naming tp_qk_norm after the group's wait limit, not the process
    group's timeout; and their next call raises at once (the group is out of step), never a hang
    or a result computed with another call's values."""
    for rank, outcomes in enumerate(pool.run(_target(_rank_0_stays_away))):
        if rank == 0:
            continue
        (first, first_s), (second, second_s) = outcomes
        assert first is not None and first[0] == "WaitLimitExceeded", first
        assert first[1].startswith(f"tp_qk_norm: rank {rank} waited more than {WAIT_LIMIT_S:g} s"), first[1]
        assert WAIT_LIMIT_S <= first_s < WAIT_LIMIT_S + 5, f"rank {rank} gave up after {first_s:.1f} s"
        assert second is not None and second == ("RuntimeError", first[1]), second
        assert second_s < 0.5, f"the next call took {second_s:.1f} s instead of raising at once"


def _header_constants():
    """{name: value} of the integer constants of the protocol (kernels_cuda/tp_qk_norm/params.h, exchange.cuh)."""
    folder = Path(__file__).resolve().parents[1] / "kernels_cuda" / "tp_qk_norm"
    text = (folder / "params.h").read_text() + (folder / "exchange.cuh").read_text()
    return {m.group(1): int(m.group(2), 0) for m in
            re.finditer(r"constexpr (?:int|uint32_t) (k\w+) = (0x[0-9a-f]+|\d+)u?;", text)}


def test_protocol_constants_match_the_kernel():
    """cookbook/tp_workspace.py decodes what the kernel writes: the header words, the math word's
    bits, the counters and the status words must be numbered alike on both sides."""
    from cookbook import tp_workspace as w

    k = _header_constants()
    assert (k["kHeaderTokens"], k["kHeaderWidths"], k["kHeaderEps"], k["kHeaderOffset"], k["kHeaderMath"],
            k["kHeaderWords"]) == (w.TOKENS, w.WIDTHS, w.EPS, w.WEIGHT_OFFSET, w.MATH, w.HEADER_WORDS)
    assert (k["kWidthShift"], k["kMathDTypeShift"], k["kMathHfBit"], k["kMathQWeightFp32Bit"],
            k["kMathKWeightFp32Bit"], k["kMathImplementationShift"], k["kMathCallShift"], k["kAbsent"]) == \
        (w.WIDTH_SHIFT, w.MATH_DTYPE_SHIFT, w.MATH_HF_BIT, w.MATH_Q_WEIGHT_FP32_BIT, w.MATH_K_WEIGHT_FP32_BIT,
         w.MATH_VERSION_SHIFT, w.MATH_CALL_SHIFT, w.ABSENT)
    assert [k[f"k{n}Counter"] for n in ("Epoch", "Done", "Failed", "GaveUp", "WaitLimit")] == \
        [w.EPOCH_COUNTER, w.DONE_COUNTER, w.FAILED_COUNTER, w.GAVE_UP_COUNTER, w.WAIT_LIMIT_COUNTER]
    assert [k[f"kReport{n}"] for n in ("What", "Theirs", "Ours", "Epoch")] == \
        [w.REPORT_WHAT, w.REPORT_THEIRS, w.REPORT_OURS, w.REPORT_EPOCH] and k["kNumCounters"] == w.COUNTER_WORDS
    assert (k["kStatusReport"], k["kStatusCallNumber"], k["kNumStatusWords"]) == \
        (w.STATUS_REPORT, w.STATUS_CALL_NUMBER, w.STATUS_WORDS)
    assert (k["kMismatch"], k["kGaveUp"], k["kReportPeerShift"], k["kReportWordShift"], 1 << k["kTickShift"]) == \
        (w.MISMATCH, w.GAVE_UP, w.REPORT_PEER_SHIFT, w.REPORT_WORD_SHIFT, w.TICK_NS)


class _FakeGroup:
    group_name = "fake-group-for-reports"


def _reported(kind, word, ours, theirs, peer=1):
    """Raise what a CPU stand-in of the fused workspace reports: (exception type, message, the
    group's end or None)."""
    from cookbook import tp_workspace as w

    ws = w.Workspace(None, None, [], torch.zeros(w.COUNTER_WORDS, dtype=torch.int32),
                     torch.zeros(w.STATUS_WORDS, dtype=torch.int64), rank=0, world=2, capacity=8)
    what = kind | peer << w.REPORT_PEER_SHIFT | word << w.REPORT_WORD_SHIFT
    ws.counters[w.REPORT_WHAT:w.REPORT_EPOCH + 1] = torch.tensor([what, theirs, ours, 17], dtype=torch.int64).to(
        torch.int32)
    ws.status[w.STATUS_REPORT] = 1
    group = _FakeGroup()
    w._workspaces[group.group_name] = ws
    try:
        with pytest.raises((ValueError, RuntimeError)) as info:
            w.raise_pending_errors(group)
        assert not ws.status[w.STATUS_REPORT] and not ws.counters[w.REPORT_WHAT:].any(), "the report was not consumed"
        return info.type, str(info.value), w.failure(group)
    finally:
        del w._workspaces[group.group_name]
        w._states.pop(group.group_name, None)


@pytest.mark.parametrize("word,ours,theirs,argument,fragment", [
    ("tokens", dict(tokens=5), dict(tokens=6), "q_shard", "the same tokens on every rank of the group (tp=2); an "
                                                          "earlier fused tp_qk_norm call had 5 on rank 0 and 6 on rank 1"),
    ("shard widths", dict(k_width=64), dict(k_width=66), "k_shard", "the same shard width"),
    ("shard widths", dict(q_width=128), dict(q_width=130), "q_shard", "the same shard width"),
    ("eps", dict(eps=1e-6), dict(eps=1e-5), "eps", "had 1e-06 on rank 0 and 1e-05 on rank 1"),
    ("weight_offset", dict(weight_offset=0.0), dict(weight_offset=1.0), "weight_offset", "had 0 on rank 0 and 1 on"),
    ("math", dict(rounding="fused"), dict(rounding="hf"), "rounding", "the same rounding"),
    ("math", dict(dtype=torch.bfloat16), dict(dtype=torch.float16), "q_shard", "the same dtype"),
    ("math", dict(k_weight_dtype=torch.float32), dict(), "k_weight_shard",
     "the same dtype (float32 or the activation dtype) on every rank"),
    ("math", dict(version=7), dict(version=6), "backend", "the same implementation on every rank of the group "
                                                            "(tp=2); an earlier fused tp_qk_norm call had cuda_v7"),
    ("math", dict(call_number=7), dict(call_number=6), "tp_qk_norm", "the same sequence of calls"),
])
def test_fused_reports_name_the_argument(word, ours, theirs, argument, fragment):
    """A header word the kernel found different on another rank becomes a ValueError naming the
    argument and both ranks' values, raised once (the report is consumed); not the group's end."""
    from cookbook import tp_workspace as w

    call = dict(tokens=4, q_width=128, k_width=64, eps=1e-6, weight_offset=0.0, dtype=torch.bfloat16,
                rounding="fused", q_weight_dtype=torch.bfloat16, k_weight_dtype=torch.bfloat16, version=7)
    i = w.HEADER_FIELDS.index(word)
    error, message, ended = _reported(w.MISMATCH, i, w.header(**{**call, **ours})[i], w.header(**{**call, **theirs})[i])
    assert error is ValueError and message.startswith(f"{argument}: expected") and fragment in message, message
    assert ended is None


def test_fused_reports_of_absent_peers_and_of_giving_up():
    """A peer's absent header (it rejected its call) is a RuntimeError naming the rank; this rank
    giving up on a peer's header is a RuntimeError that also ends the group (every later call)."""
    from cookbook import tp_workspace as w

    error, message, ended = _reported(w.MISMATCH, w.TOKENS, 4, w.ABSENT, peer=1)
    assert error is RuntimeError and message.startswith("tp_qk_norm: rank 1 did not take part"), message
    assert ended is None
    error, message, ended = _reported(w.GAVE_UP, w.MATH, 0, 0, peer=3)
    assert error is RuntimeError and message.startswith("tp_qk_norm: rank 0 gave up waiting for rank 3's header of "
                                                        "fused launch 17"), message
    assert ended == message


# ==========================================================================================
# The benchmark's reading of its own sweeps (no GPU): the published comparison
# ==========================================================================================
def _sweep_rows(times, widths=(6144, 1024)):
    """Result rows of a sweep: {(impl, tokens): us}."""
    return [dict(impl=impl, shape=[tokens, *widths], label=f"T={tokens}", median_us=us, p20_us=us, p80_us=us,
                 slowest_us=us, method="graph", error="") for (impl, tokens), us in times.items()]


def test_pages_set_the_latest_version_beside_the_published_figures():
    """At the published token counts the page gives the latest CUDA C version (and its ratio to the
    published figure), the fastest version and the local shard, and says whether the timing is the
    same method; the back-to-back table names rank 0's and the slowest rank's means."""
    from cookbook.bench import tp as bench_tp

    latest = registry.fastest(OP).name
    times = {(latest, 1): 2.86, ("cuda_v6", 1): 2.5, (bench_tp.LOCAL_SHARD, 1): 1.5, (latest, 2048): 8.4}
    rows = _sweep_rows(times)
    text = bench_tp.published_comparison(rows, dict(world=4, gpu="NVIDIA H200", timing_mode=bench_tp.BACK_TO_BACK))
    assert "the same GPUs and TP; this page's timing: the same method" in text, text
    assert f"| 1      | 2.6          | 2.86 (1.10x)" in text and "cuda_v6 2.50" in text and "1.50" in text, text
    assert "| 2048" in text and "| 128 " not in text, text
    other = bench_tp.published_comparison(rows, dict(world=2, gpu="NVIDIA H100", timing_mode=bench_tp.GRAPH))
    assert "not like for like: 2 x NVIDIA H100 here" in other and "graph replays after a barrier" in other
    assert bench_tp.published_comparison(_sweep_rows({(latest, 3): 1.0}), dict(world=4, gpu="x", timing_mode="graph")) == ""
    table = bench_tp.table(rows, bench_tp.BACK_TO_BACK)
    assert "rank 0's mean us" in table and "slowest rank's mean us" in table


@pytest.mark.parametrize("mode", ["back_to_back", "graph"])
def test_every_row_of_a_shape_is_timed_in_the_run_s_mode(monkeypatch, mode):
    """Rank 0 times the second row of a shape as it timed the first (its printout once replaced the
    timing mode, so rank 0 left the back-to-back path after one row while the other ranks kept it,
    and their collectives never met). The timing functions and collectives are stand-ins: what is
    checked is which path each row takes."""
    from cookbook.bench import tp as bench_tp

    taken = []
    monkeypatch.setattr(bench_tp, "time_back_to_back", lambda fn, per_set: taken.append("back_to_back") or 2.0)
    monkeypatch.setattr(bench_tp, "time_per_call", lambda fn, per_set, calls: taken.append("graph") or ([2.0], "graph"))
    monkeypatch.setattr(bench_tp, "make_sets", lambda shape, dtype, rank, world, count: (None, [(None, None)]))
    monkeypatch.setattr(bench_tp, "extra_rows", lambda shape, sets, group: [("row_a", print, [()]), ("row_b", print, [()])])
    monkeypatch.setattr(bench_tp.bench, "rotating_set_count", lambda *args: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: dataclasses.make_dataclass(
        "Properties", [("total_memory", int, 0)])())

    class OneRank:  # the collectives of a group of one
        @staticmethod
        def barrier():
            pass

        @staticmethod
        def all_gather_object(everyone, mine):
            everyone[0] = mine

        @staticmethod
        def get_world_size():
            return 1

    monkeypatch.setattr(bench_tp, "dist", OneRank)
    rows = bench_tp.run_shape((1, 64, 32), torch.bfloat16, 0, 1, None, {"l2_bytes": 0}, ["row_a", "row_b"], mode)
    assert [r["error"] for r in rows] == ["", ""], rows
    assert set(taken) == {mode} and len(rows) == 2, taken


def test_bench_shapes_keep_the_asked_token_counts():
    """`--tokens` keeps those counts of a shape set; with `--shapes minimax` any count gets MiniMax-M2's widths."""
    from cookbook.bench import tp as bench_tp
    assert bench_tp.bench_shapes("minimax", [1, 256, 1024]) == [[1, 6144, 1024], [256, 6144, 1024], [1024, 6144, 1024]]
    assert [sh[0] for sh in bench_tp.bench_shapes("minimax")] == [
        sh[0] for sh in tp.BENCH_SHAPES if tuple(sh[1:]) == bench_tp.MINIMAX_WIDTHS]
    decode = bench_tp.bench_shapes("decode", [1, 256])
    assert decode and all(sh[0] == 1 for sh in decode), decode
    assert bench_tp.bench_shapes("full", [3]) == []


@pytest.mark.parametrize("tokens", ["", "1,x", "0", "128,-4", "1,,2"])
def test_bench_tokens_that_are_not_positive_counts_are_refused(tokens, capsys):
    """`--tokens` names itself, what it got and what it expects, before any process starts."""
    from cookbook.bench import tp as bench_tp
    with pytest.raises(SystemExit) as exit_info:
        bench_tp.main(["--shapes", "minimax", "--tokens", tokens])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--tokens" in err and "positive integers" in err and repr(tokens) in err, err


def test_the_tuned_extension_holds_what_backend_cuda_runs():
    """backend="cuda" runs the tuned kernel; its extension also holds the NCCL path and the absent
    launch, so that neither builds another extension."""
    from cookbook import api, cuda, registry

    tuned = registry.fastest("tp_qk_norm")
    assert tuned.level == "tuned" and tuned.extension == cuda.tp_tuned() == api.NCCL_FALLBACK.extension
    assert set(cuda.tp_tuned().tp_steps) == {"sum_sq", "apply", "fused", "absent", "explain"}
    assert api.is_fused(tuned) and not api.is_fused(api.NCCL_FALLBACK)
    assert not api.is_fused(registry.get("tp_qk_norm", "cuda_v1")) and api.is_fused(registry.get("tp_qk_norm", "cuda_v2"))
