"""Numba kernels of `cross_head_norm`: v1 (below) and v2, v1 on bf16 rows read as 32-bit words.

Mapping. grid = (tokens, 2): blockIdx.x is the token, blockIdx.y picks the tensor (0: q, 1: k),
so q and k rows of different widths (q_hidden != k_hidden) run in one launch. A row is the whole
hidden (thousands of elements), too long for one warp: thread t of the block reads elements
t, t + blockDim.x, t + 2 * blockDim.x, ... (neighbouring threads read neighbouring elements:
coalesced). Two passes over the row:

1. each thread adds up x^2 of its elements in float32; `block_sum` gives every thread the row's
   sum_sq; rstd = rsqrt(sum_sq / H + eps), or 0 where sum_sq / H + eps == 0 (eps=0 zero rows
   stay 0, not NaN), or NaN where it is NaN or +Inf (`rstd_from`: the whole row NaN);
2. each thread reads its elements again and writes y = x * rstd * (w + weight_offset), rounded
   once (rounding="fused"), or in the Hugging Face order (rounding="hf"):
   n = round(x * rstd), y = round(n * round(w + weight_offset)).

`cookbook.ops.cross_head_norm` is the specification; the storage codecs of
`kernels_numba.helpers` keep the kernel source the same for float32, float16 and bfloat16. The
launch (torch stream on a GPU; copies under the simulator) is `helpers.launch`.

v2 (`cross_head_norm_v2`) keeps this mapping and both passes, but views a bf16 row as int32 words
(word u holds columns 2u and 2u + 1), so one load and one store move two columns, and builds one
kernel per rounding order and weight storage, with unsigned indices: faster than v1 at every bench
shape on an H200 (docs/results/cross_head_norm_h200_history.md). Other dtypes, and bf16 views
with no int32 view, run v1.
"""

from kernels_numba import _compat  # noqa: F401  (before Numba compiles anything)

import functools

import numpy as np
from numba import cuda

from kernels_numba.helpers import (CODEC_OF, MAX_THREADS_PER_BLOCK, TABLE_OF, WARP_SIZE, WORDS_PER_LANE, bf16x2_decode,
                                   bf16x2_encode, block_sum, launch, make_word_normed, rstd_from, same_weight_storage,
                                   word_views)

MAX_THREADS = 256  # threads per block for wide rows
MIN_ELEMS_PER_THREAD = 4  # narrow rows get fewer threads, each with at least this many elements
NUM_TENSORS = 2  # grid.y: q, k
assert MAX_THREADS % WARP_SIZE == 0 and MAX_THREADS <= MAX_THREADS_PER_BLOCK, "whole warps, at most 1024 threads"



@functools.cache
def make_row_sum_sq(act):
    """Device function: this thread's share of sum(x^2) over row x[t, :] (pass 1)."""
    load = act.decode

    @cuda.jit(device=True)
    def row_sum_sq(x, t):
        sum_sq = np.float32(0.0)
        for d in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            xd = load(x[t, d])
            sum_sq += xd * xd
        return sum_sq

    return row_sum_sq


@functools.cache
def make_write_row(act, weight):
    """Device function: this thread's elements of row x[t, :], normalized and scaled, in place (pass 2)."""
    load, store, round_to, load_w = act.decode, act.encode, act.round_to, weight.decode

    @cuda.jit(device=True)
    def write_row(x, w, t, rstd, weight_offset, hf):
        for d in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            normed = load(x[t, d]) * rstd
            w_eff = load_w(w[d]) + weight_offset
            if hf:  # Hugging Face order: round the normalized value and the weight first
                x[t, d] = store(round_to(normed) * round_to(w_eff))
            else:  # fused: one rounding at the end
                x[t, d] = store(normed * w_eff)

    return write_row


@functools.cache
def make_cross_head_norm_kernel(act, q_weight, k_weight):
    """The kernel for activations stored with codec `act` and each weight with its own codec.

    Built once per triple of codecs (cached); Numba then compiles it on first launch for the
    argument types it sees (contiguous or strided q and k).
    """
    row_sum_sq = make_row_sum_sq(act)
    write_q, write_k = make_write_row(act, q_weight), make_write_row(act, k_weight)

    @cuda.jit
    def cross_head_norm_kernel(q, k, q_w, k_w, eps, weight_offset, hf):
        t = cuda.blockIdx.x
        is_q = cuda.blockIdx.y == 0  # uniform over the block: no thread diverges from its block

        # Every thread reaches block_sum (it holds barriers): no early return.
        if is_q:
            sum_sq = row_sum_sq(q, t)
            hidden = q.shape[1]
        else:
            sum_sq = row_sum_sq(k, t)
            hidden = k.shape[1]
        rstd = rstd_from(block_sum(sum_sq), np.float32(hidden), eps)

        if is_q:
            write_q(q, q_w, t, rstd, weight_offset, hf)
        else:
            write_k(k, k_w, t, rstd, weight_offset, hf)

    return cross_head_norm_kernel


