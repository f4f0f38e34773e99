"""`qk_norm_rope`: per-head RMSNorm of q and k, then rotary embedding, in place, one pass.

Contract
--------
``qk_norm_rope(q, k, q_weight, k_weight, cos_sin_cache, positions, eps=1e-6, *, is_neox=True,
rope_dim=None, position_offset=0, weight_offset=0.0, rounding="fused", validate_positions=False,
backend="auto")``

* ``q``, ``k``, ``q_weight``, ``k_weight``, ``eps``, ``weight_offset``: exactly as in `qk_norm`
  (``[tokens..., heads, head_dim]``, any GQA ratio, free token and head strides, contiguous last
  dim, float32/float16/bfloat16, weights ``[head_dim]`` in that dtype or float32).
* ``cos_sin_cache``: ``[max_position, rope_dim]``, contiguous; row p holds ``cos(p * f_i)`` in its
  first half and ``sin(p * f_i)`` in its second half (i < rope_dim / 2; the vLLM / SGLang /
  FlashInfer convention), float32 or the activation dtype.
* ``rope_dim``: defaults to the cache width and must equal it; even, from 2 to head_dim. Only the
  first ``rope_dim`` dims of a head rotate (partial rotary); the rest pass through normalized.
* pairs: ``is_neox=True`` rotates halves, pair i is dims ``(i, i + rope_dim/2)``;
  ``is_neox=False`` is GPT-J's interleaved layout, pair i is dims ``(2i, 2i + 1)``. Pair i uses
  ``cos_i, sin_i`` of the token's cache row.
* ``positions``: the token dims of q (``[T]`` for 3-D q), int32 or int64, contiguous. Token t uses
  cache row ``p = positions[t] + position_offset`` (64-bit sum).
* math, per (token, head) row ``x`` of length D and pair ``(a_i, b_i)`` of the normalized row::

      n  = x * rsqrt(mean(x^2) + eps) * (w + weight_offset)      (qk_norm's math)
      a' = a * cos_i - b * sin_i
      b' = b * cos_i + a * sin_i

* ``rounding="fused"``: n stays in float32 and is rotated in float32; one rounding at the end.
  ``rounding="hf"``: the Hugging Face order, each step rounded to the activation dtype: n as in
  `qk_norm`'s "hf" (``round(round(x * rstd) * round(w + weight_offset))``), cos and sin rounded to
  the dtype, then ``a' = round(round(a * cos) - round(b * sin))``,
  ``b' = round(round(b * cos) + round(a * sin))`` (``q * cos + rotate_half(q) * sin`` in that dtype).
* Out-of-range positions (``p < 0`` or ``p >= max_position``): no backend ever reads outside the
  cache, and none clamps. The kernels cannot raise without a host sync, so such a token gets
  ``cos = sin = NaN``: its rotated dims come out NaN (loud, never a silently wrong angle), its
  pass-through dims are normalized as usual. ``validate_positions=True`` checks the range on the
  host first (one device sync; not under torch.compile or CUDA-graph capture) and raises a
  ValueError naming the first bad token, with nothing written.
* Returns ``(q, k)``, the same tensors, in place. Nothing is written unless every check passes.
* Edges, as in `qk_norm` (docs/edge_cases.md): q and k share no byte with each other or with
  anything the op reads (weights, ``cos_sin_cache``, ``positions``); no broadcast or overlapping
  heads, no requires-grad q or k, no inference tensors outside inference mode; a NaN or Inf in a
  row, or a sum of squares past float32's range, makes the whole row NaN, rotated dims included;
  eps and weight_offset are used as float32; num_q_heads or num_kv_heads may be 0.

Bytes moved: q and k read once and written once; per token its position and one cache row; the
weights once per launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cookbook import _checks as C
from cookbook.ops import qk_norm as qk_norm_contract
from cookbook.ops.qk_norm import rms_norm_rows
from cookbook.testing import Tolerance

OP = "qk_norm_rope"
MAX_HEAD_DIM = qk_norm_contract.MAX_HEAD_DIM
POSITION_DTYPES = (torch.int32, torch.int64)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Rope:
    """The rotary settings of one call, as one input value (`make_inputs` returns it under "rope").

    Immutable, so `clone()` returns itself: an inputs dict copies like a dict of tensors."""

    is_neox: bool = True
    rope_dim: int | None = None  # None: the cache width
    position_offset: int = 0

    def clone(self) -> Rope:
        return self


# --------------------------------------------------------------------------------------------
# Checks: the one function every backend runs first.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QKNormRopeArgs:
    """Checked arguments: q and k viewed as `[T, H, D]`, positions as `[T]` (no copies)."""

    q: torch.Tensor
    k: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    cos_sin_cache: torch.Tensor
    positions: torch.Tensor
    eps: float
    weight_offset: float
    rounding: str
    is_neox: bool
    rope_dim: int
    position_offset: int


def _require_int(name: str, value, expected: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected {expected}, got {value!r}")
    return int(value)


def check_inputs(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding,
                 rope=Rope()) -> QKNormRopeArgs:
    norm = qk_norm_contract.check_arguments(q, k, q_weight, k_weight, eps, weight_offset, rounding)
    head_dim = norm.q.shape[-1]
    if not isinstance(rope, Rope):
        raise TypeError(f"rope: expected a {__name__}.Rope, got {type(rope).__name__}")
    if not isinstance(rope.is_neox, bool):
        raise TypeError(f"is_neox: expected a bool, got {rope.is_neox!r}")
    offset = _require_int("position_offset", rope.position_offset, "an int")
    if not INT64_MIN <= offset <= INT64_MAX:
        raise ValueError(f"position_offset: expected a 64-bit int, got {offset!r}")

    C.require_tensor("cos_sin_cache", cos_sin_cache)
    expect_cache = f"[max_position, rope_dim] (cos | sin) in {q.dtype} or float32 on {q.device}"
    if cos_sin_cache.dtype not in (q.dtype, torch.float32):
        raise TypeError(f"cos_sin_cache: expected {expect_cache}, got {C.describe(cos_sin_cache)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[0] < 1:
        raise ValueError(f"cos_sin_cache: expected {expect_cache} with max_position >= 1, got {C.describe(cos_sin_cache)}")
    if cos_sin_cache.device != q.device:
        raise ValueError(f"cos_sin_cache: expected {expect_cache}, got {C.describe(cos_sin_cache)}")
    if not cos_sin_cache.is_contiguous():
        raise ValueError(f"cos_sin_cache: expected {expect_cache}, contiguous, got {C.describe(cos_sin_cache)}")
    width = cos_sin_cache.shape[1]
    rope_dim = width if rope.rope_dim is None else _require_int("rope_dim", rope.rope_dim, "an int or None")
    if rope_dim != width:
        raise ValueError(
            f"cos_sin_cache: expected [max_position, rope_dim={rope_dim}] (rope_dim is the cache width), "
            f"got {C.describe(cos_sin_cache)}"
        )
    if rope_dim % 2 or not 2 <= rope_dim <= head_dim:
        raise ValueError(
            f"rope_dim: expected an even rope_dim in [2, head_dim={head_dim}], got rope_dim={rope_dim} "
            f"(cos_sin_cache {C.describe(cos_sin_cache)})"
        )

    C.require_tensor("positions", positions)
    token_dims = tuple(q.shape[:-2])
    expect_pos = f"[tokens...={token_dims}] int32 or int64, contiguous, on {q.device}"
    if positions.dtype not in POSITION_DTYPES:
        raise TypeError(f"positions: expected {expect_pos}, got {C.describe(positions)}")
    if tuple(positions.shape) != token_dims or positions.device != q.device or not positions.is_contiguous():
        raise ValueError(f"positions: expected {expect_pos}, got {C.describe(positions)}")
    check_in_place(q, k, q_weight, k_weight, cos_sin_cache, positions)
    return QKNormRopeArgs(norm.q, norm.k, norm.q_weight, norm.k_weight, cos_sin_cache, positions.view(-1),
                          norm.eps, norm.weight_offset, norm.rounding, rope.is_neox, rope_dim, offset)


def check_in_place(q, k, q_weight, k_weight, cos_sin_cache, positions) -> None:
    """q and k writable here, each element at its own address, sharing no byte with each other
    or with anything the op reads (`_checks.require_in_place`). Under torch.compile, run by the
    compiled op."""
    C.require_in_place(dict(q=q, k=k), dict(q_weight=q_weight, k_weight=k_weight, cos_sin_cache=cos_sin_cache,
                                            positions=positions))


def check_positions_in_range(positions, position_offset, max_position) -> None:
    """validate_positions=True: every positions[t] + position_offset in [0, max_position).
    Reads the positions on the host: a device sync."""
    p = positions.to("cpu", torch.int64).view(-1) + position_offset  # offsets fit: checked 64-bit
    bad = ((p < 0) | (p >= max_position)).nonzero()
    if bad.numel():
        t = int(bad[0])
        raise ValueError(
            f"positions: expected positions[t] + position_offset in [0, max_position={max_position}), got "
            f"positions[{t}] + {position_offset} = {int(p[t])} ({bad.numel()} of {p.numel()} tokens out of range)"
        )


# --------------------------------------------------------------------------------------------
# The reference: the math in readable PyTorch. The oracle for every test.
# --------------------------------------------------------------------------------------------
def cos_sin_rows(cos_sin_cache, positions, position_offset, acc_dtype):
    """(cos, sin) of every token, `[T, 1, rope_dim/2]` in `acc_dtype`; NaN for an out-of-range
    position (never read: the index is clamped only to form the gather, then masked)."""
    max_position, rope_dim = cos_sin_cache.shape
    p = positions.view(-1).to(torch.int64) + position_offset
    in_range = ((p >= 0) & (p < max_position)).view(-1, 1, 1)
    rows = cos_sin_cache[p.clamp(0, max_position - 1)].to(acc_dtype).unsqueeze(1)
    rows = torch.where(in_range, rows, torch.full_like(rows, float("nan")))
    return rows[..., : rope_dim // 2], rows[..., rope_dim // 2 :]


def pair_slices(rope_dim, is_neox):
    """The two members (a, b) of every rotated pair, as slices of the last dim."""
    half = rope_dim // 2
    if is_neox:
        return slice(0, half), slice(half, rope_dim)
    return slice(0, rope_dim, 2), slice(1, rope_dim, 2)


def rotate(n, cos, sin, rope_dim, is_neox, round_to=None):
    """Rotary embedding of the first `rope_dim` dims of `n` (out of place, n's dtype).

    `round_to`, if given, rounds every product and sum (the Hugging Face order in a low dtype)."""
    r = round_to or (lambda t: t)
    a_dims, b_dims = pair_slices(rope_dim, is_neox)
    a, b = n[..., a_dims], n[..., b_dims]
    out = n.clone()
    out[..., a_dims] = r(r(a * cos) - r(b * sin))
    out[..., b_dims] = r(r(b * cos) + r(a * sin))
    return out


def qk_norm_rope_rows(x, w, cos, sin, eps, weight_offset, rounding, rope_dim, is_neox):
    """Norm then rope of `x` `[T, H, D]`, out of place, in x's dtype (float64 stays float64)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    if rounding == "fused":
        n = rms_norm_rows(x, w, eps, weight_offset, "fused", out_dtype=acc)  # unrounded
        return rotate(n, cos.to(acc), sin.to(acc), rope_dim, is_neox).to(x.dtype)
    dtype = x.dtype

    def round_to(t):
        return t.to(dtype).to(acc)

    n = rms_norm_rows(x, w, eps, weight_offset, "hf").to(acc)  # rounded to the dtype
    return rotate(n, round_to(cos), round_to(sin), rope_dim, is_neox, round_to).to(dtype)


@torch.no_grad()
def reference(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding,
              is_neox, rope_dim, position_offset):
    """In-place PyTorch reference on checked views (any device): q, then k (so torch.compile writes
    each in place, as in qk_norm's); nothing is recorded for autograd."""
    acc = torch.float32
    cos, sin = cos_sin_rows(cos_sin_cache, positions, position_offset, acc)
    q.copy_(qk_norm_rope_rows(q, q_weight, cos, sin, eps, weight_offset, rounding, rope_dim, is_neox))
    k.copy_(qk_norm_rope_rows(k, k_weight, cos, sin, eps, weight_offset, rounding, rope_dim, is_neox))
    return q, k


def expected(inputs, eps, weight_offset, rounding):
    """{output: (float64 exact value, Hugging Face-order reference or None)} for unmodified inputs
    (see cookbook.testing.agreement)."""
    a = check_inputs(**inputs, eps=eps, weight_offset=weight_offset, rounding=rounding)
    out = {}
    for name, x, w in (("q", a.q, a.q_weight), ("k", a.k, a.k_weight)):
        cos, sin = cos_sin_rows(a.cos_sin_cache, a.positions, a.position_offset, torch.float64)
        exact = qk_norm_rope_rows(x.double(), w.double(), cos, sin, eps, weight_offset, "fused", a.rope_dim, a.is_neox)
        rounded = None
        if rounding == "hf":
            cos32, sin32 = cos_sin_rows(a.cos_sin_cache, a.positions, a.position_offset, torch.float32)
            rounded = qk_norm_rope_rows(x, w, cos32, sin32, eps, weight_offset, "hf", a.rope_dim, a.is_neox)
        out[name] = (exact.view(inputs[name].shape), None if rounded is None else rounded.view(inputs[name].shape))
    return out


# --------------------------------------------------------------------------------------------
# Inputs, tolerances, bytes: what tests, benchmarks and notebooks share.
# --------------------------------------------------------------------------------------------
INPUT_KINDS = qk_norm_contract.INPUT_KINDS
ROPE_BASE = 10000.0  # theta of the rotary frequencies f_i = theta^(-2i / rope_dim)


def make_cos_sin_cache(max_position, rope_dim, dtype=torch.float32, device="cpu", base=ROPE_BASE):
    """`[max_position, rope_dim]`: cos(p * f_i) | sin(p * f_i), computed in float64, then stored."""
    half = rope_dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rope_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).to(dtype=dtype, device=device)


