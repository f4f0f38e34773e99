// v6: one CTA per token, its vectors held through the exchange, the next token's requested before the wait - removes v5's shared-memory tiles at mid sizes
//
// Below a token per resident CTA v5 runs v4's tiles: a CTA stages four to six tokens in a shared
// tile, one warp per row, and waits once per tile; at 512 tokens of the MiniMax TP=2 shard that
// is 128 CTAs on 132 SMs, one warp per row loading 12 packs, far from the local shard. Here a
// CTA takes one token at a time and its block is sized to the row pair: thread i holds vectors
// i, i + blockDim.x, ... (one each at the MiniMax TP=4 shard's 224 threads, two at TP=2's), so
// every vector of every token in flight is one load of its own, and many short CTAs share an SM.
// What a CTA holding its row through the exchange lacked before (v5's note) is loads in flight
// while it waits: here the CTA requests its next token (b + G) before it waits for this one's
// sums, so the NVLink round trip overlaps that load, at the price of one more vector per thread.
//   At decode sizes (a token per CTA) each thread loads its vectors and their weights once, before
// the exchange; and the first token's loads are issued before the epoch is read (they do not
// depend on it), so that L2 round trip overlaps them instead of preceding them.
// Deadlock: CTA b's token t waits only for token t's partials, which each rank pushes after
// finishing only tokens below t (v5's argument); the grid is at most the resident CTAs.
#pragma once

#include "tp_qk_norm/exchange.cuh"
#include "tp_qk_norm/geometry.h"
#include "tp_qk_norm/v5_lagged_walk.cuh"  // wider row pairs, unaligned rows

