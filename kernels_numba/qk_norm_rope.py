"""Numba kernels of `qk_norm_rope`: lanes per (token, head) row, norm then rope, one pass.

v1 (`qk_norm_rope`, below) keeps the CUDA C v1-v3 mapping: lane l owns columns l, l + 32, ...
and fetches each rotation partner from the lane that holds it. v2 (`qk_norm_rope_v2`) lets lanes
own whole pairs instead (no partner shuffles, cos/sin read once per pair); see its factory.
v3 (`qk_norm_rope_v3`) runs v2's algorithm on bf16 rows read and written as 32-bit words (two
columns per load and store), a row on part of a warp, with far fewer instructions around each
element; see its factory. v1 and v2 give each row a whole warp.

v1 mapping. grid.x: blocks of WARPS_PER_BLOCK warps; one warp per (token, head) row, numbered as
in `kernels_numba.qk_norm` (q rows first, then k rows). Lane l owns the elements of slots
j = 0, 1, ...: column c = l + 32 j (neighbouring lanes, neighbouring memory: coalesced).

1. each lane reads its elements once into a local array, adds up x^2 in float32; `warp_sum`
   gives every lane the row's sum_sq; rstd = rsqrt(sum_sq / D + eps) (0 where that is 0, NaN
   where it is NaN or +Inf: `rstd_from`);
2. each lane normalizes its elements in place: n = x * rstd * (w + weight_offset) (float32,
   unrounded for rounding="fused"; qk_norm's Hugging Face order for "hf");
3. the rotation of column c < rope_dim needs its partner's n, which another lane holds:
   interleaved, column c ^ 1 = lane l ^ 1, same slot; NeoX, column c +- rope_dim/2, which is
   `shift = (rope_dim/2) % 32` lanes away and `(rope_dim/2) // 32` slots away (one more when the
   lane index wraps around the warp). `warp_shfl` fetches it: a shuffle sends the same slot from
   every lane, so the four slots a NeoX lane may need are each shuffled once per slot and every
   lane keeps the one it needs;
4. each lane writes a' = a cos - b sin (first member of its pair) or b' = b cos + a sin (second
   member), or n for the pass-through columns, rounded once (or in the HF order).

cos/sin come from the token's cache row p = positions[t] + position_offset; an out-of-range p
reads nothing and uses NaN (the contract's policy). `cookbook.ops.qk_norm_rope` is the
specification.
"""

from kernels_numba import _compat  # noqa: F401  (before Numba compiles anything)

import functools
import math

import numpy as np
from numba import cuda

# FLOAT_TABLE and WORD_TABLE are re-exported for tools/numba_ptx.py.
from kernels_numba.helpers import (CODEC_OF, FLOAT_TABLE, MAX_THREADS_PER_BLOCK, TABLE_OF, WARP_SIZE,  # noqa: F401
                                   WORD_TABLE, bf16_round_to, bf16x2_decode, bf16x2_encode, contiguous_row,
                                   lane_group_sum, launch, q_rows_first, row_lanes, rstd_from, rstd_from_mean,
                                   same_weight_storage, warp_row, warp_shfl, warp_sum, word_views)

WARPS_PER_BLOCK = 4  # rows per block
THREADS = WARP_SIZE * WARPS_PER_BLOCK
assert THREADS <= MAX_THREADS_PER_BLOCK, "a block holds at most 1024 threads"
MAX_HEAD_DIM = 1024  # the contract's limit
MAX_SLOTS = MAX_HEAD_DIM // WARP_SIZE  # elements a lane holds for the widest head



