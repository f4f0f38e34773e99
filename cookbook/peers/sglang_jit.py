"""SGLang's JIT kernels (``sglang.jit_kernel``, CUDA C++ built by TVM-FFI with nvcc on first use).

* `qknorm`: ``fused_inplace_qknorm``, per-head RMSNorm of q and k in one launch, in place;
* `qknorm_across_heads`: ``fused_inplace_qknorm_across_heads``, RMSNorm over each token's whole
  q row and k row in one launch, in place (in the releases that still have it);
* `qknorm_rope`: the diffusion kernel ``fused_inplace_qknorm_rope``, per-head RMSNorm then RoPE
  from a cos/sin cache, one launch, in place;
* `trtllm_qknorm_rope`: ``fused_qk_norm_rope``, ported from TensorRT-LLM: per-head RMSNorm then
  RoPE on one packed qkv tensor, computing cos/sin itself from the rotary base, in place.

``import sglang`` starts the serving framework (its frontend, server and model code, and their
dependencies), so the kernel modules are loaded through the shim of `load` (docs/peers.md).
"""

from __future__ import annotations

import functools

import torch

from cookbook.peers import guard
from cookbook.peers.adapter import HALF_DTYPES, PeerKernel, describe_layout, packed_qkv, peer

DISTRIBUTION = "sglang"

# Where each API lives, newest layout last: sglang.jit_kernel (up to 0.5.16), sglang.kernels (later).
NORM_MODULES = ("sglang.jit_kernel.norm", "sglang.kernels.ops.layernorm.norm")
ROPE_MODULES = ("sglang.jit_kernel.diffusion.qknorm_rope", "sglang.kernels.ops.diffusion.rope.qknorm_rope_jit")
TRTLLM_MODULES = ("sglang.jit_kernel.fused_qknorm_rope", "sglang.kernels.ops.attention.fused_qknorm_rope")

# The shim: packages registered without running their __init__ (which import the framework) ...
BARE_PACKAGES = ("sglang", "sglang.srt", "sglang.srt.utils")


def _identity_register_custom_op(fn=None, **_options):
    """``register_custom_op`` without the torch.library registration (which only torch.compile
    uses): the decorated function itself, which is what SGLang's eager path calls."""
    return fn if fn is not None else (lambda f: f)


# ... and the two framework helpers the kernel modules import, as stand-ins.
STUBS = {
    "sglang.utils": {"is_in_ci": lambda: False},  # read only by SGLang's own test ranges
    "sglang.srt.utils.custom_op": {"register_custom_op": _identity_register_custom_op},
}

# Sizes the kernels are built for (each wrapper's own checks; docs/peers.md).
QKNORM_HEAD_DIMS = (64, 128, 256, 512, 1024)
ROPE_HEAD_DIMS = (64, 128, 256)
ACROSS_HEADS_MAX_HIDDEN = 8192  # bf16/fp16 rows held in registers; larger rows are refused
WARP = 32


@functools.cache
def load() -> tuple[str, dict]:
    """("sglang <version>", {"norm": module, "rope": module, "trtllm": module}) through the shim;
    PeerUnavailable where SGLang is not installed or a kernel module does not import."""
    version = guard.require(DISTRIBUTION)
    for name in BARE_PACKAGES:
        guard.bare_package(name)
    for name, attributes in STUBS.items():
        guard.stub_module(name, **attributes)
    modules = {key: guard.first_module(candidates) for key, candidates in
               (("norm", NORM_MODULES), ("rope", ROPE_MODULES), ("trtllm", TRTLLM_MODULES))}
    return f"{DISTRIBUTION} {version}", modules


def _api(key: str, name: str):
    def check():
        package, modules = load()
        if not hasattr(modules[key], name):
            raise guard.PeerUnavailable(f"{package} has no {name} in {modules[key].__name__}")

    return check


def _half_weights(dtype, *weights) -> str | None:
    if dtype not in HALF_DTYPES:
        return f"{dtype} activations: the kernel is built for float16 and bfloat16 only"
    if any(w.dtype != dtype for w in weights):
        return f"weights in {weights[0].dtype}: the kernel reads them in the activation dtype ({dtype})"
    return None


def _no_offset(weight_offset) -> str | None:
    return None if weight_offset == 0.0 else f"weight_offset={weight_offset}: the kernel has no weight offset"


class QKNorm(PeerKernel):
    api = "sglang.jit_kernel.norm.fused_inplace_qknorm"

    def __init__(self):
        package, modules = load()
        super().__init__(package)
        self._fn = modules["norm"].fused_inplace_qknorm

    def not_applicable(self, q, k, q_weight, k_weight, eps, weight_offset, rounding):
        head_dim = q.shape[-1]
        if head_dim not in QKNORM_HEAD_DIMS:
            return f"head_dim={head_dim}: the kernel is built for head_dim in {QKNORM_HEAD_DIMS}"
        return _half_weights(q.dtype, q_weight, k_weight) or _no_offset(weight_offset)

    def __call__(self, q, k, q_weight, k_weight, eps, weight_offset, rounding):
        self._fn(q, k, q_weight, k_weight, eps)
        return q, k


@peer(_api("norm", "fused_inplace_qknorm"))
def qknorm():
    return QKNorm()


