"""Which rounding order a peer's output follows, and how far from it: the verdict of each peer.

Our kernels are checked against the order the benchmark asks for. A peer does what its package
does, so its output is checked against every order a correct kernel of the op can follow, in turn,
with the contract's tolerances, and the first it meets names it:

* ``fused``: one rounding to the activation dtype at the end (the contract's "fused");
* ``hf``: the Hugging Face order, each step rounded (the contract's "hf");
* for `qk_norm_rope` also the two orders of a norm kernel followed by a rope kernel, the
  normalized rows rounded to the activation dtype in between and rotated in float32 from there:
  ``fused norm, then rope`` and ``hf norm, then rope`` (the norm rounded as in ``fused`` or ``hf``).
  Their reference is the exact rotation of those rounded rows (float64), met within the fused
  tolerance.

A peer that meets none is reported with the order it came closest to and its max ulp there, and
is not timed (a fast wrong kernel has no speed). The functions here are pure PyTorch: they run on
the CPU, which is where the tests exercise them with fake peers.
"""

from __future__ import annotations

import dataclasses

import torch

from cookbook.testing import agreement

FUSED = "fused"
HF = "hf"
FUSED_NORM_THEN_ROPE = "fused norm, then rope"
HF_NORM_THEN_ROPE = "hf norm, then rope"

FOLLOWS = "follows"
DISAGREES = "disagrees"
NOT_APPLICABLE = "not applicable"
ERROR = "error"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the check of one peer at one shape found."""

    status: str  # FOLLOWS, DISAGREES, NOT_APPLICABLE or ERROR
    order: str | None = None  # the order it follows (FOLLOWS) or came closest to (DISAGREES)
    max_ulp: float | None = None  # against that order
    detail: str = ""  # the reason (NOT_APPLICABLE), the error, or the per-order distances

    @property
    def timed(self) -> bool:
        return self.status == FOLLOWS

    def text(self) -> str:
        """One table cell: "fused order, max 0.5 ulp", "not applicable: <why>", ..."""
        if self.status == FOLLOWS:
            return f"{self.order} order, max {self.max_ulp:.2g} ulp"
        if self.status == DISAGREES:
            return f"disagrees (closest: {self.order}, max {self.max_ulp:.3g} ulp), not timed"
        return f"{self.status}: {self.detail}"


def not_applicable(reason: str) -> Verdict:
    return Verdict(NOT_APPLICABLE, detail=reason)


def failed(error_text: str) -> Verdict:
    return Verdict(ERROR, detail=error_text)


@dataclasses.dataclass(frozen=True)
class Oracle:
    """The reference of one order for one output: compared as `rounding` ("fused" against the
    exact value, "hf" against the rounded reference) with the contract's tolerance."""

    exact: torch.Tensor
    rounded: torch.Tensor | None
    rounding: str


def _cpu(t):
    return None if t is None else t.detach().cpu()


def oracles(contract, inputs: dict, eps: float, weight_offset: float) -> dict[str, dict[str, Oracle]]:
    """{order: {output name: Oracle}} for unmodified `inputs`, in the order they are tried."""
    pairs = contract.expected(inputs, eps, weight_offset, "hf")  # {name: (float64 exact, hf-order)}
    found = {
        FUSED: {name: Oracle(_cpu(exact), None, "fused") for name, (exact, _) in pairs.items()},
        HF: {name: Oracle(_cpu(exact), _cpu(rounded), "hf") for name, (exact, rounded) in pairs.items()},
    }
    if hasattr(contract, "rotate"):  # qk_norm_rope: a norm kernel, then a rope kernel
        found[FUSED_NORM_THEN_ROPE] = _norm_then_rope(contract, inputs, eps, weight_offset, "fused")
        found[HF_NORM_THEN_ROPE] = _norm_then_rope(contract, inputs, eps, weight_offset, "hf")
    return found


def _norm_then_rope(contract, inputs, eps, weight_offset, norm_rounding) -> dict[str, Oracle]:
    """The exact rotation of the rows normalized and rounded to the activation dtype first."""
    from cookbook.ops.qk_norm import rms_norm_rows

    args = contract.check_inputs(**inputs, eps=eps, weight_offset=weight_offset, rounding="fused")
    cos, sin = contract.cos_sin_rows(args.cos_sin_cache, args.positions, args.position_offset, torch.float64)
    found = {}
    for name, x, w in (("q", args.q, args.q_weight), ("k", args.k, args.k_weight)):
        normed = rms_norm_rows(x, w, eps, weight_offset, norm_rounding)  # rounded to x.dtype
        exact = contract.rotate(normed.double(), cos, sin, args.rope_dim, args.is_neox)
        found[name] = Oracle(_cpu(exact.view(inputs[name].shape)), None, "fused")
    return found


def judge(contract, outputs: dict, found_oracles: dict) -> Verdict:
    """The first order in `found_oracles` that every output meets; else DISAGREES, naming the
    order it came closest to (the smallest max ulp)."""
    closest = None
    distances = []
    for order, by_name in found_oracles.items():
        results = []
        for name, oracle in by_name.items():
            actual = outputs[name]
            tol = contract.TOLERANCES[actual.dtype]
            results.append(agreement(f"{name}", actual, oracle.exact, oracle.rounded, oracle.rounding, tol))
        max_ulp = max(r.max_ulp for r in results)
        if all(r.ok for r in results):
            return Verdict(FOLLOWS, order, max_ulp)
        distances.append(f"{order}: max {max_ulp:.3g} ulp")
        if closest is None or max_ulp < closest[1]:
            closest = (order, max_ulp)
    return Verdict(DISAGREES, closest[0], closest[1], "; ".join(distances))
