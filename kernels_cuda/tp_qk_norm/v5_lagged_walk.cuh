// v5: at prefill a persistent walk: sums pushed, the token finished two steps later from L2, weights once in shared memory - removes v4's tile waits
//
// Measured on two H200s at 16384 tokens of the MiniMax shard: v4's tiles took about 1.5x the
// local shard's time (cross_head_norm), and as long with their waits removed, so their cost is
// the memory path (a warp per row, through a shared-memory tile), not the exchange. Holding a
// token's rows in registers through the exchange instead (a CTA per token) was slower still: each
// CTA kept its rows through the NVLink round trip of its sums, so few bytes per SM were in flight.
// Here nothing waits holding a row:
//
//   step s of CTA b (tokens b, b + G, b + 2G, ... of a grid of G resident CTAs):
//     1. request token b + sG's q and k shard rows (16-byte loads that stay in L2);
//     2. finish token b + (s - kLag)G: request its rows again - from L2, where step s - kLag left
//        them - then wait for the peers' sums (pushed kLag steps ago, so normally already here),
//        then normalize and store the rows;
//     3. sum the squares of step 1's rows (in flight during step 2) and push the two partials to
//        every rank.
//
// DRAM sees each byte read once and written once; the second read is an L2 hit as long as the
// rows of kLag steps of the whole grid stay in L2. The header check and the epoch count run
// beside the CTA's first wait. Deadlock: a CTA's token t waits only for token t's partials, which
// each rank pushes after finishing only tokens below t; by induction on t every push comes,
// provided CTA b of every rank is resident (the grid is at most the resident CTAs, and ranks run
// the same grid).
//   The walk is issue-bound (Nsight Compute: most issue slots busy, not waiting on DRAM), and a
// thread's columns, so its weights, are the same at every step: each thread writes its own
// columns' effective weights (w + weight_offset, fp32) into shared memory once, before the walk,
// and reads them back at every finish. Only it reads them, so no barrier is needed, and the
// float4 planes (consecutive threads at consecutive float4s) are read without bank conflicts.
// (Held in registers instead, they cost occupancy: fewer CTAs per SM, and the walk was slower.)
// Chunks with fewer tokens than resident CTAs, row pairs wider than the walk's block holds, and
// unaligned rows run v4's tiles.
#pragma once

#include "tp_qk_norm/exchange.cuh"
#include "tp_qk_norm/geometry.h"
#include "tp_qk_norm/v4_batched_loads.cuh"  // small chunks, wide or unaligned rows

namespace cookbook::tp_qk_norm::v5 {

// Steps between a token's push and its finish. Measured on two H200s at 16384 tokens of the
// MiniMax shard (us, lag 1 / 2 / 3): 89.9 / 80.7 / 93.6. With one step the wait is exposed; why
// three is slower again was not profiled (more rows held in L2 between their two reads is the
// likely cost).
constexpr int kLag = 2;
static_assert(kLag >= 1, "a token is finished only after its partials were pushed");
static_assert(kNumTensors * kMaxRanks + kMaxRanks * kHeaderWords + 1 <= kLaggedMinThreads,
              "the waiting threads, header threads and the epoch thread fit the smallest block");
static_assert(kLaggedMinThreads % kWarpSize == 0 && kLaggedMaxThreads % kWarpSize == 0, "whole warps");

// A token's q and k shard rows laid end to end as 16-byte vectors: vector c is q's vector c below
// q_vecs, else k's vector c - q_vecs.
template <typename T>
struct RowPair {
  Row<T> q, k;
  int q_vecs, vecs;

