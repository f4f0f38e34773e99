"""qk_norm_rope: every registered implementation agrees with the contract; identity and
composition hold; wrong variants (swapped halves, wrong pairing, flipped sin, rope before norm)
are caught; bad inputs get a clear error and leave the tensors untouched; out-of-range positions
follow the documented policy."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cookbook
from cookbook import registry
from cookbook.ops import qk_norm as norm_contract
from cookbook.ops import qk_norm_rope as contract
from cookbook.testing import agreement
from helpers import assert_rejected_untouched, BACKENDS, bad_case, clone_inputs, DEVICE, fields, kernel_impls, ON_GPU, require, run_and_compare

OP = "qk_norm_rope"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FAST_HEAD_DIMS = [64, 128, 256]  # the vector kernels' (kernels_cuda/qk_norm_rope/)
GENERAL_HEAD_DIMS = [96, 80, 130, 512]


def shape_strategy(impl):
    """(tokens, q heads, kv heads, head_dim, rope_dim): tiny under the simulator; on a GPU (and
    for the reference) the odd token counts that catch tail bugs and full / partial rope dims,
    non-powers of two included."""
    simulated = impl.level == "numba" and not ON_GPU
    tokens = st.sampled_from([1, 2, 3] if simulated else [1, 2, 127, 129])
    heads = st.integers(1, 2 if simulated else 9)
    head_dim = st.sampled_from([32, 64] if simulated else FAST_HEAD_DIMS + GENERAL_HEAD_DIMS)

    @st.composite
    def shapes(draw):
        d = draw(head_dim)
        rope_dim = draw(st.sampled_from([d, 2 * (d // 4), 2 * (3 * d // 8), 2 * (d // 3), 2]))
        return draw(tokens), draw(heads), draw(heads), d, max(2, rope_dim)

    return shapes()


def case_strategy():
    return st.fixed_dictionaries(
        dict(
            dtype=st.sampled_from(DTYPES),
            is_neox=st.booleans(),
            fp32_weight=st.booleans(),
            fp32_cache=st.booleans(),
            fused_qkv=st.booleans(),
            odd_offset=st.booleans(),
            kind=st.sampled_from(contract.INPUT_KINDS),
            rounding=st.sampled_from(["fused", "hf"]),
            weight_offset=st.sampled_from([0.0, 1.0]),
            eps=st.sampled_from([1e-6, 0.0]),
            position_dtype=st.sampled_from([torch.int32, torch.int64]),
            position_offset=st.sampled_from([0, 5, -3]),
            seed=st.integers(0, 2**16),
        )
    )


def build(shape, case):
    tokens, hq, hk, head_dim, rope_dim = shape
    inputs = contract.make_inputs(
        tokens, hq, hk, head_dim, rope_dim, case["is_neox"], case["dtype"], DEVICE, seed=case["seed"],
        fused_qkv=case["fused_qkv"], weight_dtype=torch.float32 if case["fp32_weight"] else None, kind=case["kind"],
        cache_dtype=torch.float32 if case["fp32_cache"] else case["dtype"], position_dtype=case["position_dtype"],
        position_offset=case["position_offset"],
    )
    if case["fused_qkv"] and case["odd_offset"]:
        inputs["q"], inputs["k"] = _views_at_odd_offset(inputs["q"], inputs["k"])
    return inputs


def _views_at_odd_offset(q, k):
    """q and k copied into one buffer one element in, as views: odd storage offsets and an odd
    token stride (a 16-bit q cannot be read as 32-bit words there)."""
    tokens, hq, head_dim = q.shape
    hk = k.shape[1]
    buffer = torch.zeros(tokens, 1 + (hq + hk) * head_dim + 2, dtype=q.dtype, device=q.device)
    q_view = buffer[:, 1 : 1 + hq * head_dim].view(tokens, hq, head_dim)
    k_view = buffer[:, 1 + hq * head_dim : 1 + (hq + hk) * head_dim].view(tokens, hk, head_dim)
    q_view.copy_(q)
    k_view.copy_(k)
    return q_view, k_view


@pytest.mark.parametrize("impl", kernel_impls(OP))
def test_agrees_with_contract(impl):
    require(impl)

    @given(shape=shape_strategy(impl), case=case_strategy())
    def check(shape, case):
        inputs = build(shape, case)
        run_and_compare(OP, impl, inputs, eps=case["eps"], weight_offset=case["weight_offset"], rounding=case["rounding"])

    check()


# Fixed cases every implementation meets (on the simulator too): both layouts, partial rope with
# rope_dim / 2 not a multiple of the lane count, GQA down to kv = 1, both cache dtypes.
FIXED = [
    # (tokens, hq, hk, head_dim, rope_dim, is_neox, dtype, cache dtype, rounding)
    (3, 2, 1, 64, 64, True, torch.bfloat16, torch.float32, "fused"),
    (3, 2, 1, 64, 48, True, torch.bfloat16, torch.bfloat16, "hf"),
    (2, 2, 1, 64, 40, False, torch.float16, torch.float32, "hf"),
    (2, 1, 1, 96, 80, True, torch.float32, torch.float32, "fused"),
    (1, 2, 2, 64, 2, False, torch.bfloat16, torch.float32, "fused"),
]


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("case", FIXED, ids=lambda c: f"T{c[0]}-D{c[3]}-rope{c[4]}-{'neox' if c[5] else 'gptj'}-{str(c[6])[6:]}-{c[8]}")
def test_fixed_cases(impl, case):
    require(impl)
    t, hq, hk, d, rope_dim, is_neox, dtype, cache_dtype, rounding = case
    inputs = contract.make_inputs(t, hq, hk, d, rope_dim, is_neox, dtype, DEVICE, seed=9, fused_qkv=True,
                                  cache_dtype=cache_dtype, position_dtype=torch.int32, position_offset=2)
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=1.0, rounding=rounding)


@pytest.mark.parametrize("impl", kernel_impls(OP))
def test_misaligned_views_leave_v_alone(impl):
    """Rows off 16-byte boundaries take the general path, correctly; v is never touched."""
    require(impl)
    tokens, hq, hk, head_dim = 3, 2, 1, 64
    width = (hq + 2 * hk) * head_dim
    base = torch.randn(tokens, width + 1, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(DEVICE)
    qkv = base[:, 1:]
    inputs = contract.make_inputs(tokens, hq, hk, head_dim, 32, True, torch.bfloat16, DEVICE, seed=2)
    inputs["q"] = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    inputs["k"] = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim)
    v_before = qkv[:, (hq + hk) * head_dim :].clone()
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=0.0, rounding="fused")
    assert torch.equal(qkv[:, (hq + hk) * head_dim :], v_before), "v (the rest of qkv) was modified"


# ------------------------------------------------------------------------------------------
# numba_v3 reads bf16 rows as 32-bit words where it can and runs v2 elsewhere: each case checks
# which path ran, then the result (the property test above may not draw every case).
# ------------------------------------------------------------------------------------------
V3_CASES = [
    # (id, dtype, head_dim, rope_dim, is_neox, weight dtype, cache dtype, rounding, at an odd offset, word path)
    ("neox-full", torch.bfloat16, 64, 64, True, None, torch.float32, "fused", (), True),
    ("neox-partial-bf16-cache", torch.bfloat16, 64, 40, True, None, torch.bfloat16, "hf", (), True),
    ("neox-head-dim-96", torch.bfloat16, 96, 48, True, torch.float32, torch.float32, "fused", (), True),
    ("interleaved-bf16-cache", torch.bfloat16, 64, 64, False, None, torch.bfloat16, "fused", (), True),
    ("interleaved-odd-half", torch.bfloat16, 64, 10, False, torch.float32, torch.float32, "hf", (), True),
    ("interleaved-head-dim-256", torch.bfloat16, 256, 96, False, None, torch.float32, "fused", (), True),
    ("neox-rope-not-4k", torch.bfloat16, 64, 42, True, None, torch.float32, "fused", (), False),
    ("odd-offset-q-k", torch.bfloat16, 64, 64, False, None, torch.float32, "fused", ("q", "k"), False),
    ("odd-offset-weights", torch.bfloat16, 64, 64, True, None, torch.float32, "fused", ("q_weight", "k_weight"), False),
    ("odd-offset-cache", torch.bfloat16, 64, 64, False, None, torch.bfloat16, "fused", ("cos_sin_cache",), False),
    ("float16", torch.float16, 64, 64, True, None, torch.float32, "fused", (), False),
]


def _at_odd_offset(t):
    """A copy of contiguous `t` one element into a larger buffer: the same values at an odd storage offset."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buffer[1:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("case", V3_CASES, ids=lambda c: c[0])
