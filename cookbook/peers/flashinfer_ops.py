"""FlashInfer's norm and RoPE (``flashinfer.norm``, ``flashinfer.rope``; CUDA C++ built by
TVM-FFI with nvcc on first use).

* `rmsnorm_per_head` (qk_norm): ``rmsnorm`` on q and on k as `[T, H, D]`, two launches;
* `rmsnorm_across_heads` (cross_head_norm): ``rmsnorm`` on q and on k as `[T, hidden]`;
* `rmsnorm_then_rope` (qk_norm_rope): the split path, ``rmsnorm`` on q and k then
  ``apply_rope_with_cos_sin_cache_inplace``, three launches.

Each writes in place through ``out=`` (FlashInfer's own way to update a tensor in place), so it
moves the same bytes per kernel as ours. ``import flashinfer`` imports every FlashInfer API and
their optional dependencies (the CuTe DSL, cuDNN, NCCL bindings ...), so the two modules are
loaded through the shim of `load` (docs/peers.md). Where the CuTe DSL is not installed,
``flashinfer.norm`` runs its CUDA kernels, as it documents; the package label says which ran.
"""

from __future__ import annotations

import functools

import torch

from cookbook.peers import guard
from cookbook.peers.adapter import HALF_DTYPES, PeerKernel, peer

DISTRIBUTION = "flashinfer-python"


@functools.cache
def load() -> tuple[str, object, object]:
    """("flashinfer-python <version>", flashinfer.norm, flashinfer.rope) through the shim."""
    version = guard.require(DISTRIBUTION)
    guard.bare_package("flashinfer")  # its __init__ imports every API and their dependencies
    norm = guard.first_module(("flashinfer.norm",))
    rope = guard.first_module(("flashinfer.rope",))
    return f"{DISTRIBUTION} {version}", norm, rope


def _norm_path(norm, device) -> str:
    """Which of flashinfer.norm's kernels runs on `device`: its CUDA kernels or its CuTe DSL ones."""
    use_cuda = getattr(norm, "_use_cuda_norm", None)
    return "CUDA" if use_cuda is None or use_cuda(device) else "CuTe DSL"


def _reason(x, weights, weight_offset) -> str | None:
    if x.dtype not in HALF_DTYPES:
        return f"{x.dtype} activations: the kernels are built for float16 and bfloat16 only"
    if any(w.dtype != x.dtype for w in weights):
        return f"weights in {weights[0].dtype}: the kernel reads them in the activation dtype ({x.dtype})"
    if weight_offset != 0.0:
        return f"weight_offset={weight_offset}: rmsnorm has no weight offset"
    return None


class RMSNorm(PeerKernel):
    """``rmsnorm(x, w, eps, out=x)`` on q, then on k: per head on `[T, H, D]` views, across heads
    on `[T, hidden]` rows (the rows the op's checks give)."""

    api = "flashinfer.norm.rmsnorm"

    def __init__(self):
        package, self._norm, _ = load()
        super().__init__(package)

    def not_applicable(self, q, k, q_weight, k_weight, eps, weight_offset, rounding):
        return _reason(q, (q_weight, k_weight), weight_offset)

    def __call__(self, q, k, q_weight, k_weight, eps, weight_offset, rounding):
        self._norm.rmsnorm(q, q_weight, eps, out=q)
        self._norm.rmsnorm(k, k_weight, eps, out=k)
        return q, k

    def label(self, device) -> str:
        return f"{self.package} ({_norm_path(self._norm, device)} norm)"


@peer(load)
def rmsnorm_per_head():
    return RMSNorm()


@peer(load)
def rmsnorm_across_heads():
    return RMSNorm()


class RMSNormThenRope(PeerKernel):
    """The split path: ``rmsnorm`` in place on q and k, then
    ``apply_rope_with_cos_sin_cache_inplace(positions, q, k, head_dim, cache, is_neox)``."""

    api = "flashinfer.norm.rmsnorm + flashinfer.rope.apply_rope_with_cos_sin_cache_inplace"

    def __init__(self):
        package, self._norm, self._rope = load()
        super().__init__(package)

    def not_applicable(self, q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding,
                       is_neox, rope_dim, position_offset):
        if cos_sin_cache.dtype != torch.float32:
            return f"a {cos_sin_cache.dtype} cos/sin cache: apply_rope_with_cos_sin_cache_inplace reads float32"
        if position_offset:
            return f"position_offset={position_offset}: the rope reads cache row positions[t]"
        return _reason(q, (q_weight, k_weight), weight_offset)

    def __call__(self, q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding,
                 is_neox, rope_dim, position_offset):
        self._norm.rmsnorm(q, q_weight, eps, out=q)
        self._norm.rmsnorm(k, k_weight, eps, out=k)
        self._rope.apply_rope_with_cos_sin_cache_inplace(positions, q, k, q.shape[-1], cos_sin_cache, is_neox)
        return q, k

    def label(self, device) -> str:
        return f"{self.package} ({_norm_path(self._norm, device)} norm)"


@peer(load)
def rmsnorm_then_rope():
    return RMSNormThenRope()
