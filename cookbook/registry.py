"""The only list of implementations: op -> reference, Numba versions, CUDA C versions, peers.

Tests, the benchmark and the notebooks iterate this module; an implementation that is not here
does not exist, and one that is here is tested and benchmarked automatically. Targets are
`module:attribute` strings resolved on first use, so importing the registry imports neither
Numba nor the CUDA extension.

Every implementation has the same calling convention: ``fn(*checked_args)``, in place, on the
tensors that the op's ``check_inputs`` returned (for the per-head ops, ``[T, H, D]`` views).
The `lead` of a CUDA C version is the one-line comment that precedes its kernel in the header
(`// vN: <lead>`); a test keeps the two identical.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

LEVELS = ("reference", "numba", "cuda", "peer")


@dataclass(frozen=True)
class Impl:
    op: str
    name: str
    level: str  # one of LEVELS
    version: int  # 0 for the reference and peers
    target: str  # "module:attribute"
    lead: str  # what changed from the previous version, and which bottleneck it removes

    def build(self):
        """A fresh callable (peers return a new compiled object each time: one per shape)."""
        module, attr = self.target.split(":")
        obj = getattr(importlib.import_module(module), attr)
        if self.level == "cuda":
            return functools.partial(obj, version=self.version)
        if self.level == "peer":
            return obj()  # peers are factories
        return obj

    @functools.cached_property
    def fn(self):
        return self.build()

    def unavailable(self, device) -> str | None:
        """None when this implementation can run on tensors of `device`, else the reason."""
        device = torch.device(device)
        if self.level == "reference":
            return None
        if self.level == "numba":
            from kernels_numba import SIMULATOR

            if device.type == "cuda":
                return "the Numba CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1)" if SIMULATOR else None
            return None if SIMULATOR else "Numba kernels need a CUDA GPU or NUMBA_ENABLE_CUDASIM=1"
        if device.type != "cuda":
            return f"{self.level} implementations run on CUDA tensors only"
        if self.level == "cuda":
            from cookbook import cuda

            return cuda.unavailable()
        if self.level == "peer" and self.name == "torch_compile":
            return None
        return "unknown"


def _ref(op, target):
    return Impl(op, "reference", "reference", 0, target,
                "the math in readable PyTorch: several kernels, float32 intermediates through memory")


def _cuda(op, version, lead):
    return Impl(op, f"cuda_v{version}", "cuda", version, f"cookbook.cuda:{op}", lead)


IMPLEMENTATIONS: dict[str, list[Impl]] = {
    "qk_norm": [
        _ref("qk_norm", "cookbook.ops.qk_norm:reference"),
        Impl("qk_norm", "numba_v1", "numba", 1, "kernels_numba.qk_norm:qk_norm",
             "one warp per (token, head): lanes read neighbouring elements, a warp-shuffle sum of squares, a second pass writes"),
        _cuda("qk_norm", 1, "one thread per (token, head) row, the naive port: a warp's loads are head_dim elements apart (uncoalesced)"),
        _cuda("qk_norm", 2, "one warp per (token, head) with a shuffle reduction: lanes read neighbouring elements (coalesced) - removes v1's scattered loads"),
        _cuda("qk_norm", 3, "16-byte vectors held in registers, lanes sized to the head, q and k on a persistent grid with the weights loaded once per thread - removes v2's second read and narrow loads"),
        Impl("qk_norm", "torch_compile", "peer", 0, "cookbook.peers:qk_norm_compiled",
             "torch.compile(fullgraph=True) of the reference: what a user would pick instead"),
    ],
}

# The op name -> its contract module.
CONTRACTS = {"qk_norm": "cookbook.ops.qk_norm"}


def ops() -> list[str]:
    return list(IMPLEMENTATIONS)


def contract(op: str):
    return importlib.import_module(CONTRACTS[op])


def implementations(op: str, levels=LEVELS) -> list[Impl]:
    return [impl for impl in IMPLEMENTATIONS[op] if impl.level in levels]


def get(op: str, name: str) -> Impl:
    for impl in IMPLEMENTATIONS[op]:
        if impl.name == name:
            return impl
    raise KeyError(f"{op}: no implementation named {name!r}; have {[i.name for i in IMPLEMENTATIONS[op]]}")


def latest(op: str, level: str) -> Impl:
    """The last (fastest) version of a level: what `backend=level` runs."""
    return max(implementations(op, (level,)), key=lambda impl: impl.version)


@functools.cache
def _warn_fallback(op: str, reason: str) -> None:
    import warnings

    warnings.warn(f"{op}: backend='auto' falls back to the PyTorch reference ({reason})", RuntimeWarning, stacklevel=3)


def resolve(op: str, backend: str, device) -> Impl:
    """The implementation `backend` names, for tensors on `device`."""
    device = torch.device(device)
    if backend == "auto":
        if device.type != "cuda":
            return latest(op, "reference")
        for level in ("cuda", "numba"):
            impl = latest(op, level)
            if impl.unavailable(device) is None:
                return impl
        _warn_fallback(op, latest(op, "cuda").unavailable(device))
        return latest(op, "reference")
    from cookbook._checks import require_backend_device

    require_backend_device(backend, device)
    impl = latest(op, backend)
    reason = impl.unavailable(device)
    if reason:
        raise RuntimeError(f"backend={backend!r} is unavailable for {op} on {device}: {reason}")
    return impl

