"""Drop-in use of the cookbook's fused ops inside real models.

* `cookbook.integrations.transformers`: Hugging Face transformers models (Qwen3, Gemma3, OLMo2):
  ``patch(model)`` / ``unpatch(model)``.
* `cookbook.integrations.diffusers`: the FLUX transformer of diffusers: ``patch(pipe_or_transformer)``
  / ``unpatch(...)``.
* `cookbook.integrations.bench`: parity and per-layer timing at real model sizes (GPU).

Importing this package imports neither library; each submodule imports its own on first use.
What the submodules share lives here: the report a patch returns, the error for a layout this
code does not know, the element-wise comparison the patch-time checks use, and the backend's
preparation (its kernels built together, before the first forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A patch-time check compares our replacement with the model's own code on a small random input.
# The op contracts' rule for a Hugging Face-order match: at least 99 % of the elements
# bit-identical and the rest within a few ulps (4 for a norm followed by a rotation).
EXACT_SHARE = 0.99
MAX_ULP = 4.0


class LayoutError(RuntimeError):
    """A module's code is not the layout this integration was written and tested against."""


@dataclass(frozen=True)
class PatchedModule:
    """One module whose q/k norms now run as one fused op."""

    name: str  # its path in the model, e.g. "model.layers.0.self_attn"
    cls: str  # its class name
    op: str  # the cookbook op that replaces its norms ("qk_norm_rope", "qk_norm", "cross_head_norm")
    rounding: str
    weight_offset: float
    fused_rope: bool  # True: the op applies the rotary embedding too


@dataclass(frozen=True)
class SkippedModule:
    """An attention module left alone, and why."""

    name: str
    cls: str
    reason: str


@dataclass(frozen=True)
class PatchReport:
    """What `patch` did: the modules it patched and the attention modules it left alone."""

    library: str
    backend: str
    patched: tuple[PatchedModule, ...]
    skipped: tuple[SkippedModule, ...]

    def __str__(self) -> str:
        lines = [f"{self.library}: patched {len(self.patched)} module(s), backend={self.backend!r}"]
        for (cls, op, rounding, offset, rope), count in _grouped(
            (m.cls, m.op, m.rounding, m.weight_offset, m.fused_rope) for m in self.patched
        ).items():
            then = " (norm and rope in one pass)" if rope else ", then the model's own rope"
            lines.append(f"  {count} x {cls} -> cookbook.{op}(rounding={rounding!r}, weight_offset={offset}){then}")
        for (cls, reason), count in _grouped((m.cls, m.reason) for m in self.skipped).items():
            lines.append(f"  left alone: {count} x {cls}: {reason}")
        return "\n".join(lines)


def _grouped(keys) -> dict:
    counts: dict = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    return counts


@dataclass(frozen=True)
class Comparison:
    """How close two tensors of one low-precision dtype are, element by element."""

    exact_share: float  # share of bit-identical elements
    max_ulp: float  # largest difference, in ulps of max(|expected|, rms of expected)

    @property
    def ok(self) -> bool:
        return self.exact_share >= EXACT_SHARE and self.max_ulp <= MAX_ULP

    def __str__(self) -> str:
        return f"{self.exact_share:.2%} bit-identical, max {self.max_ulp:.3g} ulp"