  // By value, as selects: a reference into the pair would put the pair in local memory.
  __device__ __forceinline__ Row<T> row(int c) const { return c < q_vecs ? q : k; }
  __device__ __forceinline__ int col(int c) const { return (c < q_vecs ? c : c - q_vecs) * Vec<T>::kElems; }
};

// One finished 16-byte vector: x * rstd * w (w: the effective weights) rounded once (or in the
// Hugging Face order), stored with the streaming hint (its last access in the call).
template <typename T, bool kHfRounding>
__device__ __forceinline__ void write_normalized(T* dst, const Vec<T>& x, float rstd, const float (&w)[Vec<T>::kElems]) {
  float xf[Vec<T>::kElems];
  unpack<T>(x, xf);
  Vec<T> y;
#pragma unroll
  for (int e = 0; e < Vec<T>::kElems; ++e) y.v[e] = normalize<T, kHfRounding>(xf[e], rstd, w[e]);
  store_vec_streaming<T>(dst, y);
}

template <typename T>
__device__ __forceinline__ RowPair<T> row_pair(const FusedParams& p, int64_t token) {
  const int q_vecs = p.shard.q_hidden / Vec<T>::kElems;
  return {locate_row<T>(p.shard, token, kQ), locate_row<T>(p.shard, token, kK), q_vecs,
          q_vecs + p.shard.k_hidden / Vec<T>::kElems};
}

// CTAs of kLaggedMaxThreads threads per SM that the register budget aims at (ptxas, sm_90, no
// spills): 8 (64 registers) up to 2 vectors per thread; 7 at 4 (72: a step holds two tokens'
// vectors, 8 KiB of each per CTA, and at 64 it spilled), 5 in the Hugging Face order, whose extra
// roundings in fp16 needed more than 80; 4 at 8 vectors.
constexpr int lagged_min_ctas_per_sm(int vecs_per_thread, bool hf_rounding) {
  return vecs_per_thread <= 2 ? 8 : vecs_per_thread <= 4 ? (hf_rounding ? 5 : 7) : 4;
}

// The weights in shared memory: float4 planes (kElems / 4 of them), each indexed [vector j of the
// thread][thread], so that a warp reads 32 consecutive float4s.
constexpr int kFloatsPerPlane = 4;
template <typename T, int kVecsPerThread>
struct SharedWeights {
  static constexpr int kPlanes = Vec<T>::kElems / kFloatsPerPlane;
  static_assert(Vec<T>::kElems % kFloatsPerPlane == 0, "a vector is whole float4 planes");
  float4 plane[kPlanes][kVecsPerThread][kLaggedMaxThreads];

  __device__ __forceinline__ void put(int j, const float (&w)[Vec<T>::kElems]) {
#pragma unroll
    for (int k = 0; k < kPlanes; ++k) {
      const int e = k * kFloatsPerPlane;
      plane[k][j][threadIdx.x] = make_float4(w[e], w[e + 1], w[e + 2], w[e + 3]);
    }
  }
  __device__ __forceinline__ void get(int j, float (&w)[Vec<T>::kElems]) const {
#pragma unroll
    for (int k = 0; k < kPlanes; ++k) {
      const float4 f = plane[k][j][threadIdx.x];
      const int e = k * kFloatsPerPlane;
      w[e] = f.x, w[e + 1] = f.y, w[e + 2] = f.z, w[e + 3] = f.w;
    }
  }
};
constexpr int kStaticSharedBytes = 48 * 1024;  // the most a kernel may declare statically
static_assert(sizeof(SharedWeights<__nv_bfloat16, kLaggedMaxVecsPerThread>) +
                      sizeof(float) * kNumTensors * kMaxRanks + sizeof(int) <= kStaticSharedBytes,
              "the widest weights, the partials and the agreement flag fit static shared memory");

template <typename T, int kVecsPerThread, bool kHfRounding>
__global__ void __launch_bounds__(kLaggedMaxThreads, lagged_min_ctas_per_sm(kVecsPerThread, kHfRounding))
    lagged_rows_kernel(FusedParams p) {
  constexpr int kElems = Vec<T>::kElems;
  __shared__ float partials[kNumTensors][kMaxRanks];
  __shared__ CallState call;
  __shared__ SharedWeights<T, kVecsPerThread> shared_w;

  after_prior_grids();
  const uint32_t epoch = read_epoch(p);
  if (chunk_abandoned(p, epoch)) return;
  const bool near_wrap = epoch >= kLastEpoch - 1;
  const int parity = static_cast<int>(epoch % kParities);
  const int64_t tokens = p.shard.num_tokens;
  const int64_t grid = gridDim.x;
  const int waiting_threads = kNumTensors * p.world;  // thread (tensor, rank r) pushes to r, waits for r
  const int header_thread = threadIdx.x - (blockDim.x - p.world * kHeaderWords);
  const int epoch_thread = blockDim.x - 1 - p.world * kHeaderWords;

  if (threadIdx.x == 0) open_call(p, call);
  __syncthreads();
  publish_header(p, epoch, parity);

  // This thread's effective weights, the same at every step (its columns do not change), in its
  // slots of shared memory.
  {
    const RowPair<T> first = row_pair<T>(p, blockIdx.x);  // any token: only the weight columns are used
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      if (c < first.vecs) {
        const Row<T> row = first.row(c);
        const RawWeights<T> raw = load_raw_weights<T>(row, first.col(c));
        float w[kElems];
        effective_weights<T, kHfRounding>(raw, row.w_is_fp32, p.shard.weight_offset, w);
        shared_w.put(j, w);  // read back by this thread alone: no barrier
      }
    }
  }

