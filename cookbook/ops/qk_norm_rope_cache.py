"""`qk_norm_rope_cache`: `qk_norm_rope`, then k and v written into a paged KV cache, one pass.

Contract
--------
``qk_norm_rope_cache(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache,
slot_mapping, eps=1e-6, *, is_neox=True, rope_dim=None, k_scale=None, v_scale=None,
weight_offset=0.0, rounding="fused", validate_slots=False, backend="auto")``

* ``q``, ``k``, ``q_weight``, ``k_weight``, ``cos_sin_cache``, ``positions``, ``eps``,
  ``weight_offset``, ``rounding``, ``is_neox``, ``rope_dim``: exactly as in `qk_norm_rope`
  (position_offset 0). q **and k** are normalized and rotated in place: k is written back as well
  as into the cache (an engine's prefill attention reads the fresh k from there; a decode step
  that never reads it again pays one write of k, 1/4 of the op's bytes at Qwen3's widths).
* ``v``: ``[tokens..., num_kv_heads, head_dim]``, k's token dims, heads, head_dim, dtype and
  device, contiguous last dim; read only (q, k and v may be views of one fused qkv tensor).
* ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (vLLM's flash
  layout), last dim contiguous, other strides free (views of one ``[num_blocks, 2, ...]`` tensor
  work), one shape, one dtype: the activations' or ``torch.float8_e4m3fn``.
* ``slot_mapping``: ``[tokens]`` (q's token dims), int32 or int64, contiguous. Token t goes to
  block ``slot // block_size``, row ``slot % block_size``; ``-1`` skips the token (vLLM's padding).
* ``k_scale``, ``v_scale``: with an FP8 cache, float32 tensors of one element on q's device
  (per-tensor scales, read on the device: CUDA graphs see new values); without, None.
* math, per token t with slot s = slot_mapping[t] != -1 and kv head h::

      k_cache[s // B, s % B, h] = store(k'[t, h])      (k' = k after norm and rope, as written to k)
      v_cache[s // B, s % B, h] = store(v[t, h])
      store(x) = x                                                  (cache in the activation dtype)
      store(x) = e4m3(clamp(float32(x) / scale, -448, 448))         (FP8: round to nearest even)

  The FP8 value is computed from k' as rounded to the activation dtype (the value k holds), the
  division in float32 (correctly rounded, no reciprocal), saturated to e4m3's largest finite
  value 448, as vLLM's FP8 cache stores ``x / scale``. The reference is exactly
  ``(k.float() / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn)``; every backend stores the
  same bytes.
* Slots: ``validate_slots=True`` checks on the host first (one device sync; not under
  torch.compile or CUDA-graph capture) that every slot is -1 or in ``[0, num_blocks * block_size)``
  and that no slot but -1 repeats, and raises a ValueError naming the first bad token, with
  nothing written. Without it the kernels cannot raise (no host sync): a slot out of range is
  skipped like -1 (no backend ever writes outside the cache), and of two tokens with one slot
  either may land (a race on the GPU).
* Returns ``(q, k)``, the same tensors, in place, and the caches written. Nothing is written
  unless every check passes.
* Edges: q, k, k_cache and v_cache (all written) share no byte with each other or with anything
  the op reads (v, weights, tables, positions, slots, scales); the rest as in `qk_norm_rope`.
  A scale of 0 or a NaN one stores what the division gives (saturated, or NaN): scales are on the
  device and are not checked.

Bytes moved: q and k read and written once, v read once, k and v of every token with a slot
written once into the caches (in the cache's dtype), per token its position, slot and one cos/sin
row, the weights and scales once per launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cookbook import _checks as C
from cookbook.ops import qk_norm as qk_norm_contract
from cookbook.ops import qk_norm_rope as rope_contract
from cookbook.ops.qk_norm_rope import Rope
from cookbook.testing import Tolerance

OP = "qk_norm_rope_cache"
MAX_HEAD_DIM = rope_contract.MAX_HEAD_DIM
SLOT_DTYPES = (torch.int32, torch.int64)
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448: e4m3's largest finite value; stores saturate to it
SKIP = -1  # a slot that writes nothing (vLLM's padding tokens)

__all__ = ["Rope", "check_inputs", "reference", "expected", "make_inputs", "TOLERANCES", "bytes_moved",
           "BENCH_SHAPES"]


# --------------------------------------------------------------------------------------------
# Checks: the one function every backend runs first.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QKNormRopeCacheArgs:
    """Checked arguments: q, k, v as `[T, H, D]` views, positions and slots as `[T]` (no copies).
    The field order is every implementation's calling convention."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    cos_sin_cache: torch.Tensor
    positions: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    eps: float
    weight_offset: float
    rounding: str
    is_neox: bool
    rope_dim: int


