"""Numba kernel of `qk_norm_rope_cache`: qk_norm_rope's Numba kernel, then a cache-copy kernel.

v1 (`qk_norm_rope_cache`) is the split path in Numba: `kernels_numba.qk_norm_rope`'s last kernel
normalizes and rotates q and k in place, then `cache_copy_kernel` reads k (as written) and v
back and stores them at each token's slot. The one-pass kernel is the CUDA C ladder's subject
(kernels_cuda/qk_norm_rope_cache/); this file is the readable algorithm of the cache write, and
runs under the CUDA simulator as on a GPU (no shuffles: a copy needs none).

Copy mapping. grid.x: blocks of WARPS_PER_BLOCK warps; one warp per (token, kv head) row, row
r = token * num_kv_heads + head. Token t's slot s = slot_mapping[t] names block s // block_size,
row s % block_size of the caches; -1 (or a slot out of range) writes nothing. Lane l copies
columns l, l + 32, ... of the k row and of the v row (neighbouring lanes, neighbouring memory).

A cache in the activation dtype receives the elements as they are (bit for bit). An FP8 cache
(torch.float8_e4m3fn, passed as its uint8 bytes) receives `e4m3_bits(x / scale)`: the float32
quotient, saturated to +-448 and rounded to nearest even, as `cookbook.ops.qk_norm_rope_cache`
specifies.
"""

from kernels_numba import _compat  # noqa: F401  (before Numba compiles anything)

import functools
import math

import numpy as np
import torch
from numba import cuda

from kernels_numba.helpers import CODEC_OF, WARP_SIZE, float_bits, launch
from kernels_numba.qk_norm_rope import qk_norm_rope_v3

WARPS_PER_BLOCK = 4  # rows per block

# e4m3 (torch.float8_e4m3fn): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no infinity.
E4M3_MANTISSA_BITS = 3
E4M3_BIAS = 7
E4M3_MIN_EXP = 1 - E4M3_BIAS  # -6: the smallest normal exponent; below it, steps of 2^-9
E4M3_MAX_EXP = 8  # 448 = 1.75 * 2^8, the largest finite value
E4M3_MAX = 448.0
E4M3_MAX_BITS = 0x7E  # 448
E4M3_NAN_BITS = 0x7F
E4M3_SIGN_BIT = 0x80
F32_SIGN_SHIFT = 31


@cuda.jit(device=True)
def round_half_even(y):
    """`y` (>= 0) rounded to the nearest integer, ties to even."""
    whole = math.floor(y)
    rest = y - whole
    if rest > 0.5 or (rest == 0.5 and whole % 2 == 1):
        whole += 1
    return int(whole)


@cuda.jit(device=True)
def e4m3_bits(v):
    """float32 `v` -> the byte of e4m3: saturated to +-448, rounded to nearest even; NaN -> 0x7F.

    |v| = m * 2^(e - 3) with e the exponent of |v| (at least -6: below, the subnormal steps of
    2^-9) and m in [8, 16]: the byte is ((e + 7) << 3) + (m - 8), where m = 16 carries into the
    exponent by itself. Every step is exact in float32 (scaling by powers of two)."""
    if v != v:
        return E4M3_NAN_BITS
    sign = E4M3_SIGN_BIT if (float_bits(v) >> F32_SIGN_SHIFT) & 1 else 0
    a = abs(np.float32(v))
    if a >= E4M3_MAX:
        return sign | E4M3_MAX_BITS
    e = E4M3_MIN_EXP
    while e < E4M3_MAX_EXP and a >= np.float32(2.0) ** (e + 1):
        e += 1
    m = round_half_even(a * np.float32(2.0) ** (E4M3_MANTISSA_BITS - e))
    if a < np.float32(2.0) ** E4M3_MIN_EXP:  # subnormal: exponent field 0, m < 8 (8: the smallest normal)
        return sign | m
    return sign | (((e + E4M3_BIAS) << E4M3_MANTISSA_BITS) + (m - (1 << E4M3_MANTISSA_BITS)))


@functools.cache
def make_cache_copy_kernel(act, fp8):
    """The copy kernel for activations stored with codec `act`, into an FP8 cache or one in the
    activations' dtype."""
    load = act.decode

    @cuda.jit
    def cache_copy_kernel(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale):
        lane = cuda.threadIdx.x % WARP_SIZE
        row = cuda.blockIdx.x * (cuda.blockDim.x // WARP_SIZE) + cuda.threadIdx.x // WARP_SIZE
        heads, head_dim = k.shape[1], k.shape[2]
        if row >= k.shape[0] * heads:
            return  # no shuffle or barrier below: an early exit is safe
        t, h = row // heads, row % heads
        block_size = k_cache.shape[1]
        slot = np.int64(slot_mapping[t])
        if slot < 0 or slot >= k_cache.shape[0] * block_size:
            return  # -1 skips the token; a slot out of range writes nothing
        block, at = slot // block_size, slot % block_size
        for c in range(lane, head_dim, WARP_SIZE):
            if fp8:  # x / scale in float32, saturated, to e4m3
                k_cache[block, at, h, c] = e4m3_bits(np.float32(load(k[t, h, c])) / np.float32(k_scale[0]))
                v_cache[block, at, h, c] = e4m3_bits(np.float32(load(v[t, h, c])) / np.float32(v_scale[0]))
            else:  # the elements as they are
                k_cache[block, at, h, c] = k[t, h, c]
                v_cache[block, at, h, c] = v[t, h, c]

    return cache_copy_kernel


def write_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    """The copy kernel on checked tensors: k and v `[T, Hk, D]` into the caches at their slots."""
    rows = k.shape[0] * k.shape[1]
    if rows == 0:
        return
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:  # its bytes: Numba has no float8 type
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:
        k_scale = v_scale = torch.ones(1, dtype=torch.float32, device=k.device)  # unread
    kernel = make_cache_copy_kernel(CODEC_OF[k.dtype], fp8)
    warps = min(WARPS_PER_BLOCK, rows)  # a tiny launch keeps its block small (and the simulator quick)
    launch(kernel, -(-rows // warps), warps * WARP_SIZE, (k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale), (),
           outputs=2)


def qk_norm_rope_cache(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, k_scale,
                       v_scale, eps, weight_offset, rounding, is_neox, rope_dim):
    """v1, in place on checked `[T, H, D]` tensors and the caches; returns nothing."""
    qk_norm_rope_v3(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox,
                    rope_dim, 0)
    write_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
