"""`qk_norm`: per-head RMSNorm of q and k, in place, q and k in one launch.

Contract
--------
``qk_norm(q, k, q_weight, k_weight, eps=1e-6, *, weight_offset=0.0, rounding="fused", backend="auto")``

* ``q``: ``[tokens..., num_q_heads, head_dim]``, ``k``: ``[tokens..., num_kv_heads, head_dim]``,
  same token dims, any GQA ratio (``num_kv_heads = 1`` included). The last dim is contiguous; the
  token and head strides are free, so q and k may be views into one fused qkv tensor
  ``[T, (Hq + 2*Hk) * D]``. Strides are 64-bit in every kernel.
* dtypes float32, float16, bfloat16 (q and k alike); weights ``[head_dim]`` in that dtype or float32.
* head_dim: any even size from 2 to 1024 (fast CUDA paths for 64, 128, 256, 512, 1024).
* math, per (token, head) row ``x`` of length D, accumulated in float32::

      rstd = rsqrt(mean(x^2) + eps)          (0 where mean(x^2) + eps == 0: eps=0 zero rows stay 0;
                                              NaN where it is NaN or +Inf)
      y    = x * rstd * (w + weight_offset)   (weight_offset=1.0 is Gemma's (1 + w), in float32)

* ``rounding="fused"``: one rounding to the activation dtype at the end (FlashInfer, SGLang,
  TensorRT-LLM). ``rounding="hf"``: Hugging Face order: ``n = round(x * rstd)``, then
  ``y = round(n * round(w + weight_offset))``. The two differ by about one ulp in a large share of
  bf16 elements; the tolerances below tell them apart.
* Returns ``(q, k)``, the same tensors, normalized in place. Nothing is written unless every check
  passes.

Edges (the same on every backend; docs/edge_cases.md):

* In place, safely (`check_in_place`): q and k share no byte with each other or with the
  weights, and no two of their elements share an address (``k is q``, overlapping views, a weight
  inside q, a broadcast token dim: ValueError). Views of one qkv tensor, side by side or
  interleaved per head, share a buffer but no byte: accepted. q and k must not require grad (no
  backward; weights may: they are only read) and are written outside ``torch.inference_mode()``
  only if they are not inference tensors.
* NaN and Inf: a NaN, +Inf or -Inf anywhere in a row makes the whole row NaN (rstd is NaN).
* float32's range: sum(x^2) is a float32; a row whose sum of squares passes 3.4e38 (every
  ``|x| > 1.6e18`` at D = 128; float32 and bfloat16 rows only) comes out all NaN. With eps = 0,
  squares of ``|x| <= 2**-75`` (2.6e-23) are 0, so a row of only such values comes out as zeros.
* eps and weight_offset are used as float32: `check_arguments` rounds them (1e-50 becomes 0) and
  refuses values with no finite float32 (``eps=1e300``).
* num_q_heads or num_kv_heads may be 0: the other tensor is normalized.

Bytes moved: q and k are read once and written once; the weights once per launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cookbook import _checks as C
from cookbook.testing import Tolerance

OP = "qk_norm"
MAX_HEAD_DIM = 1024


# --------------------------------------------------------------------------------------------
# Checks: the one function every backend runs first.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QKNormArgs:
    """Checked arguments, with q and k viewed as `[T, H, D]` (no copies)."""

    q: torch.Tensor
    k: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    weight_offset: float
    rounding: str


def check_inputs(q, k, q_weight, k_weight, eps, weight_offset, rounding) -> QKNormArgs:
    """Every check, `check_arguments` then `check_in_place`; the checked arguments."""
    args = check_arguments(q, k, q_weight, k_weight, eps, weight_offset, rounding)
    check_in_place(q, k, q_weight, k_weight)
    return args


def check_in_place(q, k, q_weight, k_weight) -> None:
    """q and k writable here, each element at its own address, sharing no byte with each other
    or with the weights (`_checks.require_in_place`). Under torch.compile, run by the compiled op."""
    C.require_in_place(dict(q=q, k=k), dict(q_weight=q_weight, k_weight=k_weight))


def check_arguments(q, k, q_weight, k_weight, eps, weight_offset, rounding) -> QKNormArgs:
    """Shapes, strides, dtypes, devices and values (eps and weight_offset rounded to float32 as
    the kernels take them); not the memory checks."""
    expect_q = "[tokens..., num_q_heads, head_dim]"
    expect_k = "[tokens..., num_kv_heads, head_dim]"
    C.require_q_k(q, k, expect_q, expect_k)
    C.require_heads_split("q", q, "num_q_heads", "q_weight", q_weight)
    C.require_heads_split("k", k, "num_kv_heads", "k_weight", k_weight)
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"k: expected [tokens..., num_kv_heads, head_dim={head_dim}] (the head_dim of q), got {C.describe(k)}")
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(
            f"k: expected the token dims of q {tuple(q.shape[:-2])} followed by [num_kv_heads, head_dim], got {C.describe(k)}"
        )
    if head_dim % 2 or not 2 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"q: unsupported head_dim={head_dim}: expected an even head_dim in [2, {MAX_HEAD_DIM}], got {C.describe(q)}"
        )
    C.require_contiguous_last_dim("q", q, f"[tokens..., num_q_heads, head_dim={head_dim}]")
    C.require_contiguous_last_dim("k", k, f"[tokens..., num_kv_heads, head_dim={head_dim}]")
    C.require_weight("q_weight", q_weight, head_dim, q, "head_dim")
    C.require_weight("k_weight", k_weight, head_dim, k, "head_dim")
    eps = C.require_eps(eps)
    weight_offset = C.require_weight_offset(weight_offset)
    C.require_choice("rounding", rounding, C.ROUNDING_MODES)
    q3 = C.as_token_rows("q", q, 2, expect_q)
    k3 = C.as_token_rows("k", k, 2, expect_k)
    return QKNormArgs(q3, k3, q_weight, k_weight, eps, weight_offset, rounding)


# --------------------------------------------------------------------------------------------
# The reference: the math in readable PyTorch. The oracle for every test.
# --------------------------------------------------------------------------------------------
def rms_norm_rows(x, w, eps, weight_offset, rounding, out_dtype=None):
    """RMSNorm over the last dim of `x`, out of place. float64 inputs stay float64 (oracle use)."""
    out_dtype = out_dtype or x.dtype
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    rstd = rstd_of(xf.square().mean(dim=-1, keepdim=True), eps)
    return scale_rows(xf, rstd, w, weight_offset, rounding, out_dtype)


def rstd_of(mean_sq, eps):
    """rsqrt(mean(x^2) + eps); 0 where that is 0 (eps=0 zero rows stay 0, not NaN); NaN where it
    is NaN or +Inf (a NaN or Inf in the row, or a sum of squares past the accumulator's range), so
    the whole row comes out NaN rather than silently zero. The CUDA C kernels' formula
    (`rstd_from`): rsqrt(+Inf) is 0, and `denom - denom`, 0 for every finite denom, makes it NaN."""
    denom = mean_sq + eps
    return torch.where(denom == 0, torch.zeros_like(denom), torch.rsqrt(denom) + (denom - denom))


def scale_rows(xf, rstd, w, weight_offset, rounding, out_dtype):
    """y = x * rstd * (w + weight_offset) from float32/float64 `xf` and a per-row `rstd`, rounded
    to `out_dtype` once (fused) or in the Hugging Face order (hf)."""
    acc = xf.dtype
    w_eff = w.to(acc) + weight_offset
    if rounding == "fused":
        return (xf * rstd * w_eff).to(out_dtype)
    # Hugging Face order: the normalized value and the weight are rounded to the activation
    # dtype first, then multiplied (a float32 product, rounded once more).
    normed = (xf * rstd).to(out_dtype).to(acc)
    return (normed * w_eff.to(out_dtype).to(acc)).to(out_dtype)


@torch.no_grad()
def reference(q, k, q_weight, k_weight, eps, weight_offset, rounding):
    """In-place PyTorch reference on checked `[T, H, D]` views (any device): q, then k. Nothing is
    recorded for autograd (weights may be parameters). Written in this order, q's result goes
    straight into q under torch.compile even where q and k are views of one tensor."""
    q.copy_(rms_norm_rows(q, q_weight, eps, weight_offset, rounding))
    k.copy_(rms_norm_rows(k, k_weight, eps, weight_offset, rounding))
    return q, k


def expected(inputs, eps, weight_offset, rounding):
    """{output: (float64 exact value, Hugging Face-order reference or None)} for unmodified inputs.

    The exact value is what rounding="fused" must round once; the HF-order reference is what
    rounding="hf" must reproduce (see cookbook.testing.agreement)."""
    out = {}
    for name, w in (("q", inputs["q_weight"]), ("k", inputs["k_weight"])):
        x = inputs[name]
        exact = rms_norm_rows(x.double(), w.double(), eps, weight_offset, "fused")
        rounded = rms_norm_rows(x, w, eps, weight_offset, "hf") if rounding == "hf" else None
        out[name] = (exact, rounded)
    return out


# --------------------------------------------------------------------------------------------
# Inputs, tolerances, bytes: what tests, benchmarks and notebooks share.
# --------------------------------------------------------------------------------------------
INPUT_KINDS = ("normal", "constant", "zero_rows", "tiny", "huge")

# "huge" and "tiny" row scales per dtype: squares overflow / underflow a float16 accumulator but
# stay well inside float32's range, so a float32-accumulating kernel must get them right.
INPUT_SCALES = {
    "tiny": {torch.float16: 1e-4, torch.bfloat16: 1e-15, torch.float32: 1e-15},
    "huge": {torch.float16: 2e3, torch.bfloat16: 1e15, torch.float32: 1e15},
}


def make_inputs(
    num_tokens=8,
    num_q_heads=4,
    num_kv_heads=1,
    head_dim=128,
    dtype=torch.bfloat16,
    device="cpu",
    *,
    seed=0,
    weight_dtype=None,
    fused_qkv=False,
    kind="normal",
):
    """Seeded inputs. `fused_qkv=True` returns q and k as strided views into one `[T, (Hq+2Hk)*D]`
    tensor, as an engine's QKV projection leaves them. Returns a dict of the op's arguments."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weight_dtype = weight_dtype or dtype
    width = (num_q_heads + 2 * num_kv_heads) * head_dim if fused_qkv else None

    def rows(shape):
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if kind == "constant":
            x = torch.full_like(x, 0.5) * torch.sign(torch.randn(shape[:-1] + (1,), generator=gen))
        elif kind == "zero_rows":
            keep = torch.rand(shape[:-1] + (1,), generator=gen) < 0.5
            x = x * keep
        elif kind in INPUT_SCALES:
            x = x * INPUT_SCALES[kind][dtype]
        return x

    if fused_qkv:
        qkv = rows((num_tokens, width // head_dim, head_dim)).reshape(num_tokens, width)
        qkv = qkv.to(dtype=dtype, device=device)
        q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
        k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(
            num_tokens, num_kv_heads, head_dim
        )
    else:
        q = rows((num_tokens, num_q_heads, head_dim)).to(dtype=dtype, device=device)
        k = rows((num_tokens, num_kv_heads, head_dim)).to(dtype=dtype, device=device)
    q_weight = (1.0 + 0.25 * torch.randn(head_dim, generator=gen)).to(dtype=weight_dtype, device=device)
    k_weight = (1.0 + 0.25 * torch.randn(head_dim, generator=gen)).to(dtype=weight_dtype, device=device)
    return dict(q=q, k=k, q_weight=q_weight, k_weight=k_weight)


TOLERANCES = {
    # hf: a kernel's float32 rstd may differ from the reference's by an ulp (another summation
    # order); near a tie that moves the rounded x * rstd by one ulp, and the weight product and
    # second rounding can carry it to two. The 99 % bit-identical rule still separates the orders.
    torch.bfloat16: Tolerance(fused_ulp=0.52, hf_ulp=2.01, hf_exact_share=0.99),
    torch.float16: Tolerance(fused_ulp=0.52, hf_ulp=2.01, hf_exact_share=0.99),
    # float32 output: the float32 arithmetic itself (sum of up to 1024 squares, rsqrtf) is the
    # error; rounding modes coincide.
    torch.float32: Tolerance(fused_ulp=64.0, hf_ulp=64.0, hf_exact_share=0.0),
}


def bytes_moved(q, k, q_weight, k_weight) -> int:
    """Fewest bytes a launch must move: q and k read and written once, the weights read once."""
    act = (q.numel() + k.numel()) * q.element_size() * 2
    return act + q_weight.numel() * q_weight.element_size() + k_weight.numel() * k_weight.element_size()


def flops(q, k) -> int:
    """About 4 flops per element (square-accumulate, scale, weight); memory-bound by far."""
    return 4 * (q.numel() + k.numel())


# Shapes the benchmark sweeps: (tokens, q heads, kv heads, head_dim).
BENCH_SHAPES = [
    (1, 64, 8, 128),  # decode of one sequence: launch-bound
    (256, 64, 8, 128),
    (1024, 64, 8, 128),
    (8192, 64, 8, 128),  # prefill: bandwidth-bound, the headline shape
    (8192, 8, 1, 128),  # GQA down to one kv head
    (8192, 32, 8, 64),  # smaller heads: four heads per warp in v3
    (2048, 16, 4, 256),
    (1024, 8, 1, 96),  # head_dim 96: v2's general path up to v9, padded lane groups in v10
]
SIM_SHAPES = [(2, 2, 1, 64), (3, 4, 2, 32)]


def bench_case(shape, dtype, device, seed=0):
    """(kwargs, label) for one benchmark shape; q and k as views of one fused qkv tensor."""
    t, hq, hk, d = shape
    inputs = make_inputs(t, hq, hk, d, dtype, device, seed=seed, fused_qkv=True)
    return inputs, f"T={t} Hq={hq} Hk={hk} D={d}"