def threads_for(hidden: int) -> int:
    """Whole warps, at least MIN_ELEMS_PER_THREAD elements each, at most MAX_THREADS."""
    warps = -(-hidden // (MIN_ELEMS_PER_THREAD * WARP_SIZE))
    return min(MAX_THREADS, warps * WARP_SIZE)


def cross_head_norm(q, k, q_weight, k_weight, eps, weight_offset, rounding):
    """In place on checked `[T, hidden]` tensors (one dtype and device); returns nothing."""
    tokens = q.shape[0]
    if tokens == 0:
        return
    codec = CODEC_OF[q.dtype]
    kernel = make_cross_head_norm_kernel(codec, CODEC_OF[q_weight.dtype], CODEC_OF[k_weight.dtype])
    threads = threads_for(max(q.shape[1], k.shape[1]))
    blocks = (tokens, NUM_TENSORS)
    scalars = (np.float32(eps), np.float32(weight_offset), rounding == "hf")
    launch(kernel, blocks, threads, (q, k, q_weight, k_weight), scalars)


# --------------------------------------------------------------------------------------------
# v2: bf16 rows as 32-bit words
# --------------------------------------------------------------------------------------------
# v1 moves one 2-byte element per load and per store, with the rounding order a runtime branch
# per element and signed 64-bit indices (each with Numba's negative-index wraparound). v2 views a
# bf16 row as int32 words (word u holds columns 2u and 2u + 1, as the Numba v3 kernels of qk_norm
# and qk_norm_rope do), so one load and one store move two columns; the rounding order and the
# weights' storage are fixed when the kernel is built, and indices are unsigned. The algorithm is
# v1's: a block per (token, tensor), threads striding over the row's words, two passes (the
# second re-reads the row, from L1 or L2).
@functools.cache
def make_row_sum_sq_words():
    """Device function: this thread's share of sum(x^2) over bf16 word row x[t, :] (pass 1)."""

    @cuda.jit(device=True)
    def row_sum_sq_words(x, t):
        row = np.uint32(t)  # unsigned indices: no negative-index wraparound per access
        sum_sq = np.float32(0.0)
        for u in range(np.uint32(cuda.threadIdx.x), np.uint32(x.shape[1]), np.uint32(cuda.blockDim.x)):
            lo, hi = bf16x2_decode(x[row, u])
            sum_sq += lo * lo + hi * hi
        return sum_sq

    return row_sum_sq_words


@functools.cache
def make_write_row_words(weight, hf):
    """Device function: this thread's words of bf16 word row x[t, :], normalized and scaled, in
    place (pass 2); `weight` is the weight's `Table` (bf16 words or float32), `hf` the rounding order."""
    load_w = weight.pair
    normed = make_word_normed(hf)

    @cuda.jit(device=True)
    def write_row_words(x, w, t, rstd, weight_offset):
        row = np.uint32(t)
        for u in range(np.uint32(cuda.threadIdx.x), np.uint32(x.shape[1]), np.uint32(cuda.blockDim.x)):
            lo, hi = bf16x2_decode(x[row, u])
            w_lo, w_hi = load_w(w, u)
            x[row, u] = bf16x2_encode(normed(lo, w_lo, rstd, weight_offset), normed(hi, w_hi, rstd, weight_offset))

    return write_row_words


@functools.cache
def make_cross_head_norm_kernel_v2(weight, hf):
    """v2: v1's kernel on bf16 rows viewed as int32 words `[T, hidden / 2]`, built per weight
    storage (`Table`) and rounding order."""
    row_sum_sq = make_row_sum_sq_words()
    write_row = make_write_row_words(weight, hf)

    @cuda.jit
    def cross_head_norm_kernel_v2(q, k, q_w, k_w, eps, weight_offset):
        t = np.uint32(cuda.blockIdx.x)
        is_q = cuda.blockIdx.y == 0  # uniform over the block
        # Every thread reaches block_sum (it holds barriers): no early return.
        if is_q:
            sum_sq = row_sum_sq(q, t)
            hidden = q.shape[1] * 2
        else:
            sum_sq = row_sum_sq(k, t)
            hidden = k.shape[1] * 2
        rstd = rstd_from(block_sum(sum_sq), np.float32(hidden), eps)
        if is_q:
            write_row(q, q_w, t, rstd, weight_offset)
        else:
            write_row(k, k_w, t, rstd, weight_offset)

    return cross_head_norm_kernel_v2


def threads_for_words(words: int) -> int:
    """Whole warps, at least WORDS_PER_LANE words (16 bytes) each, at most MAX_THREADS."""
    warps = -(-words // (WORDS_PER_LANE * WARP_SIZE))
    return min(MAX_THREADS, warps * WARP_SIZE)


def cross_head_norm_v2(q, k, q_weight, k_weight, eps, weight_offset, rounding):
    """v2, in place on checked `[T, hidden]` tensors (one dtype and device); returns nothing.
    Runs v1 where the word path cannot apply (`word_views`)."""
    q_weight, k_weight = same_weight_storage(q_weight, k_weight)
    words = word_views(q, k, q_weight, k_weight)
    if words is None:
        cross_head_norm(q, k, q_weight, k_weight, eps, weight_offset, rounding)
        return
    tokens = q.shape[0]
    if tokens == 0:
        return
    kernel = make_cross_head_norm_kernel_v2(TABLE_OF[q_weight.dtype], rounding == "hf")
    threads = threads_for_words(max(words[0].shape[1], words[1].shape[1]))
    launch(kernel, (tokens, NUM_TENSORS), threads, words, (np.float32(eps), np.float32(weight_offset)))

