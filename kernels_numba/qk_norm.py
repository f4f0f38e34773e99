"""Numba kernels of `qk_norm`: v1 (below) and v2 give each (token, head) row a warp; v3 reads bf16
rows as 32-bit words on lanes sized to the head (see its factory). q and k in one launch.

Mapping. grid.x: blocks of WARPS_PER_BLOCK warps; one warp per (token, head) row; row r < T*Hq
is q (token r // Hq, head r % Hq), else k (the same with r - T*Hq and Hk). Lane l of a warp
reads elements l, l + 32, l + 64, ... of its row, so the warp's 32 loads are neighbours in memory
(coalesced). Two passes over the row:

1. each lane adds up x^2 of its elements in float32; `warp_sum` gives every lane the row's
   sum_sq; rstd = rsqrt(sum_sq / D + eps), or 0 where sum_sq / D + eps == 0 (eps=0 zero rows
   stay 0, not NaN), or NaN where it is NaN or +Inf (`rstd_from`: the whole row NaN);
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

from kernels_numba.helpers import (CODEC_OF, MAX_THREADS_PER_BLOCK, TABLE_OF, WARP_SIZE, bf16x2_decode, bf16x2_encode,
                                   contiguous_row, lane_group_sum, launch, make_word_normed, q_rows_first, row_lanes,
                                   rstd_from, rstd_from_mean, same_weight_storage, warp_row, warp_sum, word_views)

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


# --------------------------------------------------------------------------------------------
# v3: bf16 rows as 32-bit words, lanes sized to the head
# --------------------------------------------------------------------------------------------
def v3_row_lanes(head_dim):
    """v3's lanes per row (`row_lanes`, as qk_norm_rope's v3), or None where the head is not a whole
    number of them or they would not tile a warp (the lane-group sum needs a power of two)."""
    lanes = row_lanes(head_dim)
    return lanes if lanes >= 1 and WARP_SIZE % lanes == 0 and head_dim % (2 * lanes) == 0 else None


@functools.cache
def make_qk_norm_kernel_v3(weight, hf, head_dim):
    """v3: v2's algorithm on bf16 rows viewed as int32 words `[T, H, D/2]` (word u holds columns
    2u and 2u + 1; `bf16x2_decode`/`bf16x2_encode` turn it into two float32 and back), one load
    and one store per two columns, as qk_norm_rope's Numba v3 does.

    grid.x: token t; grid.y: groups of that token's heads (q's, then k's), so no division finds
    a row's token and head. A row has ROW_LANES lanes (16 at head_dim 128, a warp from 256 on),
    so a warp holds 32 / ROW_LANES rows and issues the per-row work (the row's address, the
    lane-group sum, rstd) once for all of them; lane l owns words l, l + ROW_LANES, ... (WORD_SLOTS
    of them). The rounding order and the weights' storage (bf16 words or float32) are fixed at
    build time, and indices start from unsigned 32-bit ids, so the kernel holds one straight path.
    What it removes from v2: a warp per row (4 elements per lane at head_dim 128, each its own
    2-byte load, the warp's 5-step shuffle sum per row) and v2's signed 64-bit index arithmetic."""
    ROW_LANES = v3_row_lanes(head_dim)
    assert ROW_LANES is not None, f"v3 needs a head_dim of whole 16-byte lane slices that tile a warp, not {head_dim}"
    WORD_SLOTS = head_dim // (2 * ROW_LANES)
    load_w = weight.pair
    normed = make_word_normed(hf)  # x * rstd * (w + weight_offset): rounded by the store, or in the HF order

    @cuda.jit
    def qk_norm_kernel_v3(q, k, q_w, k_w, eps, weight_offset, inv_head_dim):
        tid = np.uint32(cuda.threadIdx.x)
        lane = tid % ROW_LANES
        t = np.uint32(cuda.blockIdx.x)
        head = np.uint32(cuda.blockIdx.y) * (np.uint32(cuda.blockDim.x) // ROW_LANES) + tid // ROW_LANES
        q_heads, k_heads = q.shape[1], k.shape[1]
        active = head < q_heads + k_heads  # rows past the last head keep a dummy row and store nothing
        x, w = contiguous_row(q, t, 0), q_w
        if head < q_heads:
            x = contiguous_row(q, t, head)
        elif active:
            x, w = contiguous_row(k, t, head - q_heads), k_w

        lo = cuda.local.array(WORD_SLOTS, np.float32)  # this lane's words, as float32 pairs
        hi = cuda.local.array(WORD_SLOTS, np.float32)
        sum_sq = np.float32(0.0)
        for j in range(WORD_SLOTS):
            lo[j] = hi[j] = np.float32(0.0)
            if active:
                lo[j], hi[j] = bf16x2_decode(x[lane + j * ROW_LANES])
            sum_sq += lo[j] * lo[j]
            sum_sq += hi[j] * hi[j]
        # every thread gets here (no early return); 1 / head_dim comes from the host: no division
        rstd = rstd_from_mean(lane_group_sum(sum_sq, ROW_LANES) * inv_head_dim, eps)
        if active:
            for j in range(WORD_SLOTS):
                c = lane + j * ROW_LANES
                w_lo, w_hi = load_w(w, c)
                x[c] = bf16x2_encode(normed(lo[j], w_lo, rstd, weight_offset), normed(hi[j], w_hi, rstd, weight_offset))

    return qk_norm_kernel_v3


def qk_norm_v3(q, k, q_weight, k_weight, eps, weight_offset, rounding):
    """v3, in place on checked `[T, H, D]` tensors (one dtype and device); returns nothing.

    Runs v2 instead where the word path cannot apply: activations not bf16, a head_dim whose
    16-byte lane slices do not tile a warp (`v3_row_lanes`), or a bf16 q, k or weight with no
    int32 view (an odd storage offset or stride, e.g. a fused-qkv view at an odd column)."""
    q, k, q_weight, k_weight = q_rows_first(q, k, q_weight, k_weight)
    q_weight, k_weight = same_weight_storage(q_weight, k_weight)
    head_dim = q.shape[2]
    words = word_views(q, k, q_weight, k_weight)
    if words is None or v3_row_lanes(head_dim) is None:
        qk_norm_v2(q, k, q_weight, k_weight, eps, weight_offset, rounding)
        return
    tokens, heads = q.shape[0], q.shape[1] + k.shape[1]
    if tokens * heads == 0:
        return
    kernel = make_qk_norm_kernel_v3(TABLE_OF[q_weight.dtype], rounding == "hf", head_dim)
    lanes = v3_row_lanes(head_dim)
    # THREADS per block, fewer where a token has fewer heads (a tiny launch keeps its block small)
    threads = min(THREADS, -(-heads * lanes // WARP_SIZE) * WARP_SIZE)
    head_groups = -(-heads // (threads // lanes))
    scalars = (np.float32(eps), np.float32(weight_offset), np.float32(1.0 / head_dim))
    launch(kernel, (tokens, head_groups), threads, words, scalars)


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
    q, k, q_weight, k_weight = q_rows_first(q, k, q_weight, k_weight)
    q_weight, k_weight = same_weight_storage(q_weight, k_weight)
    kernel = factory(CODEC_OF[q.dtype], CODEC_OF[q_weight.dtype], *specialization)
    warps = min(WARPS_PER_BLOCK, rows)  # a tiny launch keeps its block small (and the simulator quick)
    blocks = -(-rows // warps)
    scalars = (np.float32(eps), np.float32(weight_offset), rounding == "hf")
    launch(kernel, blocks, warps * WARP_SIZE, (q, k, q_weight, k_weight), scalars)
