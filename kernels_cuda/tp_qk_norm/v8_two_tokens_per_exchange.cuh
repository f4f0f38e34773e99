// v8: addresses computed before the wait, counters read by one thread, two tokens per exchange - removes v7's parameter round trip and second exchange
//
// v7's kernel (a CTA per token, one thread per 16-byte vector) with three changes:
//   * Everything a thread computes from the launch's parameters (its column of the row pair, the
//     token stride, its weights' address) is computed before griddepcontrol.wait, and the
//     weights' lines are warmed into L2 there. v7 computed them after the wait, so the first read
//     of the parameter bank, a round trip to memory, came between the wait and the first load of x.
//   * Thread 0 alone reads the epoch, the gave-up flag, the wait limit and the failed-chunk marker,
//     and the first barrier gives them to the CTA. In v7 every thread read the epoch: at 512
//     tokens, 264 CTAs of 448 threads all read one word.
//   * A CTA with two tokens (between one and two tokens per resident CTA) sums both, pushes both
//     pairs of partial sums and waits for both at once: one NVLink round trip where v7 took two in
//     a row. Above two tokens per CTA it walks pairs b, b + G; b + 2G, b + 3G; ...
//   At these sizes q and k are read by the next kernel soon after: loads and stores are the
//   default cached ones (v7 streamed them).
// Deadlock: a CTA waits only for the partials of its current pair, and each rank pushes a pair's
// partials after finishing only earlier pairs of the same CTA, whose tokens are all smaller: the
// smallest unfinished token's partials are always pushed (the grid is at most the resident CTAs).
// The protocol (header, epoch, waits, wrap) is v7's. Row pairs of more than 1024 vectors,
// unaligned rows and empty calls take v5's path.
#pragma once

#include "tp_qk_norm/exchange.cuh"
#include "tp_qk_norm/geometry.h"
#include "tp_qk_norm/v5_lagged_walk.cuh"  // wider row pairs, unaligned rows, empty calls