def test_numba_v3_word_path_and_fallbacks(case, monkeypatch):
    impl = registry.get(OP, "numba_v3")
    require(impl)
    import kernels_numba.qk_norm_rope as numba_kernels

    _, dtype, head_dim, rope_dim, is_neox, weight_dtype, cache_dtype, rounding, odd, word_path = case
    v2_calls = []
    v2 = numba_kernels.qk_norm_rope_v2
    monkeypatch.setattr(numba_kernels, "qk_norm_rope_v2", lambda *args: v2_calls.append(1) or v2(*args))
    # 4 q + 2 k heads as fused-qkv views: at head_dim 64 one block of two warps holds 8 rows (2
    # idle), at 256 a row is a warp and a token has two head groups
    inputs = contract.make_inputs(2, 4, 2, head_dim, rope_dim, is_neox, dtype, DEVICE, seed=11, fused_qkv=True,
                                  weight_dtype=weight_dtype, cache_dtype=cache_dtype, position_offset=1)
    if "q" in odd:
        inputs["q"], inputs["k"] = _views_at_odd_offset(inputs["q"], inputs["k"])
    for name in set(odd) - {"q", "k"}:
        inputs[name] = _at_odd_offset(inputs[name])
    run_and_compare(OP, impl, inputs, eps=1e-6, weight_offset=1.0, rounding=rounding)
    assert bool(v2_calls) != word_path, "ran v2" if v2_calls else "ran the word path"