class QKNormAcrossHeads(PeerKernel):
    api = "sglang.jit_kernel.norm.fused_inplace_qknorm_across_heads"

    def __init__(self):
        package, modules = load()
        super().__init__(package)
        self._fn = modules["norm"].fused_inplace_qknorm_across_heads

    def not_applicable(self, q, k, q_weight, k_weight, eps, weight_offset, rounding):
        if q.shape[1] != k.shape[1]:
            return f"q_hidden={q.shape[1]}, k_hidden={k.shape[1]}: the kernel takes one hidden size for q and k"
        if not (q.is_contiguous() and k.is_contiguous()):
            return f"q and k are {describe_layout(q, k)}: the kernel takes contiguous [tokens, hidden] q and k"
        if q.shape[1] > ACROSS_HEADS_MAX_HIDDEN:
            return f"hidden={q.shape[1]}: the kernel refuses hidden sizes above {ACROSS_HEADS_MAX_HIDDEN} on this GPU"
        return _half_weights(q.dtype, q_weight, k_weight) or _no_offset(weight_offset)

    def __call__(self, q, k, q_weight, k_weight, eps, weight_offset, rounding):
        self._fn(q, k, q_weight, k_weight, eps)
        return q, k


@peer(_api("norm", "fused_inplace_qknorm_across_heads"))
def qknorm_across_heads():
    return QKNormAcrossHeads()


def _rope_lanes_reason(head_dim, rope_dim, is_neox) -> str | None:
    """The lane split both rope kernels use: a warp per head, head_dim / 32 elements per lane."""
    per_lane = head_dim // WARP
    if rope_dim % per_lane:
        return f"rope_dim={rope_dim}: the kernel rotates whole lanes of head_dim/32={per_lane} elements"
    lanes = rope_dim // per_lane
    if is_neox and (lanes < 2 or lanes & (lanes - 1)):
        return f"rope_dim={rope_dim}: NeoX pairs need a power-of-two count of rotating lanes, got {lanes}"
    return None


class QKNormRope(PeerKernel):
    api = "sglang.jit_kernel.diffusion.qknorm_rope.fused_inplace_qknorm_rope"

    def __init__(self):
        package, modules = load()
        super().__init__(package)
        self._fn = modules["rope"].fused_inplace_qknorm_rope

    def not_applicable(self, q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding,
                       is_neox, rope_dim, position_offset):
        head_dim = q.shape[-1]
        if head_dim not in ROPE_HEAD_DIMS:
            return f"head_dim={head_dim}: the kernel is built for head_dim in {ROPE_HEAD_DIMS}"
        if cos_sin_cache.dtype != torch.float32:
            return f"a {cos_sin_cache.dtype} cos/sin cache: the kernel reads a float32 cache"
        if position_offset:
            return f"position_offset={position_offset}: the kernel reads cache row positions[t]"
        return (_rope_lanes_reason(head_dim, rope_dim, is_neox) or _half_weights(q.dtype, q_weight, k_weight)
                or _no_offset(weight_offset))

    def __call__(self, q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding,
                 is_neox, rope_dim, position_offset):
        self._fn(q, k, q_weight, k_weight, cos_sin_cache, positions, is_neox=is_neox, eps=eps, rope_dim=rope_dim)
        return q, k


@peer(_api("rope", "fused_inplace_qknorm_rope"))
def qknorm_rope():
    return QKNormRope()


class TrtllmQKNormRope(PeerKernel):
    """The packed-qkv kernel: q and k must be the first heads of one contiguous qkv tensor, and
    it computes cos(p * f_i), sin(p * f_i) itself from the rotary base, so it is given the base the
    contract's cache was built with (its check then says whether its own angles agree)."""

    api = "sglang.jit_kernel.fused_qknorm_rope.fused_qk_norm_rope"

    def __init__(self):
        from cookbook.ops.qk_norm_rope import ROPE_BASE

        package, modules = load()
        super().__init__(package)
        self._fn = modules["trtllm"].fused_qk_norm_rope
        self._base = ROPE_BASE  # theta of the contract's cos/sin cache
        self._positions = {}  # positions.data_ptr() -> int32 copy (prepared once per argument set)

    def not_applicable(self, q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding,
                       is_neox, rope_dim, position_offset):
        head_dim = q.shape[-1]
        if q.dtype != torch.bfloat16:
            return f"{q.dtype} activations: the kernel is built for bfloat16 only"
        if head_dim not in ROPE_HEAD_DIMS:
            return f"head_dim={head_dim}: the kernel is built for head_dim in {ROPE_HEAD_DIMS}"
        if packed_qkv(q, k) is None:
            return f"q and k are {describe_layout(q, k)}: the kernel takes one packed, contiguous q | k | v tensor"
        if position_offset:
            return f"position_offset={position_offset}: the kernel rotates by positions[t]"
        return (_rope_lanes_reason(head_dim, rope_dim, is_neox) or _half_weights(q.dtype, q_weight, k_weight)
                or _no_offset(weight_offset))

    def prepare(self, q, k, q_weight, k_weight, cos_sin_cache, positions, *rest):
        """Its position ids are int32: the cast of the benchmark's int64 positions, done once per
        argument set (an engine keeps them in the dtype its kernels take)."""
        if positions.dtype != torch.int32:
            self._positions[positions.data_ptr()] = positions.to(torch.int32)

    def __call__(self, q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding,
                 is_neox, rope_dim, position_offset):
        qkv, v_heads = packed_qkv(q, k)
        position_ids = positions if positions.dtype == torch.int32 else self._positions.get(positions.data_ptr())
        if position_ids is None:
            position_ids = positions.to(torch.int32)
        self._fn(qkv, q.shape[1], k.shape[1], v_heads, q.shape[2], eps, q_weight, k_weight, self._base, is_neox,
                 position_ids, 1.0, 0.0, 0.0, 1.0, rope_dim)  # factor 1.0: plain RoPE (no YaRN); no attention scale
        return q, k


@peer(_api("trtllm", "fused_qk_norm_rope"))
def trtllm_qknorm_rope():
    return TrtllmQKNormRope()