namespace cookbook::tp_qk_norm::v6 {

// Blocks of 64 to 256 threads, one, two or four vectors per thread: row pairs up to 1024 vectors
// (8192 bf16 elements; the MiniMax TP=2 shard's 448 vectors are 224 threads of two); wider ones
// take v5's path. The register budget (ptxas, no spills; a thread holds its vectors, the next
// token's and their weights) keeps CTAs per SM for tokens in flight: at most 64 registers at one
// vector per thread (4 CTAs of the TP=4 shard's 224 threads), 128 at two, 255 at four.
constexpr int kTokenRowsMaxThreads = 256;
constexpr int kTokenRowsMinThreads = 64;
constexpr int kTokenRowsMaxVecsPerThread = 4;
constexpr int token_rows_min_ctas_per_sm(int vecs_per_thread) {
  return vecs_per_thread <= 1 ? 4 : vecs_per_thread <= 2 ? 2 : 1;
}
static_assert(kNumTensors * kMaxRanks + kMaxRanks * kHeaderWords + 1 <= kTokenRowsMinThreads,
              "the waiting threads, header threads and the epoch thread fit the smallest block");
static_assert(kTokenRowsMinThreads % kWarpSize == 0 && kTokenRowsMaxThreads % kWarpSize == 0, "whole warps");

// One of a thread's vectors, the same columns at every token: where it lies in token 0's row (q's or
// k's) and that row's token stride, so that token t's is at x0 + t * stride (two 64-bit values
// per vector, where a RowPair would hold both rows' pointers, widths and weights).
template <typename T>
struct TokenColumn {
  T* x0;
  int64_t stride;  // elements per token; 0 for a thread with no vector here
  bool is_q;
};

template <typename T, int kVecsPerThread>
__device__ __forceinline__ void locate_columns(const FusedParams& p, TokenColumn<T> (&col)[kVecsPerThread],
                                               RawWeights<T> (&w_raw)[kVecsPerThread]) {
  const int q_vecs = p.shard.q_hidden / Vec<T>::kElems;
  const int vecs = q_vecs + p.shard.k_hidden / Vec<T>::kElems;
#pragma unroll
  for (int j = 0; j < kVecsPerThread; ++j) {
    const int c = threadIdx.x + j * blockDim.x;
    const bool is_q = c < q_vecs;
    const Row<T> row = locate_row<T>(p.shard, 0, is_q ? kQ : kK);
    const int element = (is_q ? c : c - q_vecs) * Vec<T>::kElems;
    col[j] = {row.x + element, c < vecs ? (is_q ? p.shard.q_token_stride : p.shard.k_token_stride) : 0, is_q};
    if (c < vecs) w_raw[j] = load_raw_weights<T>(row, element);
  }
}

// The thread's vectors of token `token` (vectors threadIdx.x, + blockDim.x, ... of its row pair).
template <typename T, int kVecsPerThread>
__device__ __forceinline__ void load_token(const TokenColumn<T> (&col)[kVecsPerThread], int64_t token,
                                           Vec<T> (&x)[kVecsPerThread]) {
#pragma unroll
  for (int j = 0; j < kVecsPerThread; ++j) {
    if (col[j].stride != 0) x[j] = load_x<T, true>(col[j].x0 + token * col[j].stride);
  }
}

template <typename T, int kVecsPerThread, bool kHfRounding>
__global__ void __launch_bounds__(kTokenRowsMaxThreads, token_rows_min_ctas_per_sm(kVecsPerThread))
    token_rows_kernel(FusedParams p) {
  constexpr int kElems = Vec<T>::kElems;
  __shared__ float partials[kNumTensors][kMaxRanks];
  __shared__ CallState call;

  after_prior_grids();
  // The first token's vectors and this thread's weights, requested before anything that needs the
  // epoch. The launcher gives every CTA a token.
  const int64_t tokens = p.shard.num_tokens;
  TokenColumn<T> col[kVecsPerThread];
  RawWeights<T> w_raw[kVecsPerThread];
  locate_columns<T, kVecsPerThread>(p, col, w_raw);
  Vec<T> x[kVecsPerThread];
  load_token<T, kVecsPerThread>(col, blockIdx.x, x);

  const uint32_t epoch = read_epoch(p);
  if (chunk_abandoned(p, epoch)) return;
  const bool near_wrap = epoch >= kLastEpoch - 1;
  const int parity = static_cast<int>(epoch % kParities);
  const int waiting_threads = kNumTensors * p.world;  // thread (tensor, rank r) pushes to r, waits for r
  const int header_thread = threadIdx.x - (blockDim.x - p.world * kHeaderWords);
  const int epoch_thread = blockDim.x - 1 - p.world * kHeaderWords;
  if (threadIdx.x == 0) open_call(p, call);
  __syncthreads();
  publish_header(p, epoch, parity);

  bool first = true;
  for (int64_t token = blockIdx.x; token < tokens; token += gridDim.x) {
    // The next token's vectors, requested now: they arrive while this token's sums cross the GPUs.
    Vec<T> x_next[kVecsPerThread];
    if (token + gridDim.x < tokens) load_token<T, kVecsPerThread>(col, token + gridDim.x, x_next);

    float sums[kNumTensors] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      if (col[j].stride != 0) {
        float xf[kElems];
        unpack<T>(x[j], xf);
        float sum_sq = 0.f;
#pragma unroll
        for (int e = 0; e < kElems; ++e) sum_sq += xf[e] * xf[e];
        if (col[j].is_q) {  // a select, not an index: the sums stay in registers
          sums[kQ] += sum_sq;
        } else {
          sums[kK] += sum_sq;
        }
      }
    }
    // Its barriers also order the previous token's reads of `partials` before this token's waits
    // rewrite them.
    block_sum<kNumTensors>(sums);

    // Push, wait; at the first token the header check and the epoch count run beside the wait.
    if (threadIdx.x < waiting_threads) {
      const int tensor = threadIdx.x / p.world, r = threadIdx.x % p.world;
      store_word(sum_slot(p, p.buffers[r], parity, token, tensor, p.rank),
                 tagged(epoch, __float_as_uint(tensor == kQ ? sums[kQ] : sums[kK])));
      uint64_t word;
      if (wait_for_word(sum_slot(p, p.buffers[p.rank], parity, token, tensor, r), epoch, &call.ok, word)) {
        partials[tensor][r] = __uint_as_float(payload_of(word));
      } else {
        call.ok = 0;
      }
    } else if (first && header_thread >= 0 && !header_agrees(p, epoch, parity, header_thread, &call)) {
      call.ok = 0;
    } else if (first && !near_wrap && threadIdx.x == epoch_thread) {
      count_in_for_the_epoch(p, epoch);
    }
    first = false;
    __syncthreads();
    if (call.ok == 0) break;  // the same value in every thread: nothing more is written

    float totals[kNumTensors] = {0.f, 0.f};
    for (int r = 0; r < p.world; ++r) {  // rank order: the same floats on every rank
      totals[kQ] += partials[kQ][r];
      totals[kK] += partials[kK][r];
    }
    const float q_rstd = rstd_from(totals[kQ], p.q_full_width, p.shard.eps);
    const float k_rstd = rstd_from(totals[kK], p.k_full_width, p.shard.eps);
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      if (col[j].stride != 0) {
        float xf[kElems], w[kElems], y[kElems];
        unpack<T>(x[j], xf);
        effective_weights<T, kHfRounding>(w_raw[j], col[j].is_q ? p.shard.q_weight_is_fp32 : p.shard.k_weight_is_fp32,
                                          p.shard.weight_offset, w);
        const float rstd = col[j].is_q ? q_rstd : k_rstd;
#pragma unroll
        for (int e = 0; e < kElems; ++e) y[e] = normalized<T, kHfRounding>(xf[e], rstd, w[e]);
        store_x<T, true>(col[j].x0 + token * col[j].stride, pack<T>(y));
      }
    }
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) x[j] = x_next[j];
  }
  if (near_wrap) end_launch(p, epoch, parity);
}

