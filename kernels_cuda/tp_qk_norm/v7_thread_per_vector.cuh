// v7: one thread per 16-byte vector, the call's counters read beside the first loads - removes v6's serial counter reads before its first barrier
//
// v6's walk (a CTA per token, the next token requested before the wait) with two changes on the
// latency chain of a small call:
//   * thread 0's reads of the wait limit and of the gave-up flag are issued right after
//     griddepcontrol.wait, beside the first token's loads and the epoch read. v6 read them in
//     open_call after the epoch had arrived, one after the other (the limit only where the flag
//     was clear): two more L2 round trips before the CTA's first barrier, on every call.
//   * one 16-byte vector per thread (block = the row pair in whole warps, up to 1024 threads): at
//     TP=2 the MiniMax-M2 shard's 448 vectors are 448 threads (v6: 224 of two vectors). Its
//     registers (ptxas, bf16: 56, no spill) keep 5 CTAs of the TP=4 shard's 224 threads per SM.
//     (At 32 registers the protocol's paths spilled.)
// The protocol (header, epoch, waits, wrap) is v6's, unchanged. Row pairs of more than 1024
// vectors, unaligned rows and empty calls take v5's path.
#pragma once

#include "tp_qk_norm/exchange.cuh"
#include "tp_qk_norm/geometry.h"
#include "tp_qk_norm/v5_lagged_walk.cuh"  // wider row pairs, unaligned rows, empty calls

namespace cookbook::tp_qk_norm::v7 {

constexpr int kLeanMinCtasPerSm = 1;   // ptxas's budget at 1024 threads: 64 registers
static_assert(kNumTensors * kMaxRanks + kMaxRanks * kHeaderWords + 1 <= kLeanMinThreads,
              "the waiting threads, header threads and the epoch thread fit the smallest block");
static_assert(kLeanMinThreads % kWarpSize == 0 && kLeanMaxThreads % kWarpSize == 0, "whole warps");
static_assert(cross_head_norm::valid_block_size<kLeanMaxThreads>, "block_sum: at most 1024 threads");

template <typename T, bool kHfRounding>
__global__ void __launch_bounds__(kLeanMaxThreads, kLeanMinCtasPerSm) lean_rows_kernel(FusedParams p) {
  constexpr int kElems = Vec<T>::kElems;
  __shared__ float partials[kNumTensors][kMaxRanks];
  __shared__ CallState call;

  after_prior_grids();
  // Thread 0's counters, the thread's weights and the first token's vector: requested together.
  uint32_t gave_up = 0, wait_limit = 0;
  if (threadIdx.x == 0) {
    gave_up = counter(p, kGaveUpCounter);
    wait_limit = counter(p, kWaitLimitCounter);
  }
  const int q_vecs = p.shard.q_hidden / kElems;
  const int vecs = q_vecs + p.shard.k_hidden / kElems;
  const int c = threadIdx.x;  // this thread's vector of the row pair, the same at every token
  const bool has_vec = c < vecs;
  const bool is_q = c < q_vecs;
  const Row<T> row0 = locate_row<T>(p.shard, 0, is_q ? kQ : kK);
  T* const x0 = row0.x + (is_q ? c : c - q_vecs) * kElems;
  const int64_t stride = is_q ? p.shard.q_token_stride : p.shard.k_token_stride;
  const int64_t tokens = p.shard.num_tokens;
  RawWeights<T> w_raw;
  Vec<T> x;
  if (has_vec) {
    x = load_x<T, true>(x0 + blockIdx.x * stride);  // the launcher gives every CTA a token
    w_raw = load_raw_weights<T>(row0, (is_q ? c : c - q_vecs) * kElems);
  }

  const uint32_t epoch = read_epoch(p);
  if (chunk_abandoned(p, epoch)) return;
  const bool near_wrap = epoch >= kLastEpoch - 1;
  const int parity = static_cast<int>(epoch % kParities);
  const int waiting_threads = kNumTensors * p.world;  // thread (tensor, rank r) pushes to r, waits for r
  const int header_thread = threadIdx.x - (blockDim.x - p.world * kHeaderWords);
  const int epoch_thread = blockDim.x - 1 - p.world * kHeaderWords;
  if (threadIdx.x == 0) {  // open_call, from the values read above
    call.ok = 1;
    call.deadline = global_ticks() + (gave_up != 0 ? 0u : wait_limit);
  }
  __syncthreads();
  publish_header(p, epoch, parity);

  bool first = true;
  for (int64_t token = blockIdx.x; token < tokens; token += gridDim.x) {
    Vec<T> x_next;  // requested now: it arrives while this token's sums cross the GPUs
    if (has_vec && token + gridDim.x < tokens) x_next = load_x<T, true>(x0 + (token + gridDim.x) * stride);

    float sums[kNumTensors] = {0.f, 0.f};
    if (has_vec) {
      float xf[kElems];
      unpack<T>(x, xf);
      float sum_sq = 0.f;
#pragma unroll
      for (int e = 0; e < kElems; ++e) sum_sq += xf[e] * xf[e];
      sums[kQ] = is_q ? sum_sq : 0.f;
      sums[kK] = is_q ? 0.f : sum_sq;
    }
    block_sum<kNumTensors>(sums);  // its barriers order the last token's reads of `partials` first

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

    if (has_vec) {
      float total = 0.f;
      for (int r = 0; r < p.world; ++r) total += partials[is_q ? kQ : kK][r];  // rank order, as every rank
      const float rstd = rstd_from(total, is_q ? p.q_full_width : p.k_full_width, p.shard.eps);
      float xf[kElems], w[kElems], y[kElems];
      unpack<T>(x, xf);
      effective_weights<T, kHfRounding>(w_raw, row0.w_is_fp32, p.shard.weight_offset, w);
#pragma unroll
      for (int e = 0; e < kElems; ++e) y[e] = normalized<T, kHfRounding>(xf[e], rstd, w[e]);
      store_x<T, true>(x0 + token * stride, pack<T>(y));
      x = x_next;
    }
  }
  if (near_wrap) end_launch(p, epoch, parity);
}

// The kernel on a persistent grid (a CTA per token up to the resident CTAs); false where the rows
// are not aligned, the row pair has more vectors than a block has threads, or the chunk has no token.
template <typename T, bool kHfRounding>
inline bool launch_lean_rows(FusedParams p, cudaStream_t stream) {
  const int vecs = (p.shard.q_hidden + p.shard.k_hidden) / Vec<T>::kElems;
  if (p.shard.num_tokens == 0 || vecs > kLeanMaxThreads || !cross_head_norm::vector_aligned<T>(p.shard)) return false;
  constexpr auto kernel = lean_rows_kernel<T, kHfRounding>;
  const int threads = block_for(vecs, 1, kLeanMinThreads);
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
    if (!launch_lean_rows<T, kHf>(chunk, stream)) v5::launch_chunk<T, kHf>(chunk, stream);
  });
}

}  // namespace cookbook::tp_qk_norm::v7