def make_inputs(
    num_tokens=8,
    num_q_heads=4,
    num_kv_heads=1,
    head_dim=128,
    rope_dim=None,
    is_neox=True,
    dtype=torch.bfloat16,
    device="cpu",
    *,
    seed=0,
    weight_dtype=None,
    fused_qkv=False,
    kind="normal",
    cache_dtype=torch.float32,
    max_position=None,
    position_dtype=torch.int64,
    position_offset=0,
):
    """Seeded inputs (q, k, weights as `qk_norm.make_inputs`), a cache of `max_position` rows
    (default 4 * num_tokens + 16), and random in-range positions for `position_offset`.
    Returns a dict of the op's arguments; the rotary settings travel as `rope`."""
    inputs = qk_norm_contract.make_inputs(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, seed=seed,
                                          weight_dtype=weight_dtype, fused_qkv=fused_qkv, kind=kind)
    rope_dim = head_dim if rope_dim is None else rope_dim
    max_position = 4 * num_tokens + 16 if max_position is None else max_position
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    low = max(0, -position_offset)
    high = max(low + 1, max_position - position_offset)  # positions + offset in [0, max_position)
    positions = torch.randint(low, high, (num_tokens,), generator=gen, dtype=torch.int64)
    inputs.update(
        cos_sin_cache=make_cos_sin_cache(max_position, rope_dim, cache_dtype, device),
        positions=positions.to(dtype=position_dtype, device=device),
        rope=Rope(is_neox, rope_dim, position_offset),
    )
    return inputs