# ------------------------------------------------------------------------------------------
# Identity and composition.
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
def test_position_zero_is_the_plain_norm(impl, is_neox):
    """cos 0 = 1, sin 0 = 0: at position 0 the op is qk_norm, bit for bit in float32."""
    require(impl)
    inputs = contract.make_inputs(3, 2, 1, 64, 32, is_neox, torch.float32, DEVICE, seed=4, position_offset=0)
    inputs["positions"].zero_()
    normed = {name: inputs[name].clone() for name in ("q", "k", "q_weight", "k_weight")}
    norm_contract.reference(normed["q"], normed["k"], normed["q_weight"], normed["k_weight"], 1e-6, 0.0, "fused")
    args = contract.check_inputs(**inputs, eps=1e-6, weight_offset=0.0, rounding="fused")
    impl.fn(*fields(args))
    for name in ("q", "k"):
        torch.testing.assert_close(inputs[name], normed[name], rtol=2e-6, atol=2e-6)


def _separate_rope(x, cos_sin_cache, positions, offset, rope_dim, is_neox):
    """A plain rope, written independently of the contract: complex multiplication of pairs."""
    half = rope_dim // 2
    p = positions.long() + offset
    cos, sin = cos_sin_cache[p, :half].double(), cos_sin_cache[p, half:].double()
    angle = torch.complex(cos, sin)[:, None, :]
    xd = x.double()
    a, b = (xd[..., :half], xd[..., half:rope_dim]) if is_neox else (xd[..., 0:rope_dim:2], xd[..., 1:rope_dim:2])
    z = torch.complex(a, b) * angle
    out = xd.clone()
    if is_neox:
        out[..., :half], out[..., half:rope_dim] = z.real, z.imag
    else:
        out[..., 0:rope_dim:2], out[..., 1:rope_dim:2] = z.real, z.imag
    return out


