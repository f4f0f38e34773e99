"""Liger-Kernel's Triton RMSNorm and RoPE (``liger_kernel.functional``), as Hugging Face models
patched by Liger run them.

* `rms_norm_per_head` (qk_norm): ``rms_norm`` on q and on k, each viewed as rows of head_dim;
* `rms_norm_across_heads` (cross_head_norm): ``rms_norm`` on q and on k as `[T, hidden]` rows;
* `rms_norm_then_rope` (qk_norm_rope): ``rms_norm`` on q and k, then ``rope``.

Both write new tensors: ``rms_norm`` returns its output, and ``rope`` rotates the tensors it is
given once they are contiguous (the normalized ones, here). Their allocations are timed with them.
Both are asked for Liger's Triton kernels (``impl="nvidia-triton"``), where Liger would otherwise
pick among its kernel DSLs. ``rms_norm`` keeps its default casting mode ("llama": the rstd in
float32, the weight product in the activation dtype). ``rope`` reads cos and sin per token in the Hugging Face layout
(``[1, T, rope_dim]``, each half repeated, in the activation dtype), which a model computes once
per forward pass for all its layers: `prepare` gathers them from the contract's cache at the
positions, outside the timed calls.
"""

from __future__ import annotations

import functools

import torch

from cookbook.peers import guard
from cookbook.peers.adapter import PeerKernel, describe_layout, peer

DISTRIBUTION = "liger-kernel"
IMPL = "nvidia-triton"  # Liger dispatches each op to one of its kernel DSLs: its Triton kernels, named


@functools.cache
def load() -> tuple[str, object]:
    """("liger-kernel <version>", liger_kernel.functional)."""
    version = guard.require(DISTRIBUTION)
    functional = guard.first_module(("liger_kernel.functional",))
    return f"{DISTRIBUTION} {version}", functional


def _foldable(x) -> bool:
    """Whether ``x.view(-1, x.shape[-1])`` exists (the view rms_norm takes of its input)."""
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:
        return False
    return True


class RMSNorm(PeerKernel):
    """``rms_norm(x, w, eps)`` on q, then on k: new tensors."""

    api = "liger_kernel.functional.rms_norm"
    writes_new = True

    def __init__(self):
        package, self._f = load()
        super().__init__(package)

    def not_applicable(self, q, k, q_weight, k_weight, eps, weight_offset, rounding):
        if not (_foldable(q) and _foldable(k)):
            return (f"q and k are {describe_layout(q, k)}: rms_norm views its input as rows with "
                    "x.view(-1, dim), which strided heads do not allow")
        return None

    def __call__(self, q, k, q_weight, k_weight, eps, weight_offset, rounding):
        q_out = self._f.rms_norm(q, q_weight, eps, offset=weight_offset, impl=IMPL)
        k_out = self._f.rms_norm(k, k_weight, eps, offset=weight_offset, impl=IMPL)
        return q_out, k_out


@peer(load)
def rms_norm_per_head():
    return RMSNorm()


@peer(load)
def rms_norm_across_heads():
    return RMSNorm()


def hf_cos_sin(cos_sin_cache, positions, position_offset, rope_dim, dtype):
    """cos and sin per token in the Hugging Face layout: `[1, T, rope_dim]`, each half repeated,
    in the activation dtype (what a Llama-style rotary module hands every layer)."""
    rows = cos_sin_cache[positions.long() + position_offset]
    cos, sin = rows[:, : rope_dim // 2], rows[:, rope_dim // 2 :]
    return (torch.cat([cos, cos], dim=-1).to(dtype).unsqueeze(0),
            torch.cat([sin, sin], dim=-1).to(dtype).unsqueeze(0))


class RMSNormThenRope(PeerKernel):
    """``rms_norm`` on q and k, then ``rope(q, k, cos, sin)`` on the normalized tensors, which
    it reads as `[1, H, T, D]` (the Hugging Face layout of attention inputs)."""

    api = "liger_kernel.functional.rms_norm + liger_kernel.functional.rope"
    writes_new = True

    def __init__(self):
        package, self._f = load()
        super().__init__(package)
        self._cos_sin = {}  # (cache, positions) data pointers -> (cos, sin), prepared per argument set

    def not_applicable(self, q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding,
                       is_neox, rope_dim, position_offset):
        if not is_neox:
            return "interleaved (GPT-J) pairs: rope rotates halves (NeoX) only"
        if not (_foldable(q) and _foldable(k)):
            return (f"q and k are {describe_layout(q, k)}: rms_norm views its input as rows with "
                    "x.view(-1, dim), which strided heads do not allow")
        return None

    def _key(self, cos_sin_cache, positions):
        return cos_sin_cache.data_ptr(), positions.data_ptr()

    def prepare(self, q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding,
                is_neox, rope_dim, position_offset):
        self._cos_sin[self._key(cos_sin_cache, positions)] = hf_cos_sin(cos_sin_cache, positions, position_offset,
                                                                         rope_dim, q.dtype)

    def __call__(self, q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding,
                 is_neox, rope_dim, position_offset):
        cos_sin = self._cos_sin.get(self._key(cos_sin_cache, positions))
        if cos_sin is None:
            cos_sin = hf_cos_sin(cos_sin_cache, positions, position_offset, rope_dim, q.dtype)
        q_out = self._f.rms_norm(q, q_weight, eps, offset=weight_offset, impl=IMPL)
        k_out = self._f.rms_norm(k, k_weight, eps, offset=weight_offset, impl=IMPL)
        q_rot, k_rot = self._f.rope(q_out.unsqueeze(0).transpose(1, 2), k_out.unsqueeze(0).transpose(1, 2), *cos_sin,
                                    impl=IMPL)
        return q_rot.transpose(1, 2).squeeze(0), k_rot.transpose(1, 2).squeeze(0)


@peer(load)
def rms_norm_then_rope():
    return RMSNormThenRope()
