"""Numba kernel of `cross_head_norm` (v1): one block per (token, tensor), q and k on blockIdx.y.

Mapping. grid = (tokens, 2): blockIdx.x is the token, blockIdx.y picks the tensor (0: q, 1: k),
so q and k rows of different widths (q_hidden != k_hidden) run in one launch. A row is the whole
hidden (thousands of elements), too long for one warp: thread t of the block reads elements
t, t + blockDim.x, t + 2 * blockDim.x, ... (neighbouring threads read neighbouring elements:
coalesced). Two passes over the row:

1. each thread adds up x^2 of its elements in float32; `block_sum` gives every thread the row's
   sum_sq; rstd = rsqrt(sum_sq / H + eps), or 0 where sum_sq / H + eps == 0 (eps=0 zero rows
   stay 0, not NaN);
2. each thread reads its elements again and writes y = x * rstd * (w + weight_offset), rounded
   once (rounding="fused"), or in the Hugging Face order (rounding="hf"):
   n = round(x * rstd), y = round(n * round(w + weight_offset)).

`cookbook.ops.cross_head_norm` is the specification; the storage codecs of
`kernels_numba.helpers` keep the kernel source the same for float32, float16 and bfloat16. The
launch (torch stream on a GPU; copies under the simulator) is `helpers.launch`.
"""

from kernels_numba import _compat  # noqa: F401  (before Numba compiles anything)

import functools

import numpy as np
from numba import cuda

from kernels_numba.helpers import CODEC_OF, MAX_THREADS_PER_BLOCK, WARP_SIZE, block_sum, launch, rstd_from

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
