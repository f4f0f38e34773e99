"""Shared device helpers for the Numba kernels: the Numba twin of `kernels_cuda/include/`.

* `warp_sum(v)`: the sum of `v` over the 32 lanes of a warp, returned to every lane.
* `rsqrt(v)`: 1 / sqrt(v) in float32, computed as torch.rsqrt computes it on the same device;
  `rstd_from(sum_sq, width, eps)` builds the norm's scale on it.
* `warp_row(q, k)`: which (token, head) row a warp owns in the one-warp-per-row kernels.
* Storage codecs (`FP32`, `FP16`, `BF16`): how a kernel reads an element as float32 and writes a
  float32 back rounded to the storage dtype, so one kernel source serves every dtype.

Each helper is chosen once, at import, for where the kernels run: a GPU, or Numba's CUDA
simulator (`NUMBA_ENABLE_CUDASIM=1`, see `kernels_numba.SIMULATOR`). Kernels just call them.
"""

from kernels_numba import _compat  # noqa: F401  (before Numba compiles anything)

import functools
import math
from typing import NamedTuple

import numpy as np
import torch
from llvmlite import ir
from numba import cuda
from numba.cuda import cgutils, libdevice, types
from numba.cuda.core import targetconfig
from numba.cuda.extending import intrinsic
from numba.cuda.np.arrayobj import populate_array

from kernels_numba import SIMULATOR  # what Numba, imported above, chose: fixed from here on

WARP_SIZE = 32
FULL_WARP_MASK = 0xFFFFFFFF  # every lane takes part in the shuffle
MAX_THREADS_PER_BLOCK = 1024  # CUDA's limit; sizes the simulator's scratch


# --------------------------------------------------------------------------------------------
# lane_group_sum and warp_sum
# --------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def _lane_group_sum_shuffle(v, width):
    """GPU: a butterfly of `shfl_xor_sync` over offsets width/2 .. 1; after it every lane holds
    its group's sum. Lanes exchange within their own aligned group of `width` lanes (xor with an
    offset below `width` never leaves it); width 32 is the whole warp (offsets 16, 8, 4, 2, 1)."""
    offset = width // 2
    while offset > 0:
        v += cuda.shfl_xor_sync(FULL_WARP_MASK, v, offset)
        offset //= 2
    return v


@cuda.jit(device=True)
def _lane_group_sum_shared(v, width):
    """Simulator (it has no warp shuffles): lanes meet in shared memory instead of registers.

    Each thread writes `v` at its `threadIdx.x`, waits for the block, then adds up the `width`
    entries of its own group. The second barrier keeps a fast warp from overwriting the scratch
    of the next call while a slow one still reads it. The simulator keys a shared array by the
    line that allocates it, so every call of this helper gets the same scratch.
    """
    assert cuda.blockDim.x % WARP_SIZE == 0 and cuda.blockDim.x <= MAX_THREADS_PER_BLOCK
    scratch = cuda.shared.array(MAX_THREADS_PER_BLOCK, np.float32)
    tid = cuda.threadIdx.x
    scratch[tid] = v
    cuda.syncthreads()
    group_first = tid - tid % width
    total = np.float32(0.0)
    for i in range(group_first, group_first + width):
        total += scratch[i]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def _warp_sum_shuffle(v):
    """GPU: the lane-group butterfly over the whole warp."""
    return _lane_group_sum_shuffle(v, WARP_SIZE)


@cuda.jit(device=True)
def _warp_sum_shared(v):
    """Simulator: the shared-memory lane-group sum over the whole warp."""
    return _lane_group_sum_shared(v, WARP_SIZE)


# lane_group_sum(v, width): the sum of float32 `v` over each aligned group of `width` lanes of a
# warp (width a power of two up to 32, the same in every lane; a build-time constant unrolls
# it): for kernels that give each row a part of a warp. warp_sum(v): the same over all 32 lanes;
# every lane gets the result. Rules for callers (kernels use 1-D blocks whose size is a multiple
# of 32):
# * all 32 lanes of a warp call it together (a full-warp shuffle);
# * under the simulator it contains `syncthreads`, so EVERY thread of the block must reach each
#   call: kernels do not return early; idle warps carry an `active` flag and add 0. That is also
#   good GPU practice (no barrier or shuffle inside a divergent branch).
# The GPU adds in butterfly order, the simulator lane by lane: sums may differ in the last bit.
lane_group_sum = _lane_group_sum_shared if SIMULATOR else _lane_group_sum_shuffle
warp_sum = _warp_sum_shared if SIMULATOR else _warp_sum_shuffle