def check_inputs(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, eps,
                 weight_offset, rounding, rope=Rope(), k_scale=None, v_scale=None,
                 validate_slots=False) -> QKNormRopeCacheArgs:
    if isinstance(rope, Rope) and rope.position_offset != 0:
        raise ValueError(f"rope: expected position_offset=0 (qk_norm_rope_cache takes positions as they are), "
                         f"got {rope.position_offset!r}")
    a = rope_contract.check_inputs(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding,
                                   rope)
    tokens, num_kv_heads, head_dim = a.k.shape
    token_dims = tuple(q.shape[:-2])

    expect_v = f"[tokens...={token_dims}, num_kv_heads={num_kv_heads}, head_dim={head_dim}] in {q.dtype} on {q.device}"
    C.require_tensor("v", v)
    if v.dtype != q.dtype:
        raise TypeError(f"v: expected {expect_v}, got {C.describe(v)}")
    if tuple(v.shape) != tuple(k.shape) or v.device != q.device:
        raise ValueError(f"v: expected {expect_v}, got {C.describe(v)}")
    C.require_contiguous_last_dim("v", v, expect_v)
    v_rows = C.as_token_rows("v", v, 2, expect_v)

    cache_dtype = _check_caches(k_cache, v_cache, q, num_kv_heads, head_dim)
    _check_slots_tensor(slot_mapping, token_dims, q.device)
    k_scale, v_scale = _check_scales(k_scale, v_scale, cache_dtype, q.device)
    check_in_place(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, k_scale,
                   v_scale)
    if validate_slots:
        check_slots(slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    return QKNormRopeCacheArgs(a.q, a.k, v_rows, a.q_weight, a.k_weight, a.cos_sin_cache, a.positions, k_cache,
                               v_cache, slot_mapping.view(-1), k_scale, v_scale, a.eps, a.weight_offset, a.rounding,
                               a.is_neox, a.rope_dim)


def _check_caches(k_cache, v_cache, q, num_kv_heads, head_dim) -> torch.dtype:
    """Both caches `[num_blocks, block_size, num_kv_heads, head_dim]`, one shape and dtype (q's or
    FP8), last dim contiguous, on q's device; returns the cache dtype."""
    expect = (f"[num_blocks, block_size, num_kv_heads={num_kv_heads}, head_dim={head_dim}] in {q.dtype} or "
              f"torch.float8_e4m3fn on {q.device}, last dim contiguous")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        C.require_tensor(name, cache)
        if cache.dtype not in (q.dtype, FP8):
            raise TypeError(f"{name}: expected {expect}, got {C.describe(cache)}")
        if cache.dim() != 4 or tuple(cache.shape[2:]) != (num_kv_heads, head_dim) or cache.device != q.device:
            raise ValueError(f"{name}: expected {expect}, got {C.describe(cache)}")
        if cache.shape[0] < 1 or cache.shape[1] < 1:
            raise ValueError(f"{name}: expected {expect} with num_blocks >= 1 and block_size >= 1, got "
                             f"{C.describe(cache)}")
        C.require_contiguous_last_dim(name, cache, expect)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: expected the dtype of k_cache ({k_cache.dtype}), got {C.describe(v_cache)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, got {C.describe(v_cache)}")
    return k_cache.dtype


def _check_slots_tensor(slot_mapping, token_dims, device) -> None:
    C.require_tensor("slot_mapping", slot_mapping)
    expect = f"[tokens...={token_dims}] int32 or int64, contiguous, on {device}"
    if slot_mapping.dtype not in SLOT_DTYPES:
        raise TypeError(f"slot_mapping: expected {expect}, got {C.describe(slot_mapping)}")
    if tuple(slot_mapping.shape) != token_dims or slot_mapping.device != device or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping: expected {expect}, got {C.describe(slot_mapping)}")


def _check_scales(k_scale, v_scale, cache_dtype, device):
    """FP8 caches need both scales (float32, one element, on the device); other caches take none."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if cache_dtype != FP8:
            if scale is not None:
                raise ValueError(f"{name}: expected None with a {cache_dtype} cache (scales are for a "
                                 f"torch.float8_e4m3fn cache), got {_describe_value(scale)}")
            continue
        expect = f"a float32 tensor of one element on {device} (the FP8 cache's per-tensor scale)"
        if scale is None:
            raise ValueError(f"{name}: expected {expect}, got None")
        C.require_tensor(name, scale)
        if scale.dtype != torch.float32:
            raise TypeError(f"{name}: expected {expect}, got {C.describe(scale)}")
        if scale.numel() != 1 or scale.device != device:
            raise ValueError(f"{name}: expected {expect}, got {C.describe(scale)}")
    if cache_dtype != FP8:
        return None, None
    return k_scale.view(1), v_scale.view(1)


def _describe_value(value) -> str:
    return C.describe(value) if isinstance(value, torch.Tensor) else repr(value)


def check_in_place(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, k_scale,
                   v_scale) -> None:
    """q, k, k_cache and v_cache writable here, each element at its own address, sharing no byte
    with each other or with anything the op reads. Under torch.compile, run by the compiled op."""
    read = dict(v=v, q_weight=q_weight, k_weight=k_weight, cos_sin_cache=cos_sin_cache, positions=positions,
                slot_mapping=slot_mapping)
    read.update({name: s for name, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s is not None})
    C.require_in_place(dict(q=q, k=k, k_cache=k_cache, v_cache=v_cache), read)


def check_slots(slot_mapping, num_slots) -> None:
    """validate_slots=True: every slot -1 or in [0, num_slots), no slot but -1 twice. Reads the
    slots on the host: a device sync (not under torch.compile or CUDA-graph capture)."""
    s = slot_mapping.to("cpu", torch.int64).view(-1)
    bad = ((s < SKIP) | (s >= num_slots)).nonzero()
    if bad.numel():
        t = int(bad[0])
        raise ValueError(f"slot_mapping: expected every slot -1 (skip) or in [0, num_blocks * block_size={num_slots}), "
                         f"got slot_mapping[{t}] = {int(s[t])} ({bad.numel()} of {s.numel()} tokens out of range)")
    written = s[s != SKIP]
    values, counts = written.unique(return_counts=True)
    if (counts > 1).any():
        slot = int(values[counts > 1][0])
        first, second = (s == slot).nonzero().view(-1)[:2].tolist()
        raise ValueError(f"slot_mapping: expected each slot at most once (but -1) in one call, got slot {slot} at "
                         f"tokens {first} and {second} ({int((counts > 1).sum())} repeated slots)")


# --------------------------------------------------------------------------------------------
# The reference: qk_norm_rope's reference, then the cache write. The oracle for every test.
# --------------------------------------------------------------------------------------------
def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What an FP8 cache stores for `x`: float32(x) / scale, saturated to +-448, to e4m3 (nearest even)."""
    return (x.to(torch.float32) / scale.to(torch.float32)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def cache_values(x, cache_dtype, scale):
    """`x` (`[N, H, D]`) as the cache stores it."""
    return to_fp8(x, scale) if cache_dtype == FP8 else x.to(cache_dtype)


def written_tokens(slot_mapping, num_slots):
    """(tokens that write, their slots): slot -1 and slots out of range write nothing."""
    s = slot_mapping.view(-1).to(torch.int64)
    tokens = ((s >= 0) & (s < num_slots)).nonzero().view(-1)
    return tokens, s[tokens]


def write_cache(x, cache, slot_mapping, scale) -> None:
    """cache[slot // B, slot % B] = store(x[t]) for every token t with a slot (index_put: no copy of the cache)."""
    block_size = cache.shape[1]
    tokens, slots = written_tokens(slot_mapping, cache.shape[0] * block_size)
    values = cache_values(x[tokens], cache.dtype, scale)
    if cache.dtype == FP8:  # indexing by bytes: index_put has no float8 kernel on every device
        cache, values = cache.view(torch.uint8), values.view(torch.uint8)
    cache[slots // block_size, slots % block_size] = values


@torch.no_grad()
def reference(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, k_scale,
              v_scale, eps, weight_offset, rounding, is_neox, rope_dim):
    """In-place PyTorch reference on checked views (any device): qk_norm_rope's reference, then
    k (as written) and v into their caches."""
    rope_contract.reference(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox,
                            rope_dim, 0)
    write_cache(k, k_cache, slot_mapping, k_scale)
    write_cache(v, v_cache, slot_mapping, v_scale)
    return q, k


def expected(inputs, eps, weight_offset, rounding):
    """{output: (float64 exact value, Hugging Face-order reference or None)} for unmodified inputs
    (see cookbook.testing.agreement). The caches' exact values are the exact k' and v divided by
    the scale and saturated (unrounded); their "hf" reference is the reference's caches."""
    out = rope_contract.expected({name: inputs[name] for name in _ROPE_INPUTS if name in inputs}, eps, weight_offset,
                                 rounding)
    a = check_inputs(**inputs, eps=eps, weight_offset=weight_offset, rounding=rounding)
    rounded = None
    if rounding == "hf":
        copies = {name: (t.clone() if isinstance(t, torch.Tensor) else t) for name, t in inputs.items()}
        b = check_inputs(**copies, eps=eps, weight_offset=weight_offset, rounding=rounding)
        reference(*(getattr(b, name) for name in QKNormRopeCacheArgs.__dataclass_fields__))
        rounded = {"k_cache": copies["k_cache"], "v_cache": copies["v_cache"]}
    k_exact = out["k"][0].view(a.k.shape)
    for name, x, scale in (("k_cache", k_exact, a.k_scale), ("v_cache", a.v.to(torch.float64), a.v_scale)):
        cache = inputs[name]
        exact = cache.to(torch.float64)
        tokens, slots = written_tokens(a.slot_mapping, cache.shape[0] * cache.shape[1])
        values = x[tokens]
        if cache.dtype == FP8:
            values = (values / scale.to(torch.float64)).clamp(-FP8_MAX, FP8_MAX)
        exact[slots // cache.shape[1], slots % cache.shape[1]] = values
        out[name] = (exact, None if rounded is None else rounded[name])
    return out


_ROPE_INPUTS = ("q", "k", "q_weight", "k_weight", "cos_sin_cache", "positions", "rope")


# --------------------------------------------------------------------------------------------
# Inputs, tolerances, bytes: what tests, benchmarks and notebooks share.
# --------------------------------------------------------------------------------------------
INPUT_KINDS = qk_norm_contract.INPUT_KINDS
FP8_SCALES = (0.05, 0.5)  # k_scale, v_scale of make_inputs: k' and v of rms ~1 over e4m3's range


def make_inputs(num_tokens=8, num_q_heads=4, num_kv_heads=1, head_dim=128, fp8=False, dtype=torch.bfloat16, device="cpu",
                *, rope_dim=None, is_neox=True, seed=0, weight_dtype=None, fused_qkv=False, kind="normal",
                num_blocks=None, block_size=16, slot_dtype=torch.int64, skipped=0, cos_sin_dtype=torch.float32,
                max_position=None, position_dtype=torch.int64):
    """Seeded inputs: `qk_norm_rope.make_inputs`' q, k, weights, cos/sin table and positions, a v
    (the third part of the fused qkv tensor with `fused_qkv=True`), caches of `num_blocks` blocks
    (default: room for every token and two blocks more) filled with seeded values, FP8 (with the
    FP8_SCALES) or in the activation dtype, and distinct random slots, the first `skipped` of them
    -1. Returns a dict of the op's arguments; the rotary settings travel as `rope`."""
    inputs = rope_contract.make_inputs(num_tokens, num_q_heads, num_kv_heads, head_dim, rope_dim, is_neox, dtype,
                                       device, seed=seed, weight_dtype=weight_dtype, fused_qkv=fused_qkv, kind=kind,
                                       cache_dtype=cos_sin_dtype, max_position=max_position,
                                       position_dtype=position_dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed + 2)
    k = inputs["k"]
    if fused_qkv:  # k is a view of [T, (Hq + 2 Hk) * D]: v is the rest of each row
        qkv = k.as_strided((num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim), (k.stride(0), 1),
                           k.storage_offset() - num_q_heads * head_dim)
        v = qkv[:, (num_q_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    else:
        v = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(dtype=dtype, device=device)
    cache_dtype = FP8 if fp8 else dtype
    num_blocks = num_tokens // block_size + 2 if num_blocks is None else num_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def cache(scale):
        values = torch.randn(shape, generator=gen)
        return (values.to(dtype) if cache_dtype != FP8 else to_fp8(values, torch.tensor([scale]))).to(device)

    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[: min(skipped, num_tokens)] = SKIP
    inputs.update(v=v, k_cache=cache(FP8_SCALES[0]), v_cache=cache(FP8_SCALES[1]),
                  slot_mapping=slots.to(dtype=slot_dtype, device=device))
    if cache_dtype == FP8:
        inputs.update(k_scale=torch.tensor([FP8_SCALES[0]], device=device),
                      v_scale=torch.tensor([FP8_SCALES[1]], device=device))
    return inputs


# q and k as qk_norm_rope's; a cache in the activation dtype holds exactly k and v; an FP8 cache
# rounds k (already rounded to the activation dtype) once more: within half an e4m3 ulp of the
# exact value plus the activation's half ulp, scaled down (2^-5 of an e4m3 ulp for bf16).
TOLERANCES = dict(rope_contract.TOLERANCES)
TOLERANCES[FP8] = Tolerance(fused_ulp=0.6, hf_ulp=1.0, hf_exact_share=0.99)


def bytes_moved(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, slot_mapping) -> int:
    """Fewest bytes a launch must move: qk_norm_rope's, v read once, and k and v of every token
    written once into the caches in their dtype (every token counted as writing: the benchmark's
    slots are all set), the slots once."""
    rope = rope_contract.bytes_moved(q, k, q_weight, k_weight, cos_sin_cache, positions)
    cache_writes = 2 * k.numel() * k_cache.element_size()
    return rope + v.numel() * v.element_size() + cache_writes + slot_mapping.numel() * slot_mapping.element_size()


def split_extra_bytes(k) -> int:
    """What the split path (qk_norm_rope, then a cache-write kernel) moves on top of `bytes_moved`:
    k, written by the first kernel, read again by the second (v is read once either way)."""
    return k.numel() * k.element_size()


# Shapes the benchmark sweeps: (tokens, q heads, kv heads, head_dim, fp8). Qwen3-8B's widths (32
# q heads, 8 kv heads, head_dim 128, NeoX, full rotary), decode (1 to 256 tokens, one per
# sequence) and prefill (4096 and 8192 tokens), each with a cache in the activation dtype (fp8=0)
# and an FP8 one (fp8=1).
BENCH_TOKENS = (1, 8, 32, 128, 256, 4096, 8192)
DECODE_MAX_TOKENS = 256
BENCH_SHAPES = [(t, 32, 8, 128, fp8) for fp8 in (0, 1) for t in BENCH_TOKENS]
BENCH_BLOCK_SIZE = 16  # vLLM's default block size
BENCH_MAX_POSITION = 4096  # a decode step's positions: anywhere in its sequence
SIM_SHAPES = [(2, 2, 1, 64, 0), (3, 2, 1, 32, 1)]  # (tokens, q heads, kv heads, head_dim, fp8), tiny


def bench_case(shape, dtype, device, seed=0):
    """(kwargs, label) for one benchmark shape: q, k and v as views of one fused qkv tensor, a
    float32 cos/sin table, distinct slots, and the positions and slots of a prefill (one sequence:
    positions 0..T-1, consecutive slots) or of a decode step (T <= 256: one token per sequence,
    each at a random position and in a block of its own). The weights are ones: the timed replays
    apply the op to its own output again and again, and `make_inputs`' weights (0.4 to 1.6) shrink
    most elements by a constant factor each time, to subnormals within about a hundred calls, where
    a correctly rounded division (the FP8 store's x / scale) takes a slow path that no model's
    activations take; with w = 1 a normalized row stays normalized and the rotation keeps each
    pair's length, so every call sees rows of the same scale (the property tests cover the weights)."""
    t, hq, hk, d, fp8 = shape
    if fp8 not in (0, 1):
        raise ValueError(f"shape: expected (tokens, q heads, kv heads, head_dim, fp8 0 or 1), got {shape!r}")
    decode = t <= DECODE_MAX_TOKENS
    num_blocks = t + 1 if decode else t // BENCH_BLOCK_SIZE + 1
    inputs = make_inputs(t, hq, hk, d, bool(fp8), dtype, device, seed=seed, fused_qkv=True, num_blocks=num_blocks,
                         block_size=BENCH_BLOCK_SIZE,
                         max_position=BENCH_MAX_POSITION if decode else t)
    if torch.device(device).type != "meta":
        for name in ("q_weight", "k_weight"):
            inputs[name] = torch.ones_like(inputs[name])
        gen = torch.Generator().manual_seed(seed)
        if decode:
            inputs["positions"] = torch.randint(0, BENCH_MAX_POSITION, (t,), generator=gen).to(device)
            inputs["slot_mapping"] = (torch.arange(t) * BENCH_BLOCK_SIZE + 3).to(device)  # row 3 of block t
        else:
            inputs["positions"] = torch.arange(t, device=device)
            inputs["slot_mapping"] = torch.arange(t, device=device)
    label = f"T={t} Hq={hq} Hk={hk} D={d} cache={'fp8' if fp8 else dtype_name(dtype)}"
    return inputs, label


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")