  bool first_finish = true;
  for (int64_t step = 0;; ++step) {
    const int64_t summed = blockIdx.x + step * grid;            // whose rows are requested and summed
    const int64_t finished = blockIdx.x + (step - kLag) * grid;  // whose rows are normalized
    if (finished >= tokens) break;  // every token of the CTA is finished (block-uniform)
    const bool sum_now = summed < tokens;
    const bool finish_now = step >= kLag;  // (a CTA with fewer tokens than kLag has steps that do neither)

    // 1. Request the summed token's rows; nothing waits for them until 3.
    Vec<T> x[kVecsPerThread];
    RowPair<T> pair{};
    if (sum_now) {
      pair = row_pair<T>(p, summed);
#pragma unroll
      for (int j = 0; j < kVecsPerThread; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < pair.vecs) x[j] = load_vec_l2<T>(pair.row(c).x + pair.col(c));
      }
    }

    // 2. Finish the token summed kLag steps ago: its rows requested again (from L2, where step
    //    s - kLag left them) before the wait for its sums, so that the wait and both requests overlap.
    if (finish_now) {
      const RowPair<T> done = row_pair<T>(p, finished);
      Vec<T> again[kVecsPerThread];
#pragma unroll
      for (int j = 0; j < kVecsPerThread; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < done.vecs) again[j] = load_vec_streaming<T>(done.row(c).x + done.col(c));  // the last read
      }
      if (threadIdx.x < waiting_threads) {
        const int tensor = threadIdx.x / p.world, r = threadIdx.x % p.world;
        uint64_t word;
        if (wait_for_word(sum_slot(p, p.buffers[p.rank], parity, finished, tensor, r), epoch, &call.ok, word)) {
          partials[tensor][r] = __uint_as_float(payload_of(word));
        } else {
          call.ok = 0;
        }
      } else if (first_finish && header_thread >= 0 && !header_agrees(p, epoch, parity, header_thread, &call)) {
        call.ok = 0;
      } else if (first_finish && !near_wrap && threadIdx.x == epoch_thread) {
        count_in_for_the_epoch(p, epoch);
      }
      first_finish = false;
      __syncthreads();
      if (call.ok == 0) break;  // the same value in every thread: nothing is written
      float totals[kNumTensors] = {0.f, 0.f};
      for (int r = 0; r < p.world; ++r) {  // rank order: the same floats on every rank
        totals[kQ] += partials[kQ][r];
        totals[kK] += partials[kK][r];
      }
      const float q_rstd = rstd_from(totals[kQ], p.q_full_width, p.shard.eps);
      const float k_rstd = rstd_from(totals[kK], p.k_full_width, p.shard.eps);
#pragma unroll
      for (int j = 0; j < kVecsPerThread; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < done.vecs) {
          float w[kElems];
          shared_w.get(j, w);
          write_normalized<T, kHfRounding>(done.row(c).x + done.col(c), again[j], c < done.q_vecs ? q_rstd : k_rstd, w);
        }
      }
      if (!sum_now) __syncthreads();  // every thread has read partials before the next step rewrites them
    }

    // 3. Sum the requested rows and push the partials (block_sum's barriers also order 2's reads of
    //    partials before the next step's waits rewrite them).
    if (sum_now) {
      float sums[kNumTensors] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < kVecsPerThread; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < pair.vecs) {
          float xf[kElems];
          unpack<T>(x[j], xf);
          float sum_sq = 0.f;
#pragma unroll
          for (int e = 0; e < kElems; ++e) sum_sq += xf[e] * xf[e];
          if (c < pair.q_vecs) {  // a select, not an index: the sums stay in registers
            sums[kQ] += sum_sq;
          } else {
            sums[kK] += sum_sq;
          }
        }
      }
      block_sum<kNumTensors>(sums);
      if (threadIdx.x < waiting_threads) {
        const int tensor = threadIdx.x / p.world, r = threadIdx.x % p.world;
        store_word(sum_slot(p, p.buffers[r], parity, summed, tensor, p.rank),
                   tagged(epoch, __float_as_uint(tensor == kQ ? sums[kQ] : sums[kK])));
      }
    }
  }
  if (near_wrap) end_launch(p, epoch, parity);
}