# --------------------------------------------------------------------------------------------
# warp_shfl
# --------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def _warp_shfl_shuffle(v, src_lane):
    """GPU: `shfl_sync`: this lane gets the `v` of lane `src_lane` of its warp."""
    return cuda.shfl_sync(FULL_WARP_MASK, v, src_lane)


@cuda.jit(device=True)
def _warp_shfl_shared(v, src_lane):
    """Simulator (no warp shuffles): every lane parks `v` in shared memory at its threadIdx.x,
    waits for the block, then reads the slot of `src_lane` of its own warp. The second barrier
    keeps a fast warp from overwriting the scratch while a slow one still reads it."""
    assert cuda.blockDim.x % WARP_SIZE == 0 and cuda.blockDim.x <= MAX_THREADS_PER_BLOCK
    scratch = cuda.shared.array(MAX_THREADS_PER_BLOCK, np.float32)
    tid = cuda.threadIdx.x
    scratch[tid] = v
    cuda.syncthreads()
    got = scratch[tid - tid % WARP_SIZE + src_lane]
    cuda.syncthreads()
    return got


# warp_shfl(v, src_lane): float32 `v` of lane `src_lane` (0..31, chosen per lane) of the same
# warp; `warp_shfl(v, lane ^ m)` is a butterfly exchange. Same rules as warp_sum: all 32 lanes
# call it together and, under the simulator, every thread of the block reaches each call.
warp_shfl = _warp_shfl_shared if SIMULATOR else _warp_shfl_shuffle


# --------------------------------------------------------------------------------------------
# block_sum
# --------------------------------------------------------------------------------------------
MAX_WARPS_PER_BLOCK = MAX_THREADS_PER_BLOCK // WARP_SIZE