// The kernel at kVecsPerThread vectors per thread, on a persistent grid: a CTA per token up to
// the resident CTAs, then each CTA walks tokens b, b + G, ...
template <typename T, int kVecsPerThread, bool kHfRounding>
inline void launch_token_rows_fixed(FusedParams p, int vecs, cudaStream_t stream) {
  constexpr auto kernel = token_rows_kernel<T, kVecsPerThread, kHfRounding>;
  const int threads = block_for(vecs, kVecsPerThread, kTokenRowsMinThreads);
  const int64_t resident = persistent_grid_limit<kernel>(threads);
  const int64_t grid = p.shard.num_tokens < resident ? p.shard.num_tokens : resident;
  p.tokens_per_cta = 1;
  p.slices_per_row = 1;
  launch_kernel(true, kernel, dim3(static_cast<unsigned>(grid)), dim3(threads), 0, stream, p);
}

// The path for a chunk of 16-byte aligned rows: the fewest vectors per thread that fit the row
// pair in kTokenRowsMaxThreads threads; false where the rows are not aligned, the row pair is too
// wide, or the chunk has no token (v5's path then runs).
template <typename T, bool kHfRounding>
inline bool launch_token_rows(const FusedParams& p, cudaStream_t stream) {
  if (p.shard.num_tokens == 0 || !cross_head_norm::vector_aligned<T>(p.shard)) return false;
  const int vecs = (p.shard.q_hidden + p.shard.k_hidden) / Vec<T>::kElems;
  static_assert(kTokenRowsMaxVecsPerThread == 4, "the cases below");
  if (vecs <= kTokenRowsMaxThreads) {
    launch_token_rows_fixed<T, 1, kHfRounding>(p, vecs, stream);
  } else if (vecs <= 2 * kTokenRowsMaxThreads) {
    launch_token_rows_fixed<T, 2, kHfRounding>(p, vecs, stream);
  } else if (vecs <= 4 * kTokenRowsMaxThreads) {
    launch_token_rows_fixed<T, 4, kHfRounding>(p, vecs, stream);
  } else {
    return false;
  }
  return true;
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const FusedParams& call, cudaStream_t stream) {
  using T = Storage<kDType>;
  constexpr bool kHf = kRounding == Rounding::kHf;
  return for_each_chunk<T>(call, [&](const FusedParams& chunk) {
    if (!launch_token_rows<T, kHf>(chunk, stream)) v5::launch_chunk<T, kHf>(chunk, stream);
  });
}

}  // namespace cookbook::tp_qk_norm::v6
