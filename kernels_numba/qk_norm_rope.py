"""Numba kernels of `qk_norm_rope`: one warp per (token, head), norm then rope, one pass.

v1 (`qk_norm_rope`, below) keeps the CUDA C v1-v3 mapping: lane l owns columns l, l + 32, ...
and fetches each rotation partner from the lane that holds it. v2 (`qk_norm_rope_v2`) lets lanes
own whole pairs instead (no partner shuffles, cos/sin read once per pair); see its factory.

v1 mapping. grid.x: blocks of WARPS_PER_BLOCK warps; one warp per (token, head) row, numbered as
in `kernels_numba.qk_norm` (q rows first, then k rows). Lane l owns the elements of slots
j = 0, 1, ...: column c = l + 32 j (neighbouring lanes, neighbouring memory: coalesced).

1. each lane reads its elements once into a local array, adds up x^2 in float32; `warp_sum`
   gives every lane the row's sum_sq; rstd = rsqrt(sum_sq / D + eps) (0 where that is 0);
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

from kernels_numba.helpers import (CODEC_OF, MAX_THREADS_PER_BLOCK, WARP_SIZE, launch, rstd_from, warp_row, warp_shfl,
                                   warp_sum)

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
        t = row // q_heads if is_q else k_row // k_heads

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
    if q_weight.dtype != k_weight.dtype:  # one in the activation dtype, one float32: rare
        q_weight, k_weight = q_weight.float(), k_weight.float()
    kernel = factory(CODEC_OF[q.dtype], CODEC_OF[q_weight.dtype], CODEC_OF[cos_sin_cache.dtype], *specialization)
    warps = min(WARPS_PER_BLOCK, rows)  # a tiny launch keeps its block small (and the simulator quick)
    blocks = -(-rows // warps)
    scalars = (np.float32(eps), np.float32(weight_offset), rounding == "hf", bool(is_neox), np.int64(rope_dim),
               np.int64(position_offset))
    tensors = (q, k, q_weight, k_weight, cos_sin_cache, positions)
    launch(kernel, blocks, warps * WARP_SIZE, tensors, scalars)
