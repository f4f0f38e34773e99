"""Agreement checks shared by tests, the benchmark and the notebooks.

An implementation agrees with an op's contract when, element by element:

* rounding="fused": it is within `tol.fused_ulp` ulps (of the output dtype) of the float64 value;
* rounding="hf": it is within `tol.hf_ulp` ulps of the Hugging Face-order reference and
  bit-identical to it in at least `tol.hf_exact_share` of the elements.

Mismatches are reported verbosely: how many, the first few indices with both values, the worst.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_SHOW = 5


@dataclass(frozen=True)
class Tolerance:
    """How close an implementation must be, per dtype.

    fused: every element within `fused_ulp` ulps of the float64 value (a correctly rounded result
           is within 0.5; float32 arithmetic adds a little).
    hf:    every element within `hf_ulp` ulps of the Hugging Face-order reference, and at least
           `hf_exact_share` of the elements bit-identical to it (double rounding differs from a
           single rounding in a large share of elements, so a fused kernel fails this).
    """

    fused_ulp: float
    hf_ulp: float
    hf_exact_share: float
    # Errors are counted in ulps of max(|value|, rms_floor * rms of the expected tensor). 0: of
    # |value| alone. A rotation (qk_norm_rope) needs a floor: an output near 0 carries the
    # absolute error of its O(rms) inputs.
    rms_floor: float = 0.0


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Size of one unit in the last place of `dtype` at each value of float64 `x`."""
    info = torch.finfo(dtype)
    mantissa = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7, torch.float8_e4m3fn: 3}[dtype]
    min_exp = int(math.log2(info.tiny))
    # frexp: |x| = m * 2^e with m in [0.5, 1), so floor(log2 |x|) = e - 1 exactly, on any device
    # (a log2 may round a value just below a power of two up to it).
    # An infinite value keeps an infinite ulp (a float16 result that overflows to inf, as the exact
    # value rounds, is not charged).
    _, e = torch.frexp(x.abs().clamp_min(info.tiny))
    size = torch.exp2((e - 1).clamp_min(min_exp).to(x.dtype) - mantissa)
    return torch.where(x.isinf(), torch.full_like(size, math.inf), size)


@dataclass(frozen=True)
class Agreement:
    ok: bool
    message: str
    max_ulp: float


def agreement(name, actual, exact, rounded, rounding, tol: Tolerance) -> Agreement:
    """Compare `actual` with the float64 `exact` value (fused) or the `rounded` HF-order reference,
    in float64 on `actual`'s device (a GPU compares large tensors in a fraction of the CPU's time)."""
    dtype = actual.dtype
    a = actual.detach().to(torch.float64)
    if rounding == "fused":
        want, limit = exact.detach().to(a.device, torch.float64), tol.fused_ulp
    else:
        want, limit = rounded.detach().to(a.device, torch.float64), tol.hf_ulp
    if a.shape != want.shape:
        return Agreement(False, f"{name}: shape {tuple(a.shape)} != expected {tuple(want.shape)}", float("inf"))
    # ulps of the larger of the two values: a result that rounds across a power of two (0.9995
    # vs 1.001 in float16) is not charged in the finer ulps of the smaller binade.
    scale = torch.maximum(want.abs(), a.abs())
    if tol.rms_floor and want.numel():
        scale = scale.clamp_min(tol.rms_floor * want.nan_to_num(0.0).square().mean().sqrt().item())
    err = (a - want).abs() / ulp(scale, dtype)
    err = torch.where(torch.isnan(a) | torch.isnan(want), torch.full_like(err, float("inf")), err)
    bad = err > limit
    problems = []
    if bad.any():
        idx = bad.nonzero()[:_SHOW].tolist()
        shown = ", ".join(
            f"{tuple(i)}: got {a[tuple(i)].item():.8g} want {want[tuple(i)].item():.8g} ({err[tuple(i)].item():.3g} ulp)"
            for i in idx
        )
        problems.append(f"{int(bad.sum())} of {bad.numel()} elements over {limit} ulp (first: {shown})")
    if rounding == "hf" and a.numel():
        share = (a == want).double().mean().item()
        if share < tol.hf_exact_share:
            problems.append(
                f"only {share:.2%} of elements bit-identical to the HF-order reference (need {tol.hf_exact_share:.0%})"
            )
    max_ulp = err.max().item() if err.numel() else 0.0
    if problems:
        return Agreement(False, f"{name} [{dtype}, rounding={rounding}]: " + "; ".join(problems) + f"; max {max_ulp:.3g} ulp", max_ulp)
    return Agreement(True, f"{name}: ok (max {max_ulp:.3g} ulp)", max_ulp)