# A rotation mixes two elements: an output near 0 (a * cos ~ b * sin) carries the absolute error
# of its O(1) inputs, so errors are counted in ulps of max(|value|, rms of the tensor) (the
# `rms_floor` of cookbook.testing). The HF order rounds the normalized value before the rotation;
# one flipped rounding there (float32 rstd differs in the last bit) moves both outputs of the
# pair by an ulp of the larger member: up to a few ulps at the rms scale.
TOLERANCES = {
    torch.bfloat16: Tolerance(fused_ulp=0.52, hf_ulp=4.01, hf_exact_share=0.99, rms_floor=1.0),
    torch.float16: Tolerance(fused_ulp=0.52, hf_ulp=4.01, hf_exact_share=0.99, rms_floor=1.0),
    torch.float32: Tolerance(fused_ulp=64.0, hf_ulp=64.0, hf_exact_share=0.0, rms_floor=1.0),
}


def bytes_moved(q, k, q_weight, k_weight, cos_sin_cache, positions) -> int:
    """Fewest bytes a launch must move: q and k read and written once, each token's position and
    cache row read once, the weights once. (Where positions repeat, as in the benchmark's
    sequences, a cache row is counted once per token: under 1 % of the bytes at its shapes.)"""
    act = (q.numel() + k.numel()) * q.element_size() * 2
    tokens = positions.numel()
    per_token = positions.element_size() + cos_sin_cache.shape[1] * cos_sin_cache.element_size()
    weights = q_weight.numel() * q_weight.element_size() + k_weight.numel() * k_weight.element_size()
    return act + tokens * per_token + weights