@functools.cache
def make_qk_norm_rope_kernel(act, weight, cache):
    """The kernel for activations, weights and the cos/sin cache stored with these codecs."""
    load, store, round_to = act.decode, act.encode, act.round_to
    load_w, load_c = weight.decode, cache.decode

    @cuda.jit(device=True)
    def read_row(x, t, h, lane, n):
        """Pass 1: this lane's elements of row x[t, h, :] into `n` (float32); its share of sum(x^2)."""
        sum_sq = np.float32(0.0)
        for j in range((x.shape[2] - lane + WARP_SIZE - 1) // WARP_SIZE):
            xd = load(x[t, h, lane + j * WARP_SIZE])
            n[j] = xd
            sum_sq += xd * xd
        return sum_sq

    @cuda.jit(device=True)
    def normalize_row(n, w, lane, head_dim, rstd, weight_offset, hf):
        """n = x * rstd * (w + weight_offset), in place: unrounded (fused) or in the HF order."""
        for j in range((head_dim - lane + WARP_SIZE - 1) // WARP_SIZE):
            normed = n[j] * rstd
            w_eff = load_w(w[lane + j * WARP_SIZE]) + weight_offset
            if hf:
                n[j] = round_to(round_to(normed) * round_to(w_eff))
            else:
                n[j] = normed * w_eff

    @cuda.jit(device=True)
    def slot_value(n, s, slots):
        """n[s] for a slot this lane may not own (0 outside the row: never used)."""
        if 0 <= s < slots:
            return n[s]
        return np.float32(0.0)

    @cuda.jit
    def qk_norm_rope_kernel(q, k, q_w, k_w, cos_sin_cache, positions, eps, weight_offset, hf, is_neox, rope_dim,
                            position_offset):
        lane, row, q_rows, is_q, is_k = warp_row(q, k)
        q_heads, head_dim = q.shape[1], q.shape[2]
        k_heads = k.shape[1]
        k_row = row - q_rows
        t = 0  # warps past the last row (k may have no heads: no division by zero)
        if is_q:
            t = row // q_heads
        elif is_k:
            t = k_row // k_heads

        # No early return for warps past the last row: every thread must reach the shuffles.
        n = cuda.local.array(MAX_SLOTS, np.float32)
        sum_sq = np.float32(0.0)
        if is_q:
            sum_sq = read_row(q, t, row % q_heads, lane, n)
        elif is_k:
            sum_sq = read_row(k, t, k_row % k_heads, lane, n)
        rstd = rstd_from(warp_sum(sum_sq), np.float32(head_dim), eps)
        if is_q:
            normalize_row(n, q_w, lane, head_dim, rstd, weight_offset, hf)
        elif is_k:
            normalize_row(n, k_w, lane, head_dim, rstd, weight_offset, hf)

        # This token's cache row, or -1 when out of range (then cos = sin = NaN).
        max_position = cos_sin_cache.shape[0]
        cache_row = -1
        if is_q or is_k:
            p = np.int64(positions[t]) + position_offset
            if 0 <= p < max_position:
                cache_row = p

        half = rope_dim // 2
        slot_shift, lane_shift = half // WARP_SIZE, half % WARP_SIZE
        slots = (head_dim + WARP_SIZE - 1) // WARP_SIZE  # uniform over the warp: shuffles stay convergent
        for j in range(slots):
            c = lane + j * WARP_SIZE
            # The partner's value, by shuffles every lane of the warp makes together.
            if is_neox:
                ahead = warp_shfl(slot_value(n, j + slot_shift, slots), (lane + lane_shift) % WARP_SIZE)
                ahead_wrap = warp_shfl(slot_value(n, j + slot_shift + 1, slots), (lane + lane_shift) % WARP_SIZE)
                behind = warp_shfl(slot_value(n, j - slot_shift, slots), (lane - lane_shift) % WARP_SIZE)
                behind_wrap = warp_shfl(slot_value(n, j - slot_shift - 1, slots), (lane - lane_shift) % WARP_SIZE)
                is_first = c < half
                if is_first:
                    partner = ahead_wrap if lane + lane_shift >= WARP_SIZE else ahead
                else:
                    partner = behind_wrap if lane - lane_shift < 0 else behind
                pair = c if is_first else c - half
            else:
                partner = warp_shfl(slot_value(n, j, slots), lane ^ 1)
                is_first = c % 2 == 0
                pair = c // 2
            if (is_q or is_k) and c < head_dim:
                y = n[j]
                if c < rope_dim:
                    cos = np.float32(math.nan)
                    sin = np.float32(math.nan)
                    if cache_row >= 0:
                        cos = load_c(cos_sin_cache[cache_row, pair])
                        sin = load_c(cos_sin_cache[cache_row, half + pair])
                    signed_sin = -sin if is_first else sin
                    if hf:  # Hugging Face order: cos/sin, both products and the sum rounded
                        y = round_to(round_to(y * round_to(cos)) + round_to(partner * round_to(signed_sin)))
                    else:
                        y = y * cos + partner * signed_sin
                if is_q:
                    q[t, row % q_heads, c] = store(y)
                else:
                    k[t, k_row % k_heads, c] = store(y)

    return qk_norm_rope_kernel


MIN_SLOT_HEAD_DIM = 2 * WARP_SIZE  # v2 sizes its registers for a head_dim bucket of at least one pair per lane


def head_dim_bucket(head_dim):
    """v2's build-time size for `head_dim`: the next power of two, at least MIN_SLOT_HEAD_DIM.
    The common head dims (64 to 512) are their own bucket; others share the next one up, so a
    handful of kernels cover every head_dim and each is compiled once."""
    return max(MIN_SLOT_HEAD_DIM, 1 << (head_dim - 1).bit_length())


@functools.cache
def make_qk_norm_rope_kernel_v2(act, weight, cache, max_head_dim):
    """v2: lanes own whole rotation pairs, as the CUDA C kernels from v2 on do.

    Pair i = lane + 32 j (j < PAIR_SLOTS) is columns (i, i + rope_dim/2) (NeoX) or (2i, 2i + 1)
    (interleaved); a lane reads both members and cos_i, sin_i once, so no shuffle fetches a
    partner and each cos/sin element is read once per row, not once per member. Pass-through
    column c = rope_dim + lane + 32 j (j < PASS_SLOTS) is read and normalized as in qk_norm.

    The slot counts are fixed at build time from `max_head_dim` (a bucket, see head_dim_bucket):
    every loop has a constant trip count, so the local arrays live in registers once unrolled;
    slots past the row's head_dim or rope_dim are masked off, with head_dim, rope_dim and the
    layout runtime values."""
    PAIR_SLOTS = max_head_dim // (2 * WARP_SIZE)  # pairs a lane may own (full rope)
    PASS_SLOTS = max_head_dim // WARP_SIZE  # pass-through columns a lane may own (rope_dim = 2)
    load, store, round_to = act.decode, act.encode, act.round_to
    load_w, load_c = weight.decode, cache.decode

    @cuda.jit(device=True)
    def pair_columns(i, half, is_neox):
        """The two columns of rotation pair i."""
        if is_neox:
            return i, i + half
        return 2 * i, 2 * i + 1

    @cuda.jit(device=True)
    def normed(v, w_elem, rstd, weight_offset, hf):
        """n = x * rstd * (w + weight_offset): unrounded (fused) or in the HF order."""
        w_eff = load_w(w_elem) + weight_offset
        if hf:
            return round_to(round_to(v * rstd) * round_to(w_eff))
        return v * rstd * w_eff

    @cuda.jit(device=True)
    def rotated(own, partner, cos, signed_sin, hf):
        """own * cos + partner * signed_sin: unrounded (fused) or each step rounded (HF order)."""
        if hf:
            return round_to(round_to(own * round_to(cos)) + round_to(partner * round_to(signed_sin)))
        return own * cos + partner * signed_sin

    @cuda.jit
    def qk_norm_rope_kernel_v2(q, k, q_w, k_w, cos_sin_cache, positions, eps, weight_offset, hf, is_neox, rope_dim,
                               position_offset):
        lane, row, q_rows, is_q, is_k = warp_row(q, k)
        q_heads, head_dim = q.shape[1], q.shape[2]
        k_heads = k.shape[1]
        t = 0
        x = q[0, 0]  # this warp's row; warps past the last row keep a dummy and store nothing
        w = q_w
        if is_q:
            t = row // q_heads
            x = q[t, row % q_heads]
        elif is_k:
            t = (row - q_rows) // k_heads
            x = k[t, (row - q_rows) % k_heads]
            w = k_w
        active = is_q or is_k
        half = rope_dim // 2

        # This token's cache row, or -1 when out of range (then cos = sin = NaN).
        cache_row = -1
        if active:
            p = np.int64(positions[t]) + position_offset
            if 0 <= p < cos_sin_cache.shape[0]:
                cache_row = p

        # 1. Read: both members of each pair, its cos and sin, and the pass-through columns; every
        #    load is issued before the reduction waits on any of them.
        a = cuda.local.array(PAIR_SLOTS, np.float32)
        b = cuda.local.array(PAIR_SLOTS, np.float32)
        cos = cuda.local.array(PAIR_SLOTS, np.float32)
        sin = cuda.local.array(PAIR_SLOTS, np.float32)
        rest = cuda.local.array(PASS_SLOTS, np.float32)
        sum_sq = np.float32(0.0)
        for j in range(PAIR_SLOTS):
            i = lane + j * WARP_SIZE
            a[j] = b[j] = np.float32(0.0)
            cos[j] = sin[j] = np.float32(math.nan)
            if active and i < half:
                col_a, col_b = pair_columns(i, half, is_neox)
                a[j] = load(x[col_a])
                b[j] = load(x[col_b])
                if cache_row >= 0:
                    cos[j] = load_c(cos_sin_cache[cache_row, i])
                    sin[j] = load_c(cos_sin_cache[cache_row, half + i])
            sum_sq += a[j] * a[j] + b[j] * b[j]
        for j in range(PASS_SLOTS):
            c = rope_dim + lane + j * WARP_SIZE
            rest[j] = load(x[c]) if active and c < head_dim else np.float32(0.0)
            sum_sq += rest[j] * rest[j]
        rstd = rstd_from(warp_sum(sum_sq), np.float32(head_dim), eps)  # every thread gets here (no early return)

        # 2. Normalize, rotate each pair in registers, write.
        if active:
            for j in range(PAIR_SLOTS):
                i = lane + j * WARP_SIZE
                if i < half:
                    col_a, col_b = pair_columns(i, half, is_neox)
                    na = normed(a[j], w[col_a], rstd, weight_offset, hf)
                    nb = normed(b[j], w[col_b], rstd, weight_offset, hf)
                    x[col_a] = store(rotated(na, nb, cos[j], -sin[j], hf))  # a' = a cos - b sin
                    x[col_b] = store(rotated(nb, na, cos[j], sin[j], hf))  # b' = b cos + a sin
            for j in range(PASS_SLOTS):
                c = rope_dim + lane + j * WARP_SIZE
                if c < head_dim:
                    x[c] = store(normed(rest[j], w[c], rstd, weight_offset, hf))

    return qk_norm_rope_kernel_v2


def qk_norm_rope_v2(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox,
                    rope_dim, position_offset):
    """v2, in place on checked `[T, H, D]` tensors (one dtype and device); returns nothing."""
    _launch(make_qk_norm_rope_kernel_v2, (head_dim_bucket(q.shape[2]),), q, k, q_weight, k_weight, cos_sin_cache,
            positions, eps, weight_offset, rounding, is_neox, rope_dim, position_offset)


# --------------------------------------------------------------------------------------------
# v3: bf16 rows as 32-bit words
# --------------------------------------------------------------------------------------------
# The weights and the cos/sin cache are read as bf16 words or float32 (helpers' `Table`s), and a
# row gets helpers' `row_lanes` lanes.


@functools.cache
def make_qk_norm_rope_kernel_v3(weight, cache, is_neox, hf, max_head_dim):
    """v3: v2 on 32-bit words, with lanes sized to the head. Rows are int32 views `[T, H, D/2]`
    of bf16 q and k: word u holds columns 2u (low 16 bits) and 2u + 1 (high 16 bits); one load
    and one store move two columns, `bf16x2_decode`/`bf16x2_encode` turn a word into two float32
    and back.

    grid.x: token t; grid.y: groups of heads of that token (q's heads, then k's), so no division
    finds a row's token and head. A row has ROW_LANES lanes (`row_lanes`: 16 at head_dim 128, a
    warp from 256 on), so a warp holds 32 / ROW_LANES rows and issues each instruction of the
    per-row work (ids, the sum's reduction, rstd, the cache row) once for all of them. Lane l of
    a row owns words c = l + ROW_LANES j (j < WORD_SLOTS, a build-time count for the head_dim
    bucket, masked at head_dim):
    * interleaved: rotation pair c is exactly word c (c < rope_dim / 2): cos_c and sin_c are
      elements c and rope_dim / 2 + c of the cache row;
    * NeoX (rope_dim % 4 == 0): word c < rope_dim / 4 holds columns 2c, 2c + 1 and word
      c + rope_dim / 4 their partners 2c + rope_dim / 2, 2c + 1 + rope_dim / 2: the lane takes
      both words, two rotation pairs, with cos at 2c, 2c + 1 (cache word c) and sin at
      rope_dim / 2 + 2c, + 1 (cache word rope_dim / 4 + c); the partner word's own lane skips it;
    * words from rope_dim / 2 on pass through, normalized.

    The layout (is_neox), the rounding (hf) and the tables' storage are fixed at build time, so
    the kernel holds one path. Index arithmetic starts from unsigned 32-bit ids, so the compiler
    can see every index is >= 0 and drops Python's negative-index wraparound from each access;
    `contiguous_row` lets it fold each slot's offset into the load and store. An out-of-range
    position normalizes its rotated words with rstd = NaN (the contract's NaN, no branch per
    element) and reads cache row 0 instead."""
    ROW_LANES = row_lanes(max_head_dim)
    WORD_SLOTS = max_head_dim // (2 * ROW_LANES)
    # Slots that may hold a word whose lane rotates it: NeoX's lead words are < rope_dim / 4.
    LEAD_SLOTS = -(-max_head_dim // (4 * ROW_LANES)) if is_neox else WORD_SLOTS
    round_to = bf16_round_to
    load_w, load_c = weight.pair, cache.pair
    load_c_element = cache.element

    @cuda.jit(device=True)
    def normed(v, w, rstd, weight_offset):
        """n = x * rstd * (w + weight_offset): unrounded (fused) or in the HF order."""
        if hf:
            return round_to(round_to(v * rstd) * round_to(w + weight_offset))
        return v * rstd * (w + weight_offset)

    @cuda.jit(device=True)
    def rotated(own, partner, cos, signed_sin):
        """own * cos + partner * signed_sin: unrounded (fused) or each step rounded (HF order)."""
        if hf:
            return round_to(round_to(own * round_to(cos)) + round_to(partner * round_to(signed_sin)))
        return own * cos + partner * signed_sin

    @cuda.jit
    def qk_norm_rope_kernel_v3(q, k, q_w, k_w, cos_sin_cache, positions, eps, weight_offset, rope_dim,
                               position_offset, inv_head_dim):
        tid = np.uint32(cuda.threadIdx.x)
        lane = tid % ROW_LANES
        t = np.uint32(cuda.blockIdx.x)
        head = np.uint32(cuda.blockIdx.y) * (np.uint32(cuda.blockDim.x) // ROW_LANES) + tid // ROW_LANES
        q_heads, k_heads = q.shape[1], k.shape[1]
        active = head < q_heads + k_heads  # rows past the last head keep a dummy row, store nothing
        x, w = contiguous_row(q, t, 0), q_w
        if head < q_heads:
            x = contiguous_row(q, t, head)
        elif active:
            x, w = contiguous_row(k, t, head - q_heads), k_w
        row_words = q.shape[2]
        rope_words = np.uint32(rope_dim) // 2
        quarter = rope_words // 2  # NeoX: word c < quarter pairs with word c + quarter
        lead_words = quarter if is_neox else rope_words  # rotated words whose lane rotates them

        # 1. Read this lane's words, NeoX partners too, and add up x^2.
        lo = cuda.local.array(WORD_SLOTS, np.float32)
        hi = cuda.local.array(WORD_SLOTS, np.float32)
        partner_lo = cuda.local.array(LEAD_SLOTS, np.float32)
        partner_hi = cuda.local.array(LEAD_SLOTS, np.float32)
        sum_sq = np.float32(0.0)
        for j in range(WORD_SLOTS):
            c = lane + j * ROW_LANES
            # this lane's words: a lead word (rotated here, NeoX with its partner) or a pass-through one
            if active and c < row_words and ((j < LEAD_SLOTS and c < lead_words) or c >= rope_words):
                lo[j], hi[j] = bf16x2_decode(x[c])
                sum_sq += lo[j] * lo[j]
                sum_sq += hi[j] * hi[j]
                if is_neox and j < LEAD_SLOTS and c < quarter:
                    partner_lo[j], partner_hi[j] = bf16x2_decode(x[c + quarter])
                    sum_sq += partner_lo[j] * partner_lo[j]
                    sum_sq += partner_hi[j] * partner_hi[j]
        # every thread gets here (no early return); 1 / head_dim comes from the host: no division
        rstd = rstd_from_mean(lane_group_sum(sum_sq, ROW_LANES) * inv_head_dim, eps)

        # This token's cos/sin row; out of range, row 0 is read and the rotation gets rstd = NaN.
        # As unsigned, a negative position is out of range too: one comparison.
        p = np.uint64(np.int64(positions[t]) + position_offset)
        in_range = p < np.uint64(cos_sin_cache.shape[0])
        cos_sin = cos_sin_cache[p if in_range else np.uint64(0)]
        rope_rstd = rstd if in_range else np.float32(math.nan)

        # 2. Normalize, rotate, write back one word per store.
        if active:
            for j in range(WORD_SLOTS):
                c = lane + j * ROW_LANES
                if j < LEAD_SLOTS and c < lead_words:
                    w_lo, w_hi = load_w(w, c)
                    a_lo = normed(lo[j], w_lo, rope_rstd, weight_offset)
                    a_hi = normed(hi[j], w_hi, rope_rstd, weight_offset)
                    if is_neox:  # pairs (2c, 2c + half) and (2c + 1, 2c + 1 + half)
                        wb_lo, wb_hi = load_w(w, c + quarter)
                        b_lo = normed(partner_lo[j], wb_lo, rope_rstd, weight_offset)
                        b_hi = normed(partner_hi[j], wb_hi, rope_rstd, weight_offset)
                        cos_lo, cos_hi = load_c(cos_sin, c)
                        sin_lo, sin_hi = load_c(cos_sin, quarter + c)
                        x[c] = bf16x2_encode(rotated(a_lo, b_lo, cos_lo, -sin_lo),  # a' = a cos - b sin
                                             rotated(a_hi, b_hi, cos_hi, -sin_hi))
                        x[c + quarter] = bf16x2_encode(rotated(b_lo, a_lo, cos_lo, sin_lo),  # b' = b cos + a sin
                                                       rotated(b_hi, a_hi, cos_hi, sin_hi))
                    else:  # pair (2c, 2c + 1): a' = a cos - b sin, b' = b cos + a sin
                        cos = load_c_element(cos_sin, c)
                        sin = load_c_element(cos_sin, rope_words + c)
                        x[c] = bf16x2_encode(rotated(a_lo, a_hi, cos, -sin), rotated(a_hi, a_lo, cos, sin))
                elif rope_words <= c < row_words:
                    w_lo, w_hi = load_w(w, c)
                    x[c] = bf16x2_encode(normed(lo[j], w_lo, rstd, weight_offset),
                                         normed(hi[j], w_hi, rstd, weight_offset))

    return qk_norm_rope_kernel_v3


def qk_norm_rope_v3(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox,
                    rope_dim, position_offset):
    """v3, in place on checked `[T, H, D]` tensors (one dtype and device); returns nothing.

    Runs v2 instead where the word path cannot apply: activations not bf16; NeoX with rope_dim
    not a multiple of 4 (a word would hold one rotated and one partnerless column); or a bf16
    q, k, weight or cache that has no int32 view (an odd storage offset or token/head stride,
    e.g. a fused-qkv view starting at an odd column)."""
    q, k, q_weight, k_weight = q_rows_first(q, k, q_weight, k_weight)
    q_weight, k_weight = same_weight_storage(q_weight, k_weight)
    words = word_views(q, k, q_weight, k_weight, cos_sin_cache)
    if words is None or (is_neox and rope_dim % 4):
        qk_norm_rope_v2(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox,
                        rope_dim, position_offset)
        return
    tokens, heads = q.shape[0], q.shape[1] + k.shape[1]
    if tokens * heads == 0:
        return
    bucket = head_dim_bucket(q.shape[2])
    kernel = make_qk_norm_rope_kernel_v3(TABLE_OF[q_weight.dtype], TABLE_OF[cos_sin_cache.dtype], bool(is_neox),
                                         rounding == "hf", bucket)
    # THREADS per block, fewer where a token has fewer heads (a tiny launch keeps its block small)
    threads = min(THREADS, -(-heads * row_lanes(bucket) // WARP_SIZE) * WARP_SIZE)
    head_groups = -(-heads // (threads // row_lanes(bucket)))
    scalars = (np.float32(eps), np.float32(weight_offset), np.uint32(rope_dim), np.int64(position_offset),
               np.float32(1.0 / q.shape[2]))
    launch(kernel, (tokens, head_groups), threads, (*words, positions), scalars)


def qk_norm_rope(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox, rope_dim,
                 position_offset):
    """v1, in place on checked `[T, H, D]` tensors (one dtype and device); returns nothing."""
    _launch(make_qk_norm_rope_kernel, (), q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset,
            rounding, is_neox, rope_dim, position_offset)


def _launch(factory, specialization, q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding,
            is_neox, rope_dim, position_offset):
    """One warp per (token, head) row, WARPS_PER_BLOCK rows per block."""
    rows = q.shape[0] * (q.shape[1] + k.shape[1])
    if rows == 0:
        return
    q, k, q_weight, k_weight = q_rows_first(q, k, q_weight, k_weight)
    q_weight, k_weight = same_weight_storage(q_weight, k_weight)
    kernel = factory(CODEC_OF[q.dtype], CODEC_OF[q_weight.dtype], CODEC_OF[cos_sin_cache.dtype], *specialization)
    warps = min(WARPS_PER_BLOCK, rows)  # a tiny launch keeps its block small (and the simulator quick)
    blocks = -(-rows // warps)
    scalars = (np.float32(eps), np.float32(weight_offset), rounding == "hf", bool(is_neox), np.int64(rope_dim),
               np.int64(position_offset))
    tensors = (q, k, q_weight, k_weight, cos_sin_cache, positions)
    launch(kernel, blocks, warps * WARP_SIZE, tensors, scalars)
