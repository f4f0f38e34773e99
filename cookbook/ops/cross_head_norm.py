"""`cross_head_norm`: RMSNorm of q and k over their whole hidden size, in place, in one launch.

OLMo2, Wan, LTX and MiniMax (at TP=1) normalize q and k across all heads at once rather than per
head: the statistic of a token's q row is the mean square of all its `heads * head_dim` elements.

Contract
--------
``cross_head_norm(q, k, q_weight, k_weight, eps=1e-6, *, weight_offset=0.0, rounding="fused", backend="auto")``

* ``q``: ``[tokens..., q_hidden]``, ``k``: ``[tokens..., k_hidden]``, the same token dims;
  **q_hidden and k_hidden may differ** (GQA). The last dim is contiguous; the token stride is free,
  so q and k may be views into one fused qkv tensor ``[T, q_hidden + 2 * k_hidden]``. Strides are
  64-bit in every kernel.
* ``[tokens..., heads, head_dim]`` views are accepted too, when the heads are packed (head stride
  = head_dim, so a token's heads are one run of ``heads * head_dim`` elements). **The weight's
  length names the row**: a weight ``[heads * head_dim]`` makes the last two dims one row; a
  weight as long as the last dim makes the last dim the row (so ``[T, H, D]`` with a ``[D]``
  weight is a per-head norm of T*H rows). Where both readings fit (one head), the one whose
  token dims match the other tensor's wins.
* dtypes float32, float16, bfloat16 (q and k alike); each weight ``[hidden]`` in that dtype or
  float32 (q_weight and k_weight independently).
* hidden sizes: any even size from 2 to 65536 (fast CUDA path up to 32768 in 16-bit dtypes,
  16384 in float32; beyond, a streaming path).
* math, per token row ``x`` of length H (the whole hidden), accumulated in float32::

      rstd = rsqrt(mean(x^2 over H) + eps)    (0 where mean(x^2) + eps == 0: eps=0 zero rows stay 0;
                                               NaN where it is NaN or +Inf)
      y    = x * rstd * (w + weight_offset)    (weight_offset=1.0 is Gemma's (1 + w), in float32)

* ``rounding``: as in `qk_norm` ("fused": one rounding at the end; "hf": the Hugging Face order
  ``round(round(x * rstd) * round(w + weight_offset))``).
* Returns ``(q, k)``, the same tensors, normalized in place. Nothing is written unless every check
  passes.
* Edges, as in `qk_norm` (docs/edge_cases.md): q and k share no byte with each other or with the
  weights (column slices of one qkv tensor are fine), no broadcast or overlapping rows, no
  requires-grad q or k, no inference tensors outside inference mode; a NaN or Inf anywhere in a
  token's row, or a sum of squares past 3.4e38 (every ``|x| > 2.0e17`` at H = 8192), makes the
  whole row NaN; with eps = 0, a row of only ``|x| <= 2**-75`` comes out as zeros; eps and
  weight_offset are used as float32 (``eps=1e300`` refused).

Bytes moved: q and k are read once and written once; the weights once per launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cookbook import _checks as C
# The row arithmetic and the structured input kinds are the same as qk_norm's, over a longer row.
from cookbook.ops.qk_norm import INPUT_SCALES, INPUT_KINDS, rms_norm_rows  # noqa: F401 (INPUT_KINDS: re-exported)
from cookbook.ops.qk_norm import TOLERANCES as _QK_TOLERANCES
from cookbook.testing import Tolerance

OP = "cross_head_norm"
MAX_HIDDEN = 65536


# --------------------------------------------------------------------------------------------
# Checks: the one function every backend runs first.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CrossHeadNormArgs:
    """Checked arguments, with q and k viewed as `[T, hidden]` rows (no copies)."""

    q: torch.Tensor
    k: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    weight_offset: float
    rounding: str


@dataclass(frozen=True)
class _Layout:
    """How one activation maps to rows: the last `row_dims` dims (1, or 2 for packed heads)."""

    row_dims: int
    hidden: int
    expected: str  # the layout in words, for error messages


def _layouts(x: torch.Tensor, w, hidden_name: str) -> list[_Layout]:
    """The layouts the weight's length allows: the last dim, and/or the last two (packed heads)."""
    width = w.shape[0] if w.dim() == 1 else None
    found = [_Layout(1, x.shape[-1], f"[tokens..., {hidden_name}={x.shape[-1]}]")]
    if x.dim() >= 3:
        heads, head_dim = x.shape[-2], x.shape[-1]
        found.append(_Layout(2, heads * head_dim, f"[tokens..., heads={heads}, head_dim={head_dim}] ({hidden_name}={heads * head_dim})"))
    return [layout for layout in found if layout.hidden == width] or found[:1]


def _token_dims(x: torch.Tensor, layout: _Layout) -> tuple:
    return tuple(x.shape[: x.dim() - layout.row_dims])