def split_scratch_bytes(q, k) -> int:
    """What a split path (a norm kernel, then a rope kernel) moves on top of `bytes_moved`: every
    normalized row written to memory in float32 by the first kernel and read back by the second."""
    return (q.numel() + k.numel()) * 4 * 2


def flops(q, k) -> int:
    """About 7 flops per element (norm: 4; rotation: 2 products and a sum per output)."""
    return 7 * (q.numel() + k.numel())


# Shapes the benchmark sweeps: (tokens, q heads, kv heads, head_dim, rope_dim, is_neox[, sequences]).
# Qwen3's decode and prefill (NeoX, head_dim 128; 8B: 32/8 heads, 32B: 64/8), the diffusion
# transformers' image attention at 1024x1024 (4096 image tokens: FLUX 24 heads, Qwen-Image 32, with
# its partial rotary variant, Z-Image 30; interleaved where the model rotates complex pairs) and
# two 2048-token images in one call (their positions repeat), and a head_dim-256 interleaved case
# with a rope_dim that is not a power of two. A seventh element splits the tokens into that many
# sequences of equal length, each with positions 0, 1, ...
BENCH_SHAPES = [
    (1, 32, 8, 128, 128, True),  # Qwen3-8B decode, one sequence
    (64, 32, 8, 128, 128, True),  # Qwen3-8B decode, 64 sequences
    (4096, 32, 8, 128, 128, True),  # Qwen3-8B prefill
    (4096, 24, 24, 128, 128, True),  # flux_1024, NeoX
    (4096, 24, 24, 128, 128, False),  # flux_1024
    (4096, 32, 32, 128, 128, True),  # qwen_image_1024
    (4096, 32, 32, 128, 64, True),  # qwen_image_partial
    (4096, 30, 30, 128, 128, False),  # zimage_1024
    (4096, 24, 24, 128, 128, False, 2),  # batch2_medium: two images of 2048 tokens
    (8192, 64, 8, 128, 128, True),  # Qwen3-32B prefill
    (2048, 16, 4, 256, 96, False),
]
SIM_SHAPES = [(2, 2, 1, 64, 64, True), (3, 2, 1, 32, 12, False)]


def bench_case(shape, dtype, device, seed=0):
    """(kwargs, label) for one benchmark shape; q and k as views of one fused qkv tensor, a float32
    cache, positions 0..T-1 (an image's patches), or 0..T/S-1 per sequence for S sequences."""
    t, hq, hk, d, rope_dim, is_neox, *rest = shape
    sequences = rest[0] if rest else 1
    if len(rest) > 1 or not isinstance(sequences, int) or sequences < 1 or t % sequences:
        raise ValueError(f"shape: expected (tokens, q heads, kv heads, head_dim, rope_dim, is_neox[, sequences "
                         f"dividing tokens]), got {shape!r}")
    inputs = make_inputs(t, hq, hk, d, rope_dim, is_neox, dtype, device, seed=seed, fused_qkv=True,
                         max_position=max(t // sequences, 1))
    if torch.device(device).type != "meta":
        inputs["positions"] = torch.arange(t // sequences, dtype=torch.int64, device=device).repeat(sequences)
    layout = "neox" if is_neox else "interleaved"
    label = f"T={t} Hq={hq} Hk={hk} D={d} rope={rope_dim} {layout}"
    return inputs, label + (f" sequences={sequences}" if sequences > 1 else "")