// The walk at kVecsPerThread vectors per thread on a persistent grid of its resident CTAs, if the
// chunk has at least a token for each; returns whether it launched.
template <typename T, int kVecsPerThread, bool kHfRounding>
inline bool launch_walk(FusedParams p, int vecs, cudaStream_t stream) {
  constexpr auto kernel = lagged_rows_kernel<T, kVecsPerThread, kHfRounding>;
  const int threads = block_for(vecs, kVecsPerThread, kLaggedMinThreads);
  const int64_t resident = persistent_grid_limit<kernel>(threads);
  if (p.shard.num_tokens < resident) return false;
  p.tokens_per_cta = 1;
  p.slices_per_row = 1;
  launch_kernel(true, kernel, dim3(static_cast<unsigned>(resident)), dim3(threads), 0, stream, p);
  return true;
}

// The walk for a chunk of 16-byte aligned rows: the fewest vectors per thread that fit the row pair
// in kLaggedMaxThreads threads; false where the row pair is too wide or the chunk too small.
template <typename T, bool kHfRounding>
inline bool launch_lagged_rows(const FusedParams& p, cudaStream_t stream) {
  if (!cross_head_norm::vector_aligned<T>(p.shard)) return false;
  const int vecs = (p.shard.q_hidden + p.shard.k_hidden) / Vec<T>::kElems;
  static_assert(kLaggedMaxVecsPerThread == 8, "the cases below");
  switch (lagged_vecs_per_thread(vecs)) {
    case 1: return launch_walk<T, 1, kHfRounding>(p, vecs, stream);
    case 2: return launch_walk<T, 2, kHfRounding>(p, vecs, stream);
    case 4: return launch_walk<T, 4, kHfRounding>(p, vecs, stream);
    case 8: return launch_walk<T, 8, kHfRounding>(p, vecs, stream);
    default: return false;
  }
}

template <typename T, bool kHfRounding>
inline void launch_chunk(const FusedParams& chunk, cudaStream_t stream) {
  if (!launch_lagged_rows<T, kHfRounding>(chunk, stream)) v4::launch_chunk<T, kHfRounding>(chunk, stream);
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const FusedParams& call, cudaStream_t stream) {
  using T = Storage<kDType>;
  return for_each_chunk<T>(call, [&](const FusedParams& chunk) {
    launch_chunk<T, kRounding == Rounding::kHf>(chunk, stream);
  });
}

}  // namespace cookbook::tp_qk_norm::v5