def _pick_layouts(q, k, q_weight, k_weight) -> tuple[_Layout, _Layout]:
    """The weights' lengths name the rows; where both readings fit (a single head, e.g. a decode
    step's [batch, 1, hidden]), the one whose token dims agree with the other tensor wins, the
    plain [tokens..., hidden] reading first."""
    q_options, k_options = _layouts(q, q_weight, "q_hidden"), _layouts(k, k_weight, "k_hidden")
    for q_layout in q_options:
        for k_layout in k_options:
            if _token_dims(q, q_layout) == _token_dims(k, k_layout):
                return q_layout, k_layout
    return q_options[0], k_options[0]  # the token check below reports the mismatch


def _require_packed_heads(name: str, x: torch.Tensor, layout: _Layout) -> None:
    """A `[tokens..., heads, head_dim]` row is one run of memory only if heads follow each other."""
    if layout.row_dims == 2 and x.shape[-2] > 1 and x.stride(-2) != x.shape[-1]:
        raise ValueError(
            f"{name}: expected {layout.expected} with packed heads (head stride = head_dim = {x.shape[-1]}), "
            f"got {C.describe(x)}"
        )


def check_inputs(q, k, q_weight, k_weight, eps, weight_offset, rounding) -> CrossHeadNormArgs:
    C.require_q_k(q, k, "[tokens..., q_hidden]", "[tokens..., k_hidden]")
    C.require_tensor("q_weight", q_weight)
    C.require_tensor("k_weight", k_weight)
    q_layout, k_layout = _pick_layouts(q, k, q_weight, k_weight)
    q_tokens = _token_dims(q, q_layout)
    if q_tokens != _token_dims(k, k_layout):
        raise ValueError(f"k: expected the token dims of q {q_tokens} followed by k_hidden, got {C.describe(k)}")
    for name, x, layout in (("q", q, q_layout), ("k", k, k_layout)):
        if layout.hidden % 2 or not 2 <= layout.hidden <= MAX_HIDDEN:
            raise ValueError(
                f"{name}: unsupported {name}_hidden={layout.hidden}: expected an even hidden size in "
                f"[2, {MAX_HIDDEN}], got {C.describe(x)}"
            )
        C.require_contiguous_last_dim(name, x, layout.expected)
        _require_packed_heads(name, x, layout)
    C.require_weight("q_weight", q_weight, q_layout.hidden, q, "q_hidden")
    C.require_weight("k_weight", k_weight, k_layout.hidden, k, "k_hidden")
    eps = C.require_eps(eps)
    weight_offset = C.require_weight_offset(weight_offset)
    C.require_choice("rounding", rounding, C.ROUNDING_MODES)
    q2 = _as_rows("q", q, q_layout)
    k2 = _as_rows("k", k, k_layout)
    check_in_place(q, k, q_weight, k_weight)
    return CrossHeadNormArgs(q2, k2, q_weight, k_weight, eps, weight_offset, rounding)


def check_in_place(q, k, q_weight, k_weight) -> None:
    """q and k writable here, each element at its own address, sharing no byte with each other
    or with the weights (`_checks.require_in_place`). Under torch.compile, run by the compiled op."""
    C.require_in_place(dict(q=q, k=k), dict(q_weight=q_weight, k_weight=k_weight))