namespace cookbook::tp_qk_norm::v8 {

constexpr int kTokensPerExchange = 2;
constexpr int kSumsPerExchange = kTokensPerExchange * kNumTensors;  // one (q, k) pair of sums per token
constexpr int kPairedMinCtasPerSm = 1;  // ptxas's budget at 1024 threads: 64 registers
static_assert(kSumsPerExchange * kMaxRanks + kMaxRanks * kHeaderWords + 1 <= kPairedMinThreads,
              "the waiting threads, header threads and the epoch thread fit the smallest block");
static_assert(kSumsPerExchange * kMaxRanks <= kWarpSize, "the waiting threads are the first warp's lanes");
static_assert(kPairedMinThreads % kWarpSize == 0 && kLeanMaxThreads % kWarpSize == 0, "whole warps");
static_assert(cross_head_norm::valid_block_size<kLeanMaxThreads>, "block_sum: at most 1024 threads");

// What thread 0 reads of the call's counters and the first barrier gives to every thread.
struct PairedCall {
  CallState state;  // ok, the header waits' deadline
  uint32_t epoch;
  int abandoned;    // a later chunk of a call whose earlier chunk failed: do nothing
};

template <typename T, bool kHfRounding>
__global__ void __launch_bounds__(kLeanMaxThreads, kPairedMinCtasPerSm) paired_rows_kernel(FusedParams p) {
  constexpr int kElems = Vec<T>::kElems;
  __shared__ float partials[kTokensPerExchange][kNumTensors][kMaxRanks];
  __shared__ PairedCall call;

  // Before the wait: this thread's column (the same at every token) from the parameters, and its
  // weights' line warmed into L2 (no kernel writes the weights).
  const int q_vecs = p.shard.q_hidden / kElems;
  const int vecs = q_vecs + p.shard.k_hidden / kElems;
  const int c = threadIdx.x;
  const bool has_vec = c < vecs;
  const bool is_q = c < q_vecs;
  const Row<T> row0 = locate_row<T>(p.shard, 0, is_q ? kQ : kK);
  const int column = (is_q ? c : c - q_vecs) * kElems;
  T* const x0 = row0.x + column;
  const int64_t stride = is_q ? p.shard.q_token_stride : p.shard.k_token_stride;
  const int64_t tokens = p.shard.num_tokens;
  const int64_t step = gridDim.x;
  if (has_vec && column % kL2LineElems<T> == 0) warm_l2(static_cast<const T*>(row0.w) + column);
  asm volatile("" ::"l"(x0), "l"(stride), "l"(tokens));  // computed here, not after the wait

  after_prior_grids();
  // Thread 0's reads of the counters, the first pair's vectors and this thread's weights: all
  // requested before any is used (thread 0 stores the counters into `call` only after its own
  // vectors are requested, or they would wait a round trip behind the counters).
  uint32_t epoch = 0, gave_up = 0, wait_limit = 0, failed = 0;
  if (threadIdx.x == 0) {
    epoch = read_epoch(p);
    gave_up = counter(p, kGaveUpCounter);
    wait_limit = counter(p, kWaitLimitCounter);
    if (p.chunk_index > 0) failed = counter(p, kFailedCounter);
  }
  RawWeights<T> w_raw;
  Vec<T> x[kTokensPerExchange];
#pragma unroll
  for (int j = 0; j < kTokensPerExchange; ++j) {
    const int64_t token = blockIdx.x + j * step;  // the launcher gives every CTA a token
    if (has_vec && token < tokens) x[j] = load_x<T, false>(x0 + token * stride);
  }
  if (has_vec) w_raw = load_raw_weights<T>(row0, column);
  if (threadIdx.x == 0) {
    call.abandoned = p.chunk_index > 0 && failed == epoch;  // chunk_abandoned, from the value read above
    call.epoch = epoch;
    call.state.ok = 1;
    call.state.deadline = global_ticks() + (gave_up != 0 ? 0u : wait_limit);
  }
  __syncthreads();
  if (call.abandoned) return;
  epoch = call.epoch;
  const bool near_wrap = epoch >= kLastEpoch - 1;
  const int parity = static_cast<int>(epoch % kParities);
  const int waiting_threads = kSumsPerExchange * p.world;  // thread ((j, tensor), rank r) pushes to r, waits for r
  const int header_thread = threadIdx.x - (blockDim.x - p.world * kHeaderWords);
  const int epoch_thread = blockDim.x - 1 - p.world * kHeaderWords;
  publish_header(p, epoch, parity);

  bool first = true;
  for (int64_t pair = blockIdx.x; pair < tokens; pair += kTokensPerExchange * step) {
    if (!first) {  // a later pair's vectors (more than two tokens per resident CTA)
#pragma unroll
      for (int j = 0; j < kTokensPerExchange; ++j) {
        if (has_vec && pair + j * step < tokens) x[j] = load_x<T, false>(x0 + (pair + j * step) * stride);
      }
    }
    // sums[j * kNumTensors + tensor]: token j's sum of squares of its q (or k) columns here.
    float sums[kSumsPerExchange];
#pragma unroll
    for (int j = 0; j < kTokensPerExchange; ++j) {
      float sum_sq = 0.f;
      if (has_vec && pair + j * step < tokens) {
        float xf[kElems];
        unpack<T>(x[j], xf);
#pragma unroll
        for (int e = 0; e < kElems; ++e) sum_sq += xf[e] * xf[e];
      }
      sums[j * kNumTensors + kQ] = is_q ? sum_sq : 0.f;
      sums[j * kNumTensors + kK] = is_q ? 0.f : sum_sq;
    }
    block_sum<kSumsPerExchange>(sums);  // its barriers order the last pair's reads of `partials` first

    if (threadIdx.x < waiting_threads) {
      const int slot = threadIdx.x / p.world, r = threadIdx.x % p.world;
      const int j = slot / kNumTensors, tensor = slot % kNumTensors;
      const int64_t token = pair + j * step;
      if (token < tokens) {
        float mine = 0.f;
#pragma unroll
        for (int i = 0; i < kSumsPerExchange; ++i) mine = i == slot ? sums[i] : mine;  // selects: no local memory
        store_word(sum_slot(p, p.buffers[r], parity, token, tensor, p.rank), tagged(epoch, __float_as_uint(mine)));
        uint64_t word;
        if (wait_for_word(sum_slot(p, p.buffers[p.rank], parity, token, tensor, r), epoch, &call.state.ok, word)) {
          partials[j][tensor][r] = __uint_as_float(payload_of(word));
        } else {
          call.state.ok = 0;
        }
      }
    } else if (first && header_thread >= 0 && !header_agrees(p, epoch, parity, header_thread, &call.state)) {
      call.state.ok = 0;
    } else if (first && !near_wrap && threadIdx.x == epoch_thread) {
      count_in_for_the_epoch(p, epoch);
    }
    first = false;
    __syncthreads();
    if (call.state.ok == 0) break;  // the same value in every thread: nothing more is written

    if (has_vec) {
      float w[kElems];
      effective_weights<T, kHfRounding>(w_raw, row0.w_is_fp32, p.shard.weight_offset, w);
      const int tensor = is_q ? kQ : kK;
      const float full_width = is_q ? p.q_full_width : p.k_full_width;
#pragma unroll
      for (int j = 0; j < kTokensPerExchange; ++j) {
        const int64_t token = pair + j * step;
        if (token < tokens) {
          float total = 0.f;
          for (int r = 0; r < p.world; ++r) total += partials[j][tensor][r];  // rank order, as every rank
          const float rstd = rstd_from(total, full_width, p.shard.eps);
          float xf[kElems], y[kElems];
          unpack<T>(x[j], xf);
#pragma unroll
          for (int e = 0; e < kElems; ++e) y[e] = normalized<T, kHfRounding>(xf[e], rstd, w[e]);
          store_x<T, false>(x0 + token * stride, pack<T>(y));
        }
      }
    }
  }
  if (near_wrap) end_launch(p, epoch, parity);
}

// The kernel on a persistent grid (a CTA per token up to the resident CTAs; above that a CTA has
// two tokens or more); false where the rows are not aligned, the row pair has more vectors than a
// block has threads, or the chunk has no token.
template <typename T, bool kHfRounding>
inline bool launch_paired_rows(FusedParams p, cudaStream_t stream) {
  const int vecs = (p.shard.q_hidden + p.shard.k_hidden) / Vec<T>::kElems;
  if (p.shard.num_tokens == 0 || vecs > kLeanMaxThreads || !cross_head_norm::vector_aligned<T>(p.shard)) return false;
  constexpr auto kernel = paired_rows_kernel<T, kHfRounding>;
  const int threads = block_for(vecs, 1, kPairedMinThreads);
  const int64_t resident = persistent_grid_limit<kernel>(threads);
  const int64_t grid = p.shard.num_tokens < resident ? p.shard.num_tokens : resident;
  p.tokens_per_cta = 1;
  p.slices_per_row = 1;
  launch_kernel(true, kernel, dim3(static_cast<unsigned>(grid)), dim3(threads), 0, stream, p);
  return true;
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const FusedParams& call, cudaStream_t stream) {
  using T = Storage<kDType>;
  constexpr bool kHf = kRounding == Rounding::kHf;
  return for_each_chunk<T>(call, [&](const FusedParams& chunk) {
    if (!launch_paired_rows<T, kHf>(chunk, stream)) v5::launch_chunk<T, kHf>(chunk, stream);
  });
}

}  // namespace cookbook::tp_qk_norm::v8