def compare(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None = None) -> Comparison:
    """Bit-identical share and the largest difference in ulps of the dtype.

    The ulp is taken at `scale` (per element), by default max(|expected|, rms of expected): an
    element near zero after a rotation carries the absolute error of its O(rms) inputs, so it is
    not judged in its own tiny ulp."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise ValueError(f"compare: shapes/dtypes differ: {tuple(actual.shape)} {actual.dtype} vs "
                         f"{tuple(expected.shape)} {expected.dtype}")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if e.numel() == 0:
        return Comparison(1.0, 0.0)
    if scale is None:
        scale = torch.maximum(e.abs(), e.square().mean().sqrt())
    scale = scale.detach().to("cpu", torch.float64)
    tiny = torch.finfo(actual.dtype).tiny
    ulp = torch.finfo(actual.dtype).eps * torch.exp2(torch.floor(torch.log2(scale.clamp_min(tiny))))
    err = ((a - e).abs() / ulp).nan_to_num(nan=float("inf"))
    both_nan = torch.isnan(a) & torch.isnan(e)
    err = torch.where(both_nan, torch.zeros_like(err), err)
    same = (a == e) | both_nan
    return Comparison(same.double().mean().item(), err.max().item())


# A patched model's output may differ from the unpatched one's where the rounding order differs
# (FLUX) or where a kernel's float32 sums differ in the last bit; what must not change is its
# accuracy. Measured against the same weights run in float32, the patched output's rms error may
# exceed the model's own bf16 error by at most 10 % (tiny models fluctuate by about 1 %; a wrong
# weight, offset or position moves it by orders of magnitude).
ACCURACY_SLACK = 1.1


@dataclass(frozen=True)
class OutputParity:
    """A patched model's output against the unpatched one and a float32 run of the same weights."""

    patched_error: float  # rms(patched - float32 run)
    model_error: float  # rms(unpatched - float32 run): the model's own low-precision error
    moved: float  # max |patched - unpatched|
    identical_share: float  # share of outputs bit-identical to the unpatched model's

    @property
    def ok(self) -> bool:
        return self.patched_error <= ACCURACY_SLACK * self.model_error

    def __str__(self) -> str:
        return (f"rms error vs float32 {self.patched_error:.3g} patched, {self.model_error:.3g} unpatched "
                f"({self.patched_error / self.model_error if self.model_error else float('nan'):.3f}x); "
                f"max moved {self.moved:.3g}; {self.identical_share:.1%} bit-identical")


def output_parity(patched: torch.Tensor, unpatched: torch.Tensor, exact: torch.Tensor) -> OutputParity:
    """Compare a patched model's output with the unpatched one's, judged by accuracy (see ACCURACY_SLACK)."""
    p, u, e = (t.detach().to("cpu", torch.float64) for t in (patched, unpatched, exact))

    def rms(t):
        return t.square().mean().sqrt().item() if t.numel() else 0.0

    moved = (p - u).abs().max().item() if p.numel() else 0.0
    return OutputParity(rms(p - e), rms(u - e), moved, (p == u).double().mean().item() if p.numel() else 1.0)


def require_inference(q: torch.Tensor, where: str) -> None:
    """The fused ops write q and k in place and have no backward pass."""
    if torch.is_grad_enabled() and q.requires_grad:
        raise RuntimeError(
            f"{where}: the patched attention writes q and k in place and has no backward: run the model "
            "under torch.inference_mode() or torch.no_grad() (generate() does), or unpatch it to train"
        )


def require_model(model, what: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected {what} (a torch.nn.Module), got {type(model).__name__}")


__all__ = ["LayoutError", "PatchReport", "PatchedModule", "SkippedModule", "Comparison", "compare", "OutputParity",
           "output_parity"]


def prepare_backend(backend: str, device, ops) -> None:
    """Resolve `backend` for every op the patched modules call, so that an unknown or unavailable
    backend fails here, by name, and build their CUDA C kernels now, together, in parallel: the
    first forward then waits for no build (one op after the other would add their build times)."""
    from cookbook import _checks, cuda, registry

    _checks.require_choice("backend", backend, _checks.BACKENDS)
    impls = [registry.resolve(op, backend, device) for op in dict.fromkeys(ops)]
    extensions = [impl.extension for impl in impls if impl.extension is not None]
    if extensions:
        failed = {name: error for name, error in cuda.build(extensions).items() if isinstance(error, Exception)}
        if failed:
            raise RuntimeError(f"backend={backend!r}: building {', '.join(failed)} failed: "
                               + "; ".join(f"{name}: {error}" for name, error in failed.items()))
