"""Numba kernel of `qk_norm` (v1): one warp per (token, head) row, q and k in one launch.

Mapping. grid.x: blocks of WARPS_PER_BLOCK warps; one warp per (token, head) row; row r < T*Hq
is q (token r // Hq, head r % Hq), else k (the same with r - T*Hq and Hk). Lane l of a warp
reads elements l, l + 32, l + 64, ... of its row, so the warp's 32 loads are neighbours in memory
(coalesced). Two passes over the row:

1. each lane adds up x^2 of its elements in float32; `warp_sum` gives every lane the row's
   sum_sq; rstd = rsqrt(sum_sq / D + eps), or 0 where sum_sq / D + eps == 0 (eps=0 zero rows
   stay 0, not NaN);
2. each lane reads its elements again and writes y = x * rstd * (w + weight_offset), rounded
   once (rounding="fused"), or in the Hugging Face order (rounding="hf"):
   n = round(x * rstd), y = round(n * round(w + weight_offset)).

What v1 leaves on the table: each lane has one narrow (2- or 4-byte) load in flight at a time and
reads its row twice, so the kernel waits on memory latency rather than bandwidth.

`cookbook.ops.qk_norm.rms_norm_rows` is the specification; the storage codecs of
`kernels_numba.helpers` keep the kernel source the same for float32, float16 and bfloat16.
"""

from kernels_numba import _compat  # noqa: F401  (before Numba compiles anything)

import functools

import numpy as np
from numba import cuda

from kernels_numba.helpers import CODEC_OF, MAX_THREADS_PER_BLOCK, WARP_SIZE, launch, rstd_from, warp_row, warp_sum

WARPS_PER_BLOCK = 4  # rows per block
THREADS = WARP_SIZE * WARPS_PER_BLOCK
assert THREADS <= MAX_THREADS_PER_BLOCK, "a block holds at most 1024 threads"

@functools.cache
def make_qk_norm_kernel(act, weight):
    """The kernel for activations stored with codec `act` and weights stored with codec `weight`.

    Built once per pair of codecs (cached); Numba then compiles it on first launch for the
    argument types it sees (contiguous or strided q and k).
    """
    load, store, round_to = act.decode, act.encode, act.round_to
    load_w = weight.decode

    @cuda.jit(device=True)
    def row_sum_sq(x, lane):
        """This lane's share of sum(x^2) over the row x: elements lane, lane + 32, ..."""
        sum_sq = np.float32(0.0)
        for d in range(lane, x.shape[0], WARP_SIZE):
            xd = load(x[d])
            sum_sq += xd * xd
        return sum_sq

    @cuda.jit(device=True)
    def write_row(x, w, lane, rstd, weight_offset, hf):
        """Pass 2: this lane's elements of the row x, normalized and scaled, in place."""
        for d in range(lane, x.shape[0], WARP_SIZE):
            normed = load(x[d]) * rstd
            w_eff = load_w(w[d]) + weight_offset
            if hf:  # Hugging Face order: round the normalized value and the weight first
                x[d] = store(round_to(normed) * round_to(w_eff))
            else:  # fused: one rounding at the end
                x[d] = store(normed * w_eff)

    @cuda.jit
    def qk_norm_kernel(q, k, q_w, k_w, eps, weight_offset, hf):
        lane, row, q_rows, is_q, is_k = warp_row(q, k)
        q_heads, head_dim = q.shape[1], q.shape[2]
        k_heads = k.shape[1]
        t = h = 0  # this warp's (token, head), found once: integer division is slow on a GPU
        if is_q:
            t, h = row // q_heads, row % q_heads
        elif is_k:
            t, h = (row - q_rows) // k_heads, (row - q_rows) % k_heads

        # No early return for warps past the last row: every thread must reach warp_sum.
        sum_sq = np.float32(0.0)
        if is_q:
            sum_sq = row_sum_sq(q[t, h], lane)
        elif is_k:
            sum_sq = row_sum_sq(k[t, h], lane)
        rstd = rstd_from(warp_sum(sum_sq), np.float32(head_dim), eps)

        if is_q:
            write_row(q[t, h], q_w, lane, rstd, weight_offset, hf)
        elif is_k:
            write_row(k[t, h], k_w, lane, rstd, weight_offset, hf)

    return qk_norm_kernel