def _as_rows(name: str, x: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """`[T, hidden]` view: token dims collapsed, packed heads merged (both without a copy)."""
    rows = C.as_token_rows(name, x, layout.row_dims, layout.expected)
    return rows.view(rows.shape[0], layout.hidden)


# --------------------------------------------------------------------------------------------
# The reference: the math in readable PyTorch. The oracle for every test.
# `rms_norm_rows` (from qk_norm) normalizes over the last dim: here that dim is the whole hidden.
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def reference(q, k, q_weight, k_weight, eps, weight_offset, rounding):
    """In-place PyTorch reference on checked `[T, hidden]` views (any device): q, then k (so
    torch.compile writes each in place, as in qk_norm's); nothing is recorded for autograd."""
    q.copy_(rms_norm_rows(q, q_weight, eps, weight_offset, rounding))
    k.copy_(rms_norm_rows(k, k_weight, eps, weight_offset, rounding))
    return q, k


def expected(inputs, eps, weight_offset, rounding):
    """{output: (float64 exact value, Hugging Face-order reference or None)} for unmodified inputs.

    `inputs` may hold `[..., hidden]` or packed-heads `[..., heads, head_dim]` tensors: each is
    compared in its own shape, normalized over the rows `check_inputs` names."""
    args = check_inputs(**inputs, eps=eps, weight_offset=weight_offset, rounding=rounding)
    out = {}
    for name, rows, w in (("q", args.q, args.q_weight), ("k", args.k, args.k_weight)):
        shape = inputs[name].shape
        exact = rms_norm_rows(rows.double(), w.double(), eps, weight_offset, "fused").view(shape)
        rounded = rms_norm_rows(rows, w, eps, weight_offset, "hf").view(shape) if rounding == "hf" else None
        out[name] = (exact, rounded)
    return out


# --------------------------------------------------------------------------------------------
# Inputs, tolerances, bytes: what tests, benchmarks and notebooks share.
# --------------------------------------------------------------------------------------------
def make_inputs(
    num_tokens=8,
    q_hidden=1024,
    k_hidden=256,
    dtype=torch.bfloat16,
    device="cpu",
    *,
    seed=0,
    weight_dtype=None,
    fused_qkv=False,
    kind="normal",
    head_dim=None,
):
    """Seeded inputs. `fused_qkv=True` returns q and k as strided views into one
    `[T, q_hidden + 2 * k_hidden]` tensor, as an engine's QKV projection leaves them. `head_dim`
    returns q and k as `[T, heads, head_dim]` views with packed heads (the weights stay
    `[hidden]`). `kind` is one of INPUT_KINDS (see qk_norm). Returns a dict of the op's arguments."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weight_dtype = weight_dtype or dtype

    def rows(shape):
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if kind == "constant":
            x = torch.full_like(x, 0.5) * torch.sign(torch.randn(shape[:-1] + (1,), generator=gen))
        elif kind == "zero_rows":
            x = x * (torch.rand(shape[:-1] + (1,), generator=gen) < 0.5)
        elif kind in INPUT_SCALES:
            x = x * INPUT_SCALES[kind][dtype]
        return x

    if fused_qkv:
        qkv = rows((num_tokens, 3, max(q_hidden, k_hidden)))  # q, k and v rows drawn independently
        qkv = torch.cat([qkv[:, 0, :q_hidden], qkv[:, 1, :k_hidden], qkv[:, 2, :k_hidden]], dim=1)
        qkv = qkv.to(dtype=dtype, device=device)
        q, k = qkv[:, :q_hidden], qkv[:, q_hidden : q_hidden + k_hidden]
    else:
        q = rows((num_tokens, q_hidden)).to(dtype=dtype, device=device)
        k = rows((num_tokens, k_hidden)).to(dtype=dtype, device=device)
    if head_dim is not None:
        q, k = q.unflatten(-1, (q_hidden // head_dim, head_dim)), k.unflatten(-1, (k_hidden // head_dim, head_dim))
    q_weight = (1.0 + 0.25 * torch.randn(q_hidden, generator=gen)).to(dtype=weight_dtype, device=device)
    k_weight = (1.0 + 0.25 * torch.randn(k_hidden, generator=gen)).to(dtype=weight_dtype, device=device)
    return dict(q=q, k=k, q_weight=q_weight, k_weight=k_weight)


TOLERANCES = {
    **_QK_TOLERANCES,
    # float32 output: the float32 arithmetic itself is the error, and rows here are up to 64x
    # longer than a head (a sum of up to 65536 squares); rounding modes coincide.
    torch.float32: Tolerance(fused_ulp=128.0, hf_ulp=128.0, hf_exact_share=0.0),
}


def bytes_moved(q, k, q_weight, k_weight) -> int:
    """Fewest bytes a launch must move: q and k read and written once, the weights read once."""
    act = (q.numel() + k.numel()) * q.element_size() * 2
    return act + q_weight.numel() * q_weight.element_size() + k_weight.numel() * k_weight.element_size()


def flops(q, k) -> int:
    """About 4 flops per element (square-accumulate, scale, weight); memory-bound by far."""
    return 4 * (q.numel() + k.numel())


# Shapes the benchmark sweeps: (tokens, q_hidden, k_hidden). 8192/8192: a 64-head model without
# GQA (the target rows); 4096/4096: OLMo2-7B; 6144/1024: MiniMax-M2 at TP=1; 5120/1024: Wan-like;
# 768/128: MiniMax-M2's shard at TP=8 (the rows tp_qk_norm normalizes per rank); 2048/256: a
# 2048-wide model with 8:1 GQA (narrow rows, many tokens: v8's case). q and k are views of one fused
# qkv tensor (an engine's layout), except in entries whose fourth element is SEPARATE: two
# contiguous tensors, as the targets write the 2048 x 8192 row (q and k each [tokens, hidden]).
SEPARATE = "separate"
BENCH_SHAPES = [
    (1, 8192, 8192),
    (16, 8192, 8192),
    (256, 8192, 8192),
    (1024, 4096, 4096),
    (1536, 8192, 8192),
    (2048, 8192, 8192),
    (8192, 8192, 8192),
    (2048, 8192, 8192, SEPARATE),
    (4096, 6144, 1024),
    (1024, 5120, 1024),
    (512, 32768, 4096),
    (16384, 768, 128),
    (8192, 2048, 256),
]
SIM_SHAPES = [(2, 64, 32), (3, 96, 64)]


def bench_case(shape, dtype, device, seed=0):
    """(kwargs, label) for one benchmark shape: q and k as views of one fused qkv tensor, or as two
    contiguous tensors where the shape's fourth element is SEPARATE."""
    t, q_hidden, k_hidden, *layout = shape
    separate = layout == [SEPARATE]
    if layout and not separate:
        raise ValueError(f"shape: expected (tokens, q_hidden, k_hidden[, {SEPARATE!r}]), got {shape!r}")
    inputs = make_inputs(t, q_hidden, k_hidden, dtype, device, seed=seed, fused_qkv=not separate)
    return inputs, f"T={t} q_hidden={q_hidden} k_hidden={k_hidden}" + (f" {SEPARATE}" if separate else "")