@cuda.jit(device=True)
def _block_sum_shuffle(v):
    """GPU: each warp shuffles its sum, lane 0 parks it in shared memory, then every warp adds
    the warps' partials itself (no broadcast barrier). The first barrier keeps this call's
    writes from racing an earlier call's readers."""
    partials = cuda.shared.array(MAX_WARPS_PER_BLOCK, np.float32)
    lane = cuda.threadIdx.x % WARP_SIZE
    v = _warp_sum_shuffle(v)
    cuda.syncthreads()
    if lane == 0:
        partials[cuda.threadIdx.x // WARP_SIZE] = v
    cuda.syncthreads()
    partial = np.float32(0.0)
    if lane < cuda.blockDim.x // WARP_SIZE:
        partial = partials[lane]
    return _warp_sum_shuffle(partial)


@cuda.jit(device=True)
def _block_sum_shared(v):
    """Simulator (no shuffles): every thread writes `v` at its threadIdx.x, then adds up all of them."""
    assert cuda.blockDim.x % WARP_SIZE == 0 and cuda.blockDim.x <= MAX_THREADS_PER_BLOCK
    scratch = cuda.shared.array(MAX_THREADS_PER_BLOCK, np.float32)
    scratch[cuda.threadIdx.x] = v
    cuda.syncthreads()
    total = np.float32(0.0)
    for i in range(cuda.blockDim.x):
        total += scratch[i]
    cuda.syncthreads()
    return total


# block_sum(v): the sum of float32 `v` over every thread of a 1-D block (a multiple of 32
# threads); every thread gets the result. It holds barriers on the GPU and under the simulator:
# EVERY thread of the block must reach each call (no early return, no call under a divergent
# branch). Summation order differs between the two: results may differ in the last bits.
block_sum = _block_sum_shared if SIMULATOR else _block_sum_shuffle


# --------------------------------------------------------------------------------------------
# rsqrt
# --------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def _rsqrt_gpu(v):
    """GPU: the hardware reciprocal square root (libdevice `__nv_rsqrtf`, within 2 ulp): what
    CUDA C's `rsqrtf` and torch.rsqrt on a CUDA tensor compute."""
    return libdevice.rsqrtf(v)


@cuda.jit(device=True)
def _rsqrt_sim(v):
    """Simulator (no libdevice): 1 / sqrt(v), each step rounded to float32, as torch.rsqrt on a CPU."""
    return np.float32(1.0) / np.float32(math.sqrt(v))


# rsqrt(v): float32 1 / sqrt(v). Matching torch on the same device matters for rounding="hf":
# one float32 ulp of rstd can move the rounded intermediate by a bf16/fp16 ulp.
rsqrt = _rsqrt_sim if SIMULATOR else _rsqrt_gpu


@cuda.jit(device=True)
def rstd_from(sum_sq, width, eps):
    """rsqrt(sum_sq / width + eps), with `rstd_from_mean`'s 0 and NaN cases."""
    return rstd_from_mean(sum_sq / width, eps)


FLOAT32_INF = np.float32(np.inf)
FLOAT32_NAN = np.float32(np.nan)


@cuda.jit(device=True)
def rstd_from_mean(mean_sq, eps):
    """rsqrt(mean_sq + eps); 0 where that is 0 (eps=0 zero rows stay 0, not NaN); NaN where it is
    NaN or +Inf (a NaN or Inf in the row, or a sum of squares past float32), so the whole row
    comes out NaN, as `rstd_from` in kernels_cuda/include/common.cuh does.

    For kernels that form the mean as sum_sq * (1 / width), with the reciprocal from the host:
    one multiply instead of a float32 division (a reciprocal, a refinement and a slow-path check)
    per row, as torch's CUDA mean does; it may differ from sum_sq / width in the last bit where
    width is not a power of two."""
    mean_sq_eps = mean_sq + eps
    rstd = FLOAT32_NAN
    if mean_sq_eps == 0:
        rstd = np.float32(0.0)
    elif mean_sq_eps < FLOAT32_INF:  # false for NaN too
        rstd = rsqrt(mean_sq_eps)
    return rstd


# --------------------------------------------------------------------------------------------
# warp_row: the (token, head) row of a warp, for the one-warp-per-row kernels
# --------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def warp_row(q, k):
    """(lane, row, q_rows, is_q, is_k) of this thread: one warp per (token, head) row of q
    `[T, Hq, D]` and k `[T, Hk, D]`, q rows first (row r < T*Hq is token r // Hq, head r % Hq),
    then k rows (r - T*Hq, the same with Hk). Warps past the last row get is_q = is_k = False
    (kernels keep them running: every lane must reach the warp-wide calls)."""
    lane = cuda.threadIdx.x % WARP_SIZE
    row = cuda.blockIdx.x * (cuda.blockDim.x // WARP_SIZE) + cuda.threadIdx.x // WARP_SIZE
    q_rows = q.shape[0] * q.shape[1]
    is_q = row < q_rows
    is_k = not is_q and row < q_rows + k.shape[0] * k.shape[1]
    return lane, row, q_rows, is_q, is_k


# --------------------------------------------------------------------------------------------
# contiguous_row(a, t, h): row a[t, h] of a [T, H, D] array whose last dim is contiguous
# --------------------------------------------------------------------------------------------
# A strided view (a fused-qkv slice) reaches a GPU kernel as an 'A'-layout array: Numba then
# multiplies every index by the last dim's stride, a run-time value (a 64-bit multiply and add
# per access), so the compiler cannot fold a slot's constant offset into the load or store.
# Every op's contract makes that last dim contiguous, so a kernel may say so: the row comes back
# as a 'C' array starting at a[t, h], and x[c + 32] is the address of x[c] plus 128 bytes, an
# immediate of the load. (The row's pointer is derived from the argument's, so loads are global
# ones where the compiler can trace a row to one argument; a row picked between q and k at run
# time still gets generic loads, at the same instruction count.)
if not SIMULATOR:
    @intrinsic
    def contiguous_row(typingctx, a, t, h):
        """GPU: a[t, h] as a 1-D 'C' array (the caller vouches that a's last stride is its itemsize)."""
        if not (isinstance(a, types.Array) and a.ndim == 3 and isinstance(t, types.Integer)
                and isinstance(h, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            array_type, t_type, h_type = sig.args
            src = context.make_array(array_type)(context, builder, value=args[0])
            t = context.cast(builder, args[1], t_type, types.intp)
            h = context.cast(builder, args[2], h_type, types.intp)
            shape = cgutils.unpack_tuple(builder, src.shape, 3)
            strides = cgutils.unpack_tuple(builder, src.strides, 3)
            offset = builder.add(builder.mul(t, strides[0]), builder.mul(h, strides[1]))  # bytes
            first = builder.gep(builder.bitcast(src.data, ir.IntType(8).as_pointer()), [offset], inbounds=True)
            row = context.make_array(sig.return_type)(context, builder)
            populate_array(row, data=builder.bitcast(first, src.data.type), shape=(shape[2],),
                           strides=(src.itemsize,), itemsize=src.itemsize, meminfo=src.meminfo, parent=src.parent)
            return row._getvalue()

        return types.Array(a.dtype, 1, "C")(a, t, h), codegen
else:
    @cuda.jit(device=True)
    def contiguous_row(a, t, h):
        """Simulator: a[t, h] (a NumPy view; NumPy handles any stride)."""
        return a[t, h]


# --------------------------------------------------------------------------------------------
# Bit casts between float32 and its 32 bits (held as an int in [0, 2**32)).
# --------------------------------------------------------------------------------------------
F32_BITS_MASK = 0xFFFFFFFF


@cuda.jit(device=True)
def _float_bits_gpu(v):
    """The bits of float32 `v` (libdevice `__nv_float_as_int`), as an int64 in [0, 2**32)."""
    return np.int64(libdevice.float_as_int(np.float32(v))) & F32_BITS_MASK


@cuda.jit(device=True)
def _bits_float_gpu(bits):
    """The float32 whose bits are `bits` (libdevice `__nv_int_as_float`)."""
    return libdevice.int_as_float(np.int32(bits))  # int32 keeps the low 32 bits


@cuda.jit(device=True)
def _float_bits_sim(v):
    """Simulator (no libdevice): the same bit cast through a NumPy view."""
    return int(np.float32(v).view(np.uint32))


@cuda.jit(device=True)
def _bits_float_sim(bits):
    """Simulator (no libdevice): the same bit cast through a NumPy view."""
    return np.uint32(bits).view(np.float32)


float_bits = _float_bits_sim if SIMULATOR else _float_bits_gpu
bits_float = _bits_float_sim if SIMULATOR else _bits_float_gpu


# --------------------------------------------------------------------------------------------
# Storage codecs. A codec is three device functions:
#   decode(e)   -> float32   a stored element, read as float32 (exact)
#   encode(v)   -> element   float32 `v` rounded to nearest even, in the storage type
#   round_to(v) -> float32   float32 `v` rounded to the storage dtype and read back
#                            (the Hugging Face order rounds intermediates this way)
# --------------------------------------------------------------------------------------------
class Codec(NamedTuple):
    name: str
    decode: object
    encode: object
    round_to: object


@cuda.jit(device=True)
def _as_float32(v):
    """float32 storage: nothing to convert."""
    return np.float32(v)


FP32 = Codec("float32", _as_float32, _as_float32, _as_float32)


@cuda.jit(device=True)
def _fp16_encode(v):
    """float32 -> float16, round to nearest even."""
    return np.float16(v)


@cuda.jit(device=True)
def _fp16_round_to(v):
    """float32 rounded to float16 and back."""
    return np.float32(np.float16(v))


FP16 = Codec("float16", _as_float32, _fp16_encode, _fp16_round_to)


# bfloat16 is the top half of a float32: 8 exponent bits, 7 mantissa bits.
BF16_SHIFT = 16  # float32 bits dropped by bfloat16
BF16_HALF_ULP = (1 << (BF16_SHIFT - 1)) - 1  # 0x7FFF: add, then truncate = round to nearest
BF16_BITS_MASK = (1 << BF16_SHIFT) - 1  # 0xFFFF
BF16_SIGN_BIT = 1 << (BF16_SHIFT - 1)  # 0x8000
BF16_QUIET_NAN = 0x7FC0  # what torch's scalar conversion writes for any NaN


@cuda.jit(device=True)
def _bf16_bits(v):
    """float32 -> the 16 bits of bfloat16 (an int in [0, 0xFFFF]), round to nearest even.

    Adding 0x7FFF plus the lowest kept bit, then dropping 16 bits, rounds halfway cases to the
    even neighbour; overflow carries into the exponent and gives inf, as it should. A NaN could
    round to inf that way, so NaN returns a quiet NaN instead.
    """
    if v != v:
        return BF16_QUIET_NAN
    bits = float_bits(v)
    lowest_kept = (bits >> BF16_SHIFT) & 1
    return (bits + BF16_HALF_ULP + lowest_kept) >> BF16_SHIFT


@cuda.jit(device=True)
def _bf16_round_to(v):
    """float32 rounded to bfloat16 and back: the bf16 bits, moved back to the top half."""
    return bits_float(_bf16_bits(v) << BF16_SHIFT)


@cuda.jit(device=True)
def _bf16_decode_bits(e):
    """GPU: a bfloat16 element, stored as int16 bits, read as float32 (exact)."""
    return bits_float((np.int64(e) & BF16_BITS_MASK) << BF16_SHIFT)


@cuda.jit(device=True)
def _bf16_encode_bits(v):
    """GPU: float32 -> bfloat16 bits as the int16 that holds them (0x8000.. are negative)."""
    bits = _bf16_bits(v)
    if bits >= BF16_SIGN_BIT:
        bits -= BF16_BITS_MASK + 1
    return np.int16(bits)


# torch does not export bfloat16 through __cuda_array_interface__, so on a GPU a bf16 tensor
# travels as its int16 bit view; the simulator gets a float32 copy (see kernels_numba.qk_norm),
# whose writes must still be rounded to bf16.
if SIMULATOR:
    BF16 = Codec("bfloat16", _as_float32, _bf16_round_to, _bf16_round_to)
else:
    BF16 = Codec("bfloat16", _bf16_decode_bits, _bf16_encode_bits, _bf16_round_to)

CODECS = {codec.name: codec for codec in (FP32, FP16, BF16)}


# --------------------------------------------------------------------------------------------
# bfloat16 pairs as 32-bit words. A bf16 tensor viewed as int32 (`t.view(torch.int32)`) holds two
# neighbouring columns per word, column 2u in the low 16 bits and 2u + 1 in the high 16 bits, so
# a kernel moves two elements per load and store. The word travels as an int32 on the GPU and
# under the simulator alike (NumPy knows int32), so the same code runs on both.
# --------------------------------------------------------------------------------------------
BF16_HIGH_MASK = F32_BITS_MASK ^ BF16_BITS_MASK  # 0xFFFF0000: the high column, already in place


@cuda.jit(device=True)
def bf16x2_decode(word):
    """(lo, hi): the two bfloat16 columns of an int32 word as float32 (exact). A bfloat16 is the
    top half of a float32: lo moves up 16 bits, hi is masked in place; no rounding, NaN kept."""
    bits = np.int64(word) & F32_BITS_MASK  # the word as 32 unsigned bits
    return bits_float((bits << BF16_SHIFT) & F32_BITS_MASK), bits_float(bits & BF16_HIGH_MASK)


@cuda.jit(device=True)
def _bf16_rounded_high(v):
    """float32 `v` rounded to bfloat16 in place: the float32 bits with the bf16 in the high 16
    (round to nearest even as `_bf16_bits`, NaN -> quiet NaN) and garbage in the low 16.
    The uint32 cast lets the compiler add in 32 bits; nothing is lost, no non-NaN carries past
    bit 31 (the largest, -inf, is 0xFF800000)."""
    if v != v:
        return np.uint32(BF16_QUIET_NAN << BF16_SHIFT)
    bits = float_bits(v)
    return np.uint32(bits + BF16_HALF_ULP + ((bits >> BF16_SHIFT) & 1))


@cuda.jit(device=True)
def bf16x2_encode_int(lo, hi):
    """float32 lo, hi -> the int32 word of their bfloat16 values, lo in the low 16 bits, each
    rounded to nearest even (NaN -> quiet NaN) as `BF16.encode` rounds one element, in integer
    arithmetic (about 13 instructions a word). The int32 is the word's 32 bits (words from
    0x80000000 on are negative)."""
    return np.int32((_bf16_rounded_high(hi) & BF16_HIGH_MASK) | (_bf16_rounded_high(lo) >> BF16_SHIFT))


BF16X2_CVT_CC = (8, 0)  # the first GPUs with cvt.rn.bf16x2.f32


@intrinsic
def _bf16x2_encode_gpu(typingctx, lo, hi):
    """GPU: bf16x2_encode_int's word in one instruction, `cvt.rn.bf16x2.f32` (round to nearest
    even, NaN -> a quiet NaN; what CUDA C's __floats2bfloat162_rn compiles to), on GPUs that have
    it; older GPUs get bf16x2_encode_int's integer arithmetic. The choice is made per compiled
    kernel, from the compute capability it is compiled for (as Numba's own fastmath tanh does)."""
    if not (isinstance(lo, types.Float) and isinstance(hi, types.Float)):
        return None
    sig = types.int32(types.float32, types.float32)

    def codegen(context, builder, signature, args):
        lo, hi = (context.cast(builder, v, t, types.float32) for v, t in zip(args, signature.args))
        if targetconfig.ConfigStack().top().compute_capability >= BF16X2_CVT_CC:
            f32 = ir.FloatType()
            cvt = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [f32, f32]), "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(cvt, [hi, lo])  # the first operand goes to the high half
        return context.compile_internal(builder, lambda lo, hi: bf16x2_encode_int(lo, hi), sig, [lo, hi])

    return types.int32(lo, hi), codegen


# bf16x2_encode(lo, hi): float32 lo, hi -> their bfloat16 pair as one int32 word (lo in the low
# 16 bits). The simulator runs the integer version (NaN -> 0x7FC0, as torch's CPU conversion);
# a GPU from sm_80 on converts the pair in one instruction (NaN -> the canonical 0x7FFF).
bf16x2_encode = bf16x2_encode_int if SIMULATOR else _bf16x2_encode_gpu


@cuda.jit(device=True)
def bf16_round_to(v):
    """float32 `v` rounded to bfloat16 and back (as BF16.round_to) through bf16x2_encode: with
    lo = 0 the word is the rounded value's float32 bits, so a GPU from sm_80 on needs one
    conversion instruction where the integer rounding needs a dozen."""
    return bits_float(bf16x2_encode(np.float32(0.0), v))


@functools.cache
def make_word_normed(hf):
    """Device function normed(v, w, rstd, weight_offset) of the bf16 word kernels: x * rstd *
    (w + weight_offset) in float32, for the store's bf16x2_encode to round once (`hf` False), or
    in the Hugging Face order (`hf` True: the normalized value and the weight each rounded to
    bf16 first). `hf` is fixed when the kernel is built, so a kernel holds one straight path."""

    @cuda.jit(device=True)
    def normed(v, w, rstd, weight_offset):
        if hf:
            return bf16_round_to(v * rstd) * bf16_round_to(w + weight_offset)
        return v * rstd * (w + weight_offset)

    return normed


# --------------------------------------------------------------------------------------------
# Tables read by the word kernels (qk_norm's and qk_norm_rope's Numba v3): the weights and the
# cos/sin cache, as bf16 words (an int32 view, like the rows) or as float32. pair(t, u) is
# elements (2u, 2u + 1), word u of a bf16 table; element(t, c) is one.
# --------------------------------------------------------------------------------------------
class Table(NamedTuple):
    name: str
    pair: object
    element: object


@cuda.jit(device=True)
def _float_pair(t, u):
    return np.float32(t[2 * u]), np.float32(t[2 * u + 1])


@cuda.jit(device=True)
def _float_element(t, c):
    return np.float32(t[c])


@cuda.jit(device=True)
def _word_pair(t, u):
    return bf16x2_decode(t[u])


@cuda.jit(device=True)
def _word_element(t, c):
    """Element c: the low (even c) or high (odd c) half of word c // 2."""
    lo, hi = bf16x2_decode(t[c // 2])
    return hi if c % 2 else lo


FLOAT_TABLE = Table("float32", _float_pair, _float_element)
WORD_TABLE = Table("bfloat16 words", _word_pair, _word_element)
TABLE_OF = {torch.float32: FLOAT_TABLE, torch.bfloat16: WORD_TABLE}


WORDS_PER_LANE = 4  # a word kernel's words of a row per lane: 16 bytes, as one CUDA C vector


def row_lanes(head_dim):
    """Lanes per row of a word kernel: WORDS_PER_LANE words each, at most a warp (more words per
    lane from head_dim 512 on)."""
    return min(WARP_SIZE, head_dim // (2 * WORDS_PER_LANE))


def has_word_view(t):
    """Whether bf16 `t` can be viewed as int32 words (torch's rule: an even storage offset and
    every stride but the last, contiguous one even; the last size is even by the contract)."""
    return t.storage_offset() % 2 == 0 and all(s % 2 == 0 for s in t.stride()[:-1])


def word_views(*tensors):
    """int32 word views of the bf16 tensors among `tensors` (others as they are, e.g. float32
    weights), or None where a word kernel cannot take them: activations (`tensors[0]`) not bf16,
    or a bf16 tensor with no int32 view (`has_word_view`: an odd storage offset or stride, e.g. a
    fused-qkv view starting at an odd column)."""
    if tensors[0].dtype != torch.bfloat16 or not all(has_word_view(t) for t in tensors if t.dtype == torch.bfloat16):
        return None
    return [t.view(torch.int32) if t.dtype == torch.bfloat16 else t for t in tensors]


def q_rows_first(q, k, q_weight, k_weight):
    """(q, k, q_weight, k_weight), or with k and q swapped where q has no heads: the per-head
    kernels give warps past the last row a dummy row of q (no row of an empty q exists, and the
    simulator indexes it), and they treat q's rows and k's alike, so the swap is exact."""
    if q.shape[1] == 0:
        return k, q, k_weight, q_weight
    return q, k, q_weight, k_weight


def same_weight_storage(q_weight, k_weight):
    """One weight in the activation dtype and one in float32 (rare): both as float32, so that one
    kernel build reads both."""
    if q_weight.dtype != k_weight.dtype:
        return q_weight.float(), k_weight.float()
    return q_weight, k_weight


# --------------------------------------------------------------------------------------------
# Launching on torch tensors
# --------------------------------------------------------------------------------------------
CODEC_OF = {torch.float32: FP32, torch.float16: FP16, torch.bfloat16: BF16}


def _launch_gpu(kernel, blocks, threads, tensors, scalars, outputs=2):
    """Launch on torch's current stream with zero-copy views of `tensors` (CUDA tensors): the
    kernel writes the tensors' own memory, so `outputs` needs no copy-back here."""
    device = tensors[0].device
    with cuda.gpus[device.index]:
        stream = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
        arrays = [cuda.as_cuda_array(_bits_if_bf16(t.detach()), sync=False) for t in tensors]
        kernel[blocks, threads, stream](*arrays, *scalars)


def _bits_if_bf16(t):
    """bfloat16 has no __cuda_array_interface__ type: pass its bits as int16 (the BF16 codec reads them)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _launch_simulated(kernel, blocks, threads, tensors, scalars, outputs=2):
    """Launch under the simulator on NumPy arrays of `tensors` (CPU tensors): the first `outputs`
    are written in place (q and k by default), the rest read-only inputs.

    The simulator copies every array in and out and takes contiguous ones only, so strided views
    (fused qkv) travel as contiguous copies, and bfloat16 (unknown to NumPy) as float32 copies
    that the BF16 codec rounds to bfloat16 values; the outputs' copies are copied back."""
    hosts = [t.detach().float() if t.dtype == torch.bfloat16 else t.detach().contiguous() for t in tensors]
    kernel[blocks, threads](*(h.numpy() for h in hosts), *scalars)
    for t, h in zip(tensors[:outputs], hosts[:outputs]):
        if h.data_ptr() != t.data_ptr():
            t.detach().copy_(h)


# launch(kernel, blocks, threads, tensors, scalars, outputs=2): the first `outputs` tensors are
# written in place, the rest read-only inputs; scalars follow the arrays.
launch = _launch_simulated if SIMULATOR else _launch_gpu