@functools.cache
def make_qk_norm_kernel_v2(act, weight, head_dim):
    """v2: head_dim fixed when the kernel is built, so each lane's ELEMS elements live in a
    local array the compiler keeps in registers (every index is a constant once the loops are
    unrolled). The row is read once, and the unrolled loads are all in flight together."""
    assert head_dim % WARP_SIZE == 0, "v2 covers head_dims that are a multiple of 32"
    ELEMS = head_dim // WARP_SIZE  # elements per lane: lane, lane + 32, ...
    load, store, round_to = act.decode, act.encode, act.round_to
    load_w = weight.decode

    @cuda.jit
    def qk_norm_kernel_v2(q, k, q_w, k_w, eps, weight_offset, hf):
        lane, row, q_rows, is_q, is_k = warp_row(q, k)
        q_heads, k_heads = q.shape[1], k.shape[1]
        x = q[0, 0]  # this warp's row; warps past the last row keep a dummy and store nothing
        w = q_w
        if is_q:
            x = q[row // q_heads, row % q_heads]
        elif is_k:
            x = k[(row - q_rows) // k_heads, (row - q_rows) % k_heads]
            w = k_w
        active = is_q or is_k

        xs = cuda.local.array(ELEMS, np.float32)
        sum_sq = np.float32(0.0)
        for i in range(ELEMS):
            xs[i] = load(x[lane + i * WARP_SIZE]) if active else np.float32(0.0)
            sum_sq += xs[i] * xs[i]
        rstd = rstd_from(warp_sum(sum_sq), np.float32(head_dim), eps)  # every thread gets here (no early return)
        if active:
            for i in range(ELEMS):
                d = lane + i * WARP_SIZE
                normed = xs[i] * rstd
                w_eff = load_w(w[d]) + weight_offset
                if hf:
                    x[d] = store(round_to(normed) * round_to(w_eff))
                else:
                    x[d] = store(normed * w_eff)

    return qk_norm_kernel_v2


def qk_norm_v2(q, k, q_weight, k_weight, eps, weight_offset, rounding):
    """v2 where head_dim is a multiple of 32; other head_dims take v1 (the general path)."""
    if q.shape[2] % WARP_SIZE:
        return qk_norm(q, k, q_weight, k_weight, eps, weight_offset, rounding)
    _launch(make_qk_norm_kernel_v2, (q.shape[2],), q, k, q_weight, k_weight, eps, weight_offset, rounding)


def qk_norm(q, k, q_weight, k_weight, eps, weight_offset, rounding):
    """v1, in place on checked `[T, H, D]` tensors (one dtype and device); returns nothing."""
    _launch(make_qk_norm_kernel, (), q, k, q_weight, k_weight, eps, weight_offset, rounding)


def _launch(factory, specialization, q, k, q_weight, k_weight, eps, weight_offset, rounding):
    """One warp per (token, head) row, WARPS_PER_BLOCK rows per block."""
    rows = q.shape[0] * (q.shape[1] + k.shape[1])
    if rows == 0:
        return
    if q_weight.dtype != k_weight.dtype:  # one in the activation dtype, one float32: rare
        q_weight, k_weight = q_weight.float(), k_weight.float()
    kernel = factory(CODEC_OF[q.dtype], CODEC_OF[q_weight.dtype], *specialization)
    warps = min(WARPS_PER_BLOCK, rows)  # a tiny launch keeps its block small (and the simulator quick)
    blocks = -(-rows // warps)
    scalars = (np.float32(eps), np.float32(weight_offset), rounding == "hf")
    launch(kernel, blocks, warps * WARP_SIZE, (q, k, q_weight, k_weight), scalars)
