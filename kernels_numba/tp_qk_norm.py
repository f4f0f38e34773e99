"""Numba kernels of `tp_qk_norm` (v1): the three-step pipeline engines ran before fusing.

1. `sum_sq_kernel`, grid (tokens, 2): one block per (token, tensor) of this rank's shard
   (blockIdx.y: 0 = q, 1 = k), threads stride over the shard's columns, a block-wide sum
   (`block_sum`); thread 0 writes the token's partial sum of squares into ``sum_sq[t, tensor]``.
2. ``torch.distributed.all_reduce`` of that ``[T, 2]`` float32 tensor over the group (NCCL on
   GPUs, gloo on CPUs): every rank now holds each token's sums over the FULL rows.
3. `apply_kernel`, grid (tokens, 2): rstd = rsqrt(sum_sq / full_width + eps) (0 where that is
   0, NaN where it is NaN or +Inf: `rstd_from`), and each thread writes its columns
   y = x * rstd * (w + weight_offset), in place.

The row arithmetic (`row_sum_sq`, `write_row`, `rstd_from`) is cross_head_norm's: a TP shard is
a cross-head row cut into tp pieces, and only the width in the mean is the full one. The shard
is read twice (steps 1 and 3: the second read usually misses L2 at prefill sizes) and there are
three launches per call; the CUDA C versions remove both.

v2 (`tp_qk_norm_v2`) runs the same pipeline on bf16 shards read and written as 32-bit words, with
cross_head_norm's Numba v2 row functions (two columns per load and store, the rounding order and
the weights' storage fixed at build time, unsigned indices); other dtypes, and bf16 views with no
int32 view, run v1.
"""

from kernels_numba import _compat  # noqa: F401  (before Numba compiles anything)

import functools

import numpy as np
import torch
from numba import cuda

from kernels_numba.cross_head_norm import (NUM_TENSORS, make_row_sum_sq, make_row_sum_sq_words, make_write_row,
                                           make_write_row_words, threads_for, threads_for_words)
from kernels_numba.helpers import CODEC_OF, TABLE_OF, block_sum, launch, rstd_from, same_weight_storage, word_views


@functools.cache
def make_sum_sq_kernel_over(row_sum_sq):
    """Step 1 over a row function: `make_row_sum_sq(act)`'s elements (v1) or
    `make_row_sum_sq_words()`'s bf16 words (v2)."""

    @cuda.jit
    def sum_sq_kernel(sum_sq, q, k):
        t = cuda.blockIdx.x
        tensor = cuda.blockIdx.y
        # Every thread reaches block_sum (it holds barriers): no early return.
        if tensor == 0:
            partial = row_sum_sq(q, t)
        else:
            partial = row_sum_sq(k, t)
        partial = block_sum(partial)
        if cuda.threadIdx.x == 0:
            sum_sq[t, tensor] = partial

    return sum_sq_kernel


def make_sum_sq_kernel(act):
    return make_sum_sq_kernel_over(make_row_sum_sq(act))


@functools.cache
def make_apply_kernel(act, q_weight, k_weight):
    write_q, write_k = make_write_row(act, q_weight), make_write_row(act, k_weight)

    @cuda.jit
    def apply_kernel(q, k, q_w, k_w, sum_sq, q_full_width, k_full_width, eps, weight_offset, hf):
        t = cuda.blockIdx.x
        if cuda.blockIdx.y == 0:
            write_q(q, q_w, t, rstd_from(sum_sq[t, 0], q_full_width, eps), weight_offset, hf)
        else:
            write_k(k, k_w, t, rstd_from(sum_sq[t, 1], k_full_width, eps), weight_offset, hf)

    return apply_kernel


def tp_qk_norm(q, k, q_weight, k_weight, eps, weight_offset, rounding, group):
    """In place on checked `[T, shard_width]` shards; a collective over `group`. Returns nothing."""
    from cookbook.ops.tp_qk_norm import all_reduce_sum, world_of

    tokens = q.shape[0]
    tp = world_of(group)[1]
    sum_sq = torch.zeros((tokens, NUM_TENSORS), dtype=torch.float32, device=q.device)
    if tokens:
        codec = CODEC_OF[q.dtype]
        blocks = (tokens, NUM_TENSORS)
        threads = threads_for(max(q.shape[1], k.shape[1]))
        launch(make_sum_sq_kernel(codec), blocks, threads, (sum_sq, q, k), (), outputs=1)
    all_reduce_sum(sum_sq, group)  # every rank takes part, even with no tokens
    if tokens:
        kernel = make_apply_kernel(codec, CODEC_OF[q_weight.dtype], CODEC_OF[k_weight.dtype])
        scalars = (np.float32(q.shape[1] * tp), np.float32(k.shape[1] * tp), np.float32(eps),
                   np.float32(weight_offset), rounding == "hf")
        launch(kernel, blocks, threads, (q, k, q_weight, k_weight, sum_sq), scalars)


# --------------------------------------------------------------------------------------------
# v2: the pipeline on bf16 words
# --------------------------------------------------------------------------------------------
@functools.cache
def make_apply_kernel_v2(weight, hf):
    write_row = make_write_row_words(weight, hf)

    @cuda.jit
    def apply_kernel_v2(q, k, q_w, k_w, sum_sq, q_full_width, k_full_width, eps, weight_offset):
        t = np.uint32(cuda.blockIdx.x)
        if cuda.blockIdx.y == 0:
            write_row(q, q_w, t, rstd_from(sum_sq[t, 0], q_full_width, eps), weight_offset)
        else:
            write_row(k, k_w, t, rstd_from(sum_sq[t, 1], k_full_width, eps), weight_offset)

    return apply_kernel_v2


def tp_qk_norm_v2(q, k, q_weight, k_weight, eps, weight_offset, rounding, group):
    """v2: v1's pipeline on int32 word views of bf16 shards; v1 where they have none (`word_views`)."""
    from cookbook.ops.tp_qk_norm import all_reduce_sum, world_of

    q_weight, k_weight = same_weight_storage(q_weight, k_weight)
    words = word_views(q, k, q_weight, k_weight)
    if words is None:
        tp_qk_norm(q, k, q_weight, k_weight, eps, weight_offset, rounding, group)
        return
    q_words, k_words, q_w, k_w = words
    tokens = q.shape[0]
    tp = world_of(group)[1]
    sum_sq = torch.zeros((tokens, NUM_TENSORS), dtype=torch.float32, device=q.device)
    blocks = (tokens, NUM_TENSORS)
    threads = threads_for_words(max(q_words.shape[1], k_words.shape[1]))
    if tokens:
        sum_kernel = make_sum_sq_kernel_over(make_row_sum_sq_words())
        launch(sum_kernel, blocks, threads, (sum_sq, q_words, k_words), (), outputs=1)
    all_reduce_sum(sum_sq, group)  # every rank takes part, even with no tokens
    if tokens:
        kernel = make_apply_kernel_v2(TABLE_OF[q_weight.dtype], rounding == "hf")
        scalars = (np.float32(q.shape[1] * tp), np.float32(k.shape[1] * tp), np.float32(eps), np.float32(weight_offset))
        launch(kernel, blocks, threads, (q_words, k_words, q_w, k_w, sum_sq), scalars)