@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleaved"])
def test_composition_norm_then_separate_rope(impl, is_neox):
    """qk_norm, then a separately written rope, equals the fused op (float32)."""
    require(impl)
    inputs = contract.make_inputs(3, 2, 2, 64, 48, is_neox, torch.float32, DEVICE, seed=6, position_offset=1)
    normed = {name: inputs[name].clone() for name in ("q", "k", "q_weight", "k_weight")}
    norm_contract.reference(normed["q"], normed["k"], normed["q_weight"], normed["k_weight"], 1e-6, 0.0, "fused")
    args = contract.check_inputs(**inputs, eps=1e-6, weight_offset=0.0, rounding="fused")
    impl.fn(*fields(args))
    for name in ("q", "k"):
        want = _separate_rope(normed[name], inputs["cos_sin_cache"], inputs["positions"], 1, 48, is_neox)
        torch.testing.assert_close(inputs[name].double(), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# Negative controls: plausible wrong implementations the same checks must reject.
# ------------------------------------------------------------------------------------------
def _rows(x, w, cos, sin, eps, weight_offset, rounding, rope_dim, is_neox):
    return contract.qk_norm_rope_rows(x, w, cos, sin, eps, weight_offset, rounding, rope_dim, is_neox)


def _wrong_swapped_halves(x, w, cos, sin, eps, weight_offset, rounding, rope_dim, is_neox):
    return _rows(x, w, sin, cos, eps, weight_offset, rounding, rope_dim, is_neox)  # sin read as cos


def _wrong_pairing(x, w, cos, sin, eps, weight_offset, rounding, rope_dim, is_neox):
    return _rows(x, w, cos, sin, eps, weight_offset, rounding, rope_dim, not is_neox)


def _wrong_sin_sign(x, w, cos, sin, eps, weight_offset, rounding, rope_dim, is_neox):
    return _rows(x, w, cos, -sin, eps, weight_offset, rounding, rope_dim, is_neox)


def _wrong_rope_before_norm(x, w, cos, sin, eps, weight_offset, rounding, rope_dim, is_neox):
    acc = torch.float32
    rotated = contract.rotate(x.to(acc), cos.to(acc), sin.to(acc), rope_dim, is_neox)
    return contract.rms_norm_rows(rotated, w, eps, weight_offset, rounding, out_dtype=x.dtype)


def _wrong_rounding_order(x, w, cos, sin, eps, weight_offset, rounding, rope_dim, is_neox):
    return _rows(x, w, cos, sin, eps, weight_offset, "fused" if rounding == "hf" else "hf", rope_dim, is_neox)


WRONG = [_wrong_swapped_halves, _wrong_pairing, _wrong_sin_sign, _wrong_rope_before_norm, _wrong_rounding_order]
CONTROL_CASES = [
    (dtype, rope_dim, is_neox, rounding)
    for dtype in (torch.float16, torch.bfloat16)
    for rope_dim in (128, 64)
    for is_neox in (True, False)
    for rounding in ("fused", "hf")
]


def _all_pass(rows_fn):
    for dtype, rope_dim, is_neox, rounding in CONTROL_CASES:
        # per-head weights, so "rope before norm" differs (a rotation keeps the row's rms but
        # moves elements onto other weights)
        inputs = contract.make_inputs(4, 4, 2, 128, rope_dim, is_neox, dtype, "cpu", seed=7)
        expected = contract.expected(inputs, 1e-6, 0.0, rounding)
        a = contract.check_inputs(**inputs, eps=1e-6, weight_offset=0.0, rounding=rounding)
        cos, sin = contract.cos_sin_rows(a.cos_sin_cache, a.positions, a.position_offset, torch.float32)
        for name, w in (("q", a.q_weight), ("k", a.k_weight)):
            actual = rows_fn(inputs[name], w, cos, sin, 1e-6, 0.0, rounding, rope_dim, is_neox)
            exact, rounded = expected[name]
            if not agreement(name, actual, exact, rounded, rounding, contract.TOLERANCES[dtype]).ok:
                return False
    return True


def test_reference_passes_the_control_cases():
    assert _all_pass(_rows)


@pytest.mark.parametrize("wrong", WRONG, ids=lambda f: f.__name__.removeprefix("_wrong_"))
def test_wrong_variant_is_rejected(wrong):
    assert not _all_pass(wrong), f"{wrong.__name__} passed every check: the checks are too loose"


# ------------------------------------------------------------------------------------------
# Out-of-range positions: never read outside the cache; NaN in the rotated dims, or a
# ValueError with validate_positions=True.
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", kernel_impls(OP))
@pytest.mark.parametrize("bad_position", [-1, 40], ids=["negative", "past_end"])
def test_out_of_range_position_gives_nan_in_rotated_dims(impl, bad_position):
    require(impl)
    rope_dim, head_dim = 32, 64
    inputs = contract.make_inputs(3, 2, 1, head_dim, rope_dim, True, torch.bfloat16, DEVICE, seed=8, max_position=40)
    inputs["positions"][1] = bad_position
    expected = contract.expected(clone_inputs(inputs), 1e-6, 0.0, "fused")
    args = contract.check_inputs(**inputs, eps=1e-6, weight_offset=0.0, rounding="fused")
    impl.fn(*fields(args))
    for name in ("q", "k"):
        out = inputs[name].cpu()
        assert out[1, :, :rope_dim].isnan().all(), f"{name}: the bad token's rotated dims should be NaN"
        assert not out[1, :, rope_dim:].isnan().any(), f"{name}: the pass-through dims stay normalized"
        good = [0, 2]
        exact = expected[name][0].cpu()
        result = agreement(name, out[good], exact[good], None, "fused", contract.TOLERANCES[torch.bfloat16])
        assert result.ok, result.message
        torch.testing.assert_close(out[1, :, rope_dim:].double(), exact[1, :, rope_dim:], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_validate_positions_raises_untouched(backend):
    inputs = contract.make_inputs(3, 2, 1, 64, 64, True, torch.bfloat16, DEVICE, seed=8, max_position=10)
    rope = inputs.pop("rope")
    inputs["positions"].zero_()
    inputs["positions"][2] = 8
    before = clone_inputs(inputs)
    with pytest.raises(ValueError, match=r"positions\[2\] \+ 3 = 11"):
        cookbook.qk_norm_rope(**inputs, position_offset=3, is_neox=rope.is_neox, validate_positions=True, backend=backend)
    for name in inputs:
        assert torch.equal(inputs[name], before[name]), f"{name} was modified before the error"


def test_validate_positions_passes_in_range():
    inputs = contract.make_inputs(3, 2, 1, 64, 64, True, torch.bfloat16, DEVICE, seed=8, position_offset=2)
    rope = inputs.pop("rope")
    cookbook.qk_norm_rope(**inputs, position_offset=rope.position_offset, validate_positions=True, backend="reference")


# ------------------------------------------------------------------------------------------
# The public op.
# ------------------------------------------------------------------------------------------
def _public_kwargs(inputs):
    inputs = dict(inputs)
    rope = inputs.pop("rope")
    return inputs, dict(is_neox=rope.is_neox, rope_dim=rope.rope_dim, position_offset=rope.position_offset)


def test_public_api_returns_the_same_tensors_and_leaves_v_alone():
    inputs = contract.make_inputs(4, 2, 1, 128, 64, False, torch.bfloat16, DEVICE, fused_qkv=True, position_offset=4)
    qkv = inputs["q"]._base
    v_before = qkv[:, 3 * 128 :].clone()
    expected = contract.expected(clone_inputs(inputs), 1e-6, 0.0, "fused")
    tensors, kwargs = _public_kwargs(inputs)
    q, k = cookbook.qk_norm_rope(**tensors, **kwargs)
    assert q is inputs["q"] and k is inputs["k"]
    assert torch.equal(qkv[:, 3 * 128 :], v_before)
    for name in ("q", "k"):
        assert agreement(name, inputs[name], expected[name][0], None, "fused", contract.TOLERANCES[torch.bfloat16]).ok


def test_leading_token_dims():
    """`[batch, seq, heads, head_dim]` with positions `[batch, seq]` works like the flat form."""
    inputs = contract.make_inputs(6, 2, 1, 64, 64, True, torch.float32, DEVICE, seed=3)
    tensors, kwargs = _public_kwargs(inputs)
    flat = clone_inputs(tensors)
    cookbook.qk_norm_rope(**flat, **kwargs, backend="reference")
    q4, k4 = tensors["q"].view(2, 3, 2, 64), tensors["k"].view(2, 3, 1, 64)
    cookbook.qk_norm_rope(q4, k4, tensors["q_weight"], tensors["k_weight"], tensors["cos_sin_cache"],
                          tensors["positions"].view(2, 3), **kwargs, backend="reference")
    assert torch.equal(q4.view(6, 2, 64), flat["q"]) and torch.equal(k4.view(6, 1, 64), flat["k"])


# ------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, and nothing written.
# ------------------------------------------------------------------------------------------
def _good(dtype=torch.bfloat16, device=DEVICE):
    tensors, kwargs = _public_kwargs(contract.make_inputs(2, 4, 2, 64, 32, True, dtype, device, seed=5))
    return dict(tensors, **kwargs)


def _bad_cases():
    with_ = functools.partial(bad_case, _good)

    return [
        ("q not a tensor", with_(q=lambda a: a["q"].tolist()), TypeError, "q: expected a torch.Tensor"),
        # a flattened [tokens, heads * head_dim] q or k is one token of one long head: the error says so
        ("flattened q", with_(q=lambda a: a["q"].reshape(2, 256)), ValueError,
         "q: read as 2-D [num_q_heads=2, head_dim=256] (one token, no token dims), but q_weight has head_dim=64; "
         "expected [tokens..., num_q_heads, head_dim=64]: view a flattened [tokens, num_q_heads * head_dim] q as "
         "q.view(2, 4, 64)"),
        ("flattened q and k", with_(q=lambda a: a["q"].reshape(2, 256), k=lambda a: a["k"].reshape(2, 128)), ValueError,
         "q: read as 2-D [num_q_heads=2, head_dim=256]"),
        ("flattened k", with_(k=lambda a: a["k"].reshape(2, 128)), ValueError,
         "k: read as 2-D [num_kv_heads=2, head_dim=128] (one token, no token dims), but k_weight has head_dim=64; "
         "expected [tokens..., num_kv_heads, head_dim=64]: view a flattened [tokens, num_kv_heads * head_dim] k as "
         "k.view(2, 2, 64)"),
        ("head_dim mismatch", with_(k=lambda a: a["k"][..., :32]), ValueError, "k: expected [tokens..., num_kv_heads, head_dim=64]"),
        ("dtype mismatch", with_(k=lambda a: a["k"].half()), TypeError, "k: expected the dtype of q"),
        ("cache not a tensor", with_(cos_sin_cache=lambda a: a["cos_sin_cache"].tolist()), TypeError, "cos_sin_cache: expected a torch.Tensor"),
        ("cache dtype", with_(cos_sin_cache=lambda a: a["cos_sin_cache"].half()), TypeError, "cos_sin_cache: expected [max_position, rope_dim]"),
        ("cache rank", with_(cos_sin_cache=lambda a: a["cos_sin_cache"].view(-1)), ValueError, "cos_sin_cache: expected [max_position, rope_dim]"),
        ("cache empty", with_(cos_sin_cache=lambda a: a["cos_sin_cache"][:0]), ValueError, "max_position >= 1"),
        ("cache strided", with_(cos_sin_cache=lambda a: a["cos_sin_cache"].t().contiguous().t()), ValueError, "contiguous"),
        ("rope_dim not the cache width", with_(rope_dim=16), ValueError, "rope_dim is the cache width"),
        ("odd rope_dim", with_(cos_sin_cache=lambda a: a["cos_sin_cache"][:, :31].contiguous(), rope_dim=None), ValueError, "rope_dim: expected an even rope_dim in [2, head_dim=64]"),
        ("rope_dim > head_dim", with_(cos_sin_cache=lambda a: torch.zeros(8, 66, dtype=torch.float32, device=DEVICE), rope_dim=None), ValueError, "rope_dim=66"),
        ("rope_dim not int", with_(rope_dim=32.0), TypeError, "rope_dim: expected an int or None"),
        ("positions float", with_(positions=lambda a: a["positions"].float()), TypeError, "positions: expected [tokens...=(2,)] int32 or int64"),
        ("positions length", with_(positions=lambda a: a["positions"][:1]), ValueError, "positions: expected [tokens...=(2,)]"),
        ("positions strided", with_(positions=lambda a: torch.zeros(4, dtype=torch.int64, device=DEVICE)[::2]), ValueError, "contiguous"),
        ("is_neox not bool", with_(is_neox=1), TypeError, "is_neox: expected a bool"),
        ("offset not int", with_(position_offset=1.5), TypeError, "position_offset: expected an int"),
        ("offset too big", with_(position_offset=2**63), ValueError, "position_offset: expected a 64-bit int"),
        ("bad rounding", with_(rounding="bf16"), ValueError, "rounding: expected one of"),
        ("negative eps", with_(eps=-1e-6), ValueError, "eps"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label,make,error,fragment", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_is_rejected_untouched(backend, label, make, error, fragment):
    assert_rejected_untouched(cookbook.qk_norm_rope, make(), error, fragment, backend=backend)


@pytest.mark.skipif(ON_GPU, reason="checks the CPU-tensor error of the CUDA backend")
def test_cpu_tensors_with_cuda_backend():
    fragment = "backend='cuda': expected CUDA tensors, got tensors on cpu"
    assert_rejected_untouched(cookbook.qk_norm_rope, _good(), ValueError, fragment, backend="cuda")



# ------------------------------------------------------------------------------------------
# The benchmark's shapes, and the tuned kernel's host policy compiled for the host alone.
# ------------------------------------------------------------------------------------------
def test_bench_shapes_hold_the_models_shapes():
    """Qwen3's decode and prefill, the diffusion transformers' 1024x1024 image attention (FLUX both
    layouts, Qwen-Image full and partial rope, Z-Image) and two images of 2048 tokens in one call."""
    wanted = [(1, 32, 8, 128, 128, True), (64, 32, 8, 128, 128, True), (4096, 32, 8, 128, 128, True),
              (8192, 64, 8, 128, 128, True), (4096, 24, 24, 128, 128, True), (4096, 24, 24, 128, 128, False),
              (4096, 32, 32, 128, 128, True), (4096, 32, 32, 128, 64, True), (4096, 30, 30, 128, 128, False),
              (4096, 24, 24, 128, 128, False, 2)]
    assert all(shape in contract.BENCH_SHAPES for shape in wanted)
    labels = [contract.bench_case(shape, torch.bfloat16, "meta")[1] for shape in contract.BENCH_SHAPES]
    assert len(set(labels)) == len(labels), "every bench shape has its own label"


def test_bench_case_of_several_sequences():
    inputs, label = contract.bench_case((8, 2, 1, 64, 64, False, 2), torch.float32, "cpu")
    assert inputs["positions"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3] and inputs["cos_sin_cache"].shape[0] == 4
    assert label.endswith("interleaved sequences=2")
    for bad in ((8, 2, 1, 64, 64, False, 3), (8, 2, 1, 64, 64, False, 0), (8, 2, 1, 64, 64, False, 2, 1)):
        with pytest.raises(ValueError, match="shape: expected"):
            contract.bench_case(bad, torch.float32, "cpu")


POLICY_DRIVER = r"""
#include <iostream>
#include "qk_norm_rope/policy.h"
using namespace cookbook::qk_norm_rope::tuned;
int main() {  // per line: T Hq Hk D rope neox weights_fp32 cache_fp32 rows_aligned tables_aligned sms bps_whole bps_steps
  long t; int hq, hk, d, rope, neox, w, c, rows, tables, sms, whole, steps;
  while (std::cin >> t >> hq >> hk >> d >> rope >> neox >> w >> c >> rows >> tables >> sms >> whole >> steps) {
    const Call call{cookbook::DType::kBFloat16, cookbook::Rounding::kFused, t, hq, hk, d, rope,
                    neox ? Layout::kNeox : Layout::kInterleaved, w ? TableDtype::kFloat32 : TableDtype::kActivation,
                    c ? TableDtype::kFloat32 : TableDtype::kActivation, rows != 0, tables != 0};
    std::cout << describe(plan(call, sms, [&](const Kernel& k) { return k.walk == Walk::kWholeTokens ? whole : steps; }))
              << "---\n";
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


# (call, blocks per SM of the whole-token and the steps kernels on 132 SMs) -> walk, grid, steps.
POLICY_CASES = [
    ("1 32 8 128 128 1 0 1 1 1 132 4 5", "Walk::kOneRow", 2, 0, 0),             # decode: 40 rows, 2 blocks
    ("64 32 8 128 128 1 0 1 1 1 132 4 5", "Walk::kOneRow", 80, 0, 0),           # 2560 rows, 80 blocks of 32 rows
    ("4096 24 24 128 128 1 0 1 1 1 132 4 5", "Walk::kWholeTokens", 528, 352, 0),  # 48 heads: a cycle of 3 blocks
    ("4096 30 30 128 128 0 0 1 1 1 132 5 5", "Walk::kWholeTokens", 660, 352, 0),  # 60 heads: a cycle of 15 blocks
    ("8192 64 8 128 128 1 0 1 1 1 132 4 4", "Walk::kSteps", 528, 234, 48),      # the cut (522) lengthens the walk
    ("8192 64 8 128 128 1 0 1 1 1 132 4 5", "Walk::kSteps", 660, 293, 24),
    ("2049 40 1 128 128 0 0 1 1 1 132 5 5", "Walk::kSteps", 660, 515, 5),       # 41 heads: 656 blocks, 5 rows not 4
    ("450 40 1 128 128 1 0 1 1 1 132 4 5", "Walk::kOneRow", 577, 0, 0),         # past the whole-token grid (its cut idles
                                                                                 # 36 of 528 blocks), within the steps' (660)
]


@pytest.mark.parametrize("line, walk, grid, token_step, head_step", POLICY_CASES, ids=[c[0] for c in POLICY_CASES])
def test_policy_walks(tmp_path_factory, line, walk, grid, token_step, head_step):
    (plan,) = _plans(tmp_path_factory, [line])
    assert plan["walk"] == walk and int(plan["grid"]) == grid, plan
    assert (int(plan["token_step"]), int(plan["head_step"])) == (token_step, head_step), plan
    assert plan["programmatic"] == "true" and plan["block"] == "256" and plan["off_vectors"] == "none"
    rows = int(plan["rows"])
    if walk != "Walk::kOneRow":  # a walk's steps are the grid's rows in whole tokens and heads
        heads = sum(map(int, line.split()[1:3]))
        assert token_step * heads + head_step == grid * int(plan["rows_per_block"]) and rows > grid * 32


@pytest.mark.parametrize("line, why", [("64 8 2 96 96 1 0 1 1 1 132 4 5", "head_dim_not_compiled"),
                                       ("64 8 2 512 512 1 0 1 1 1 132 4 5", "head_dim_not_compiled"),
                                       ("64 8 2 128 24 1 0 1 1 1 132 4 5", "rope_dim_not_whole_units"),
                                       ("64 8 2 128 128 1 0 1 0 1 132 4 5", "rows_unaligned"),
                                       ("64 8 2 128 128 1 0 1 1 0 132 4 5", "tables_unaligned")])
def test_policy_paths_off_the_vectors(tmp_path_factory, line, why):
    (plan,) = _plans(tmp_path_factory, [line])
    assert plan["kernel"].endswith("qk_norm_rope_v2_kernel") and plan["off_vectors"] == why, plan
    assert int(plan["grid"]) == 64 * 10 // 8 and plan["programmatic"] == "false"


def test_policy_kernel_names_its_template_arguments(tmp_path_factory):
    (plan, empty) = _plans(tmp_path_factory, ["4096 24 24 128 128 0 1 0 1 1 132 5 5", "0 24 24 128 128 0 1 0 1 1 132 5 5"])
    assert plan["template_values"] == "__nv_bfloat16,0,128,0,1,0,2"
    assert plan["template_arguments"] == ("T=__nv_bfloat16, kRounding=Rounding::kFused, kHeadDim=128, "
                                          "kLayout=Layout::kInterleaved, kWeights=TableDtype::kFloat32, "
                                          "kCache=TableDtype::kActivation, kWalk=Walk::kWholeTokens")
    assert empty["rows"] == "0" and empty["grid"] == "0"
