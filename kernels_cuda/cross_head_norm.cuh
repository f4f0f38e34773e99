// cross_head_norm: RMSNorm of q and k over their whole hidden size, in place, one launch.
//
//   per token row x of q (length q_hidden) and of k (length k_hidden), float32 accumulation:
//   y = x * rsqrt(mean(x^2 over the row) + eps) * (w + weight_offset)
//
// A row is thousands of elements (heads * head_dim), so one CTA owns a row and the sum of squares
// is a block reduction (block_sum in include/common.cuh). q_hidden and k_hidden may differ.
//
// Versions (cookbook/registry.py is the list; tests/test_cuda_sources.py keeps these lines and
// the registry's leads identical):
// v1: one CTA per token normalizes q and k together: two sums of squares, both weights live, a two-value block reduction
// v2: grid (tokens, 2), blockIdx.y picks q or k: one sum and one weight per CTA - removes v1's extra live registers (higher occupancy) and doubles the CTAs
// v3: 16-byte vectors with the row held in registers, block size derived from the hidden size - removes v2's second read and narrow loads
// v4: rows wider than v3's two-vector limit (8192 bf16 elements) staged in shared memory by one bulk asynchronous copy (Hopper's TMA engine: one instruction, tracked by an mbarrier), then reduced and written from there; narrower rows run v3 - removes v3's wide-row cost: 64 to 100 registers per thread and one or two CTAs per SM, with 16 bytes in flight per thread
// v5: v4 with x read and written by streaming (evict-first) global accesses, and the bulk copy kept for rows beyond v3's eight-vector limit (32768 bf16 elements) - removes v4's default caching of bytes that are touched once, and its slower bulk-copy path for 8193- to 32768-wide rows
// v6: v5 as a programmatic dependent launch (as qk_norm v6): its CTAs become resident while the previous kernel finishes and wait in hardware (griddepcontrol) for its writes - removes the launch gap between back-to-back kernels from each call
// v7: v6 with, at batches whose rows fill every SM, four-warp CTAs holding up to eight vectors per thread (v3's rule, the fewest vectors per thread in CTAs of up to 512 threads, kept for smaller batches) - removes v6's 64 KiB in flight per SM at wide rows (four 512-thread CTAs of 16-32 bytes per thread) where the register file holds twice that
// v8: v7 with, at narrow rows (up to 256 vectors, 2048 bf16 elements) and many tokens, one warp per token: q's row then k's, four tokens per CTA, no block barrier - removes v7's two small CTAs per token there (tensor-parallel shards, small models), whose dispatch, not their bytes, set the time
// v9: v8 with, where q and k are views of one tensor of token rows (a fused qkv projection) and the rows fill the GPU at least three times, the CTAs of a token's q row and k row launched next to each other instead of all q rows before all k rows - removes v8's sparse streams over the fused rows: the rows in flight together now lie side by side in memory (at q, k and v 8192 bf16 wide, 32 KiB of every 48 KiB instead of 16)
// v10: v9 with, at calls of fewer than three waves of CTAs (decode and small batches), each thread's weight vectors loaded with its row (issued just before it), before the block sum, and held in registers until the store - removes the weight loads that v3-v9 issue after the reduction: a memory round trip on the critical path of every CTA, which only calls of many waves hide
// v11: v10 with, at calls of one to three waves of CTAs, each CTA warming into L2 the row of the CTA a wave after it once its own row's loads are issued - removes the DRAM round trip that every CTA of the later waves waited for before its block sum
// v12: v11 with, on v9's token-major grid, v3's kernel compiled for its four-warp CTA (the block size a compile-time constant, also where v7 launches fewer threads) - removes the run-time block size from the address and the bound of every vector a thread loads and stores, in the calls that move the most bytes
// v13: v12 with, at calls of a wave of CTAs or more that move at most 192 MiB, the first CTAs in grid order (2 MiB of rows) warming their own row into L2 before the programmatic wait - removes part of each call's start: the first wave's DRAM round trip, begun while the previous kernel drains
// v14: v13 with, on the (tokens, 2) grid, rows of 4097 to 8192 bf16 elements with q and k within 2x of each other in width launched in v3's CTA (512 threads x 2 vectors at 8192) instead of v7's four warps x 8 vectors, with v13's warm and without v11's warm-ahead - removes half of v7's 128 KiB per SM requested at once, which in calls of one to a few waves arrives, and then is stored, as one burst per wave (1536 x 8192: 74 -> 85 % of the copy)
//
// Torch-free: raw pointers and element strides (64-bit). bindings/cross_head_norm.cu is the torch glue.
#pragma once

#include "include/common.cuh"

namespace cookbook::cross_head_norm {

struct Params {
  void* q;                // [T, q_hidden], token stride below, last dim contiguous
  void* k;                // [T, k_hidden]
  const void* q_weight;   // [q_hidden], activation dtype or float32
  const void* k_weight;   // [k_hidden]
  bool q_weight_is_fp32;  // each weight's storage, independently
  bool k_weight_is_fp32;
  int64_t num_tokens;
  int q_hidden;
  int k_hidden;
  int64_t q_token_stride, k_token_stride;  // in elements
  float eps;
  float weight_offset;
  int64_t rows_ahead;  // v11: a wave of resident CTAs, how far ahead in grid order a CTA warms a row (the launcher sets it)
  int64_t warm_first_ctas;  // v13: the CTAs, first in grid order, that warm their own row before the wait (the launcher sets it)
};

// Which tensor a CTA normalizes: blockIdx.y in v2 and v3, an index into v1's two sums.
constexpr int kQ = 0;
constexpr int kK = 1;
constexpr int kNumTensors = 2;

// One token's row of q or k: where it lives, its length and its weight.
template <typename T>
struct Row {
  T* x;
  int hidden;
  const void* w;
  bool w_is_fp32;
};

template <typename T>
__device__ __forceinline__ Row<T> locate_row(const Params& p, int64_t token, int tensor) {
  if (tensor == kQ) return {static_cast<T*>(p.q) + token * p.q_token_stride, p.q_hidden, p.q_weight, p.q_weight_is_fp32};
  return {static_cast<T*>(p.k) + token * p.k_token_stride, p.k_hidden, p.k_weight, p.k_weight_is_fp32};
}

// The block sums below require whole warps and at most 1024 threads.
template <int kThreads>
constexpr bool valid_block_size = kThreads % kWarpSize == 0 && kThreads <= kMaxWarpsPerBlock * kWarpSize;

// ------------------------------------------------------------------------------------------
// v1: one CTA per token normalizes q and k together: two sums of squares, both weights live, a two-value block reduction
// grid.x: token; thread -> columns threadIdx.x, + kV1Threads, ... of BOTH rows in one loop.
// Two passes over memory (sum, then write); the second read is served by L1/L2.
// ------------------------------------------------------------------------------------------
constexpr int kV1Threads = 256;
static_assert(valid_block_size<kV1Threads>, "v1: whole warps, at most 1024 threads");

template <typename T, bool kHfRounding>
__global__ void __launch_bounds__(kV1Threads) cross_head_norm_v1_kernel(Params p) {
  const int64_t token = blockIdx.x;
  T* const q = static_cast<T*>(p.q) + token * p.q_token_stride;
  T* const k = static_cast<T*>(p.k) + token * p.k_token_stride;
  const int widest = p.q_hidden > p.k_hidden ? p.q_hidden : p.k_hidden;

  float sum_sq[kNumTensors] = {0.f, 0.f};
  for (int d = threadIdx.x; d < widest; d += kV1Threads) {
    if (d < p.q_hidden) {
      const float x = to_float<T>(q[d]);
      sum_sq[kQ] += x * x;
    }
    if (d < p.k_hidden) {
      const float x = to_float<T>(k[d]);
      sum_sq[kK] += x * x;
    }
  }
  block_sum<kNumTensors>(sum_sq);  // every thread reaches it: no early exit above
  const float rstd_q = rstd_from(sum_sq[kQ], static_cast<float>(p.q_hidden), p.eps);
  const float rstd_k = rstd_from(sum_sq[kK], static_cast<float>(p.k_hidden), p.eps);

  for (int d = threadIdx.x; d < widest; d += kV1Threads) {
    if (d < p.q_hidden) {
      const float w = effective_weight<T, kHfRounding>(load_weight<T>(p.q_weight, p.q_weight_is_fp32, d), p.weight_offset);
      q[d] = normalize<T, kHfRounding>(to_float<T>(q[d]), rstd_q, w);
    }
    if (d < p.k_hidden) {
      const float w = effective_weight<T, kHfRounding>(load_weight<T>(p.k_weight, p.k_weight_is_fp32, d), p.weight_offset);
      k[d] = normalize<T, kHfRounding>(to_float<T>(k[d]), rstd_k, w);
    }
  }
}

// ------------------------------------------------------------------------------------------
// v2: grid (tokens, 2), blockIdx.y picks q or k: one sum and one weight per CTA - removes v1's extra live registers (higher occupancy) and doubles the CTAs
// grid.x: token, grid.y: tensor (kQ, kK); thread -> columns threadIdx.x, + kV2Threads, ...
// Streams any even width at any alignment: it is also v3's general path.
// ------------------------------------------------------------------------------------------
constexpr int kV2Threads = 256;
static_assert(valid_block_size<kV2Threads>, "v2: whole warps, at most 1024 threads");

template <typename T, bool kHfRounding>
__global__ void __launch_bounds__(kV2Threads) cross_head_norm_v2_kernel(Params p) {
  const Row<T> r = locate_row<T>(p, blockIdx.x, static_cast<int>(blockIdx.y));
  float sum_sq = 0.f;
  for (int d = threadIdx.x; d < r.hidden; d += kV2Threads) {
    const float x = to_float<T>(r.x[d]);
    sum_sq += x * x;
  }
  const float rstd = rstd_from(block_sum(sum_sq), static_cast<float>(r.hidden), p.eps);
  for (int d = threadIdx.x; d < r.hidden; d += kV2Threads) {  // second read: served by L1/L2
    const float w = effective_weight<T, kHfRounding>(load_weight<T>(r.w, r.w_is_fp32, d), p.weight_offset);
    r.x[d] = normalize<T, kHfRounding>(to_float<T>(r.x[d]), rstd, w);
  }
}

// ------------------------------------------------------------------------------------------
// v3: 16-byte vectors with the row held in registers, block size derived from the hidden size - removes v2's second read and narrow loads
// grid.x: token, grid.y: tensor; thread t holds vectors t, t + blockDim.x, ... (kVecsPerThread of
// them) of its row in registers, so x is read once and written once and one load instruction of
// the block covers contiguous memory. blockDim.x = the wider row's vectors / kVecsPerThread.
// ------------------------------------------------------------------------------------------
constexpr int kV3MaxThreads = 512;       // per CTA: leaves room for several resident CTAs per SM
constexpr int kV3MaxVecsPerThread = 8;   // 8 x 16 bytes = 32 registers of row per thread
static_assert(valid_block_size<kV3MaxThreads>, "v3: whole warps, at most 1024 threads");

template <typename T, int kVecsPerThread>
struct V3Traits {
  static constexpr int kVecElems = Vec<T>::kElems;  // 4 fp32, 8 fp16/bf16
  static constexpr int kFloatVecsPerVec = kVecElems / Vec<float>::kElems;  // a float32 weight vector: 1 or 2 loads
  static constexpr int kMaxHidden = kV3MaxThreads * kVecsPerThread * kVecElems;  // widest row held in registers

  static_assert(kVecsPerThread >= 1 && kVecsPerThread <= kV3MaxVecsPerThread, "a thread holds 1..8 vectors");
  static_assert(kVecElems % Vec<float>::kElems == 0, "a float32 weight slice is whole 16-byte vectors");
};

// kVecElems consecutive effective weights from column `col` (16-byte aligned: the host checks it).
template <typename T, bool kHfRounding>
__device__ __forceinline__ void load_weight_vec(const void* w, bool w_is_fp32, int col, float weight_offset,
                                                float (&w_eff)[Vec<T>::kElems]) {
  using Tr = V3Traits<T, 1>;
  if (w_is_fp32) {
#pragma unroll
    for (int v = 0; v < Tr::kFloatVecsPerVec; ++v) {
      const Vec<float> f = load_vec<float>(static_cast<const float*>(w) + col + v * Vec<float>::kElems);
#pragma unroll
      for (int j = 0; j < Vec<float>::kElems; ++j) w_eff[v * Vec<float>::kElems + j] = f.v[j];
    }
  } else {
    unpack<T>(load_vec<T>(static_cast<const T*>(w) + col), w_eff);
  }
#pragma unroll
  for (int j = 0; j < Tr::kVecElems; ++j) w_eff[j] = effective_weight<T, kHfRounding>(w_eff[j], weight_offset);
}

// One thread's share of a row held in registers: vectors first, first + stride, ... (kVecs slots;
// those past the row's end stay unused, so the narrower tensor leaves threads idle). v3 strides by
// the block, v8 by the warp. Returns the thread's sum of squares.
template <typename T, int kVecs, bool kStreaming>
__device__ __forceinline__ float load_row_vectors(const Row<T>& r, int first, int stride, Vec<T> (&x)[kVecs]) {
  constexpr int kVecElems = Vec<T>::kElems;
  const int num_vecs = r.hidden / kVecElems;
  float sum_sq = 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int vec = first + i * stride;
    if (vec < num_vecs) {
      x[i] = load_x<T, kStreaming>(r.x + vec * kVecElems);
      float xf[kVecElems];
      unpack<T>(x[i], xf);
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) sum_sq += xf[j] * xf[j];
    }
  }
  return sum_sq;
}

// The same vectors normalized with the row's rstd and weight, written back in place.
template <typename T, int kVecs, bool kHfRounding, bool kStreaming>
__device__ __forceinline__ void store_row_vectors(const Row<T>& r, int first, int stride, const Vec<T> (&x)[kVecs],
                                                  float rstd, float weight_offset) {
  constexpr int kVecElems = Vec<T>::kElems;
  const int num_vecs = r.hidden / kVecElems;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int vec = first + i * stride;
    if (vec < num_vecs) {
      float xf[kVecElems], w[kVecElems], y[kVecElems];
      unpack<T>(x[i], xf);
      load_weight_vec<T, kHfRounding>(r.w, r.w_is_fp32, vec * kVecElems, weight_offset, w);
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) y[j] = normalized<T, kHfRounding>(xf[j], rstd, w[j]);
      store_x<T, kStreaming>(r.x + vec * kVecElems, pack<T>(y));
    }
  }
}

// A 16-byte vector's weights as loaded, not yet converted, so that a batch of loads can be issued
// before the first conversion waits on one (v10 here; tp_qk_norm's v6 and v10). fp32 weights fill
// every word; activation-type weights only words[0].
template <typename T>
struct RawWeights {
  static constexpr int kFloatVecs = Vec<T>::kElems / Vec<float>::kElems;
  uint4 words[kFloatVecs];
};

template <typename T>
__device__ __forceinline__ RawWeights<T> load_raw_weights(const Row<T>& r, int col) {
  RawWeights<T> raw;
  if (r.w_is_fp32) {
#pragma unroll
    for (int v = 0; v < RawWeights<T>::kFloatVecs; ++v) {
      raw.words[v] = *reinterpret_cast<const uint4*>(static_cast<const float*>(r.w) + col + v * Vec<float>::kElems);
    }
  } else {
    raw.words[0] = *reinterpret_cast<const uint4*>(static_cast<const T*>(r.w) + col);
  }
  return raw;
}

template <typename T, bool kHfRounding>
__device__ __forceinline__ void effective_weights(const RawWeights<T>& raw, bool w_is_fp32, float weight_offset,
                                                  float (&w)[Vec<T>::kElems]) {
  if (w_is_fp32) {
#pragma unroll
    for (int v = 0; v < RawWeights<T>::kFloatVecs; ++v) {
      const Vec<float>& f = *reinterpret_cast<const Vec<float>*>(&raw.words[v]);
#pragma unroll
      for (int j = 0; j < Vec<float>::kElems; ++j) w[v * Vec<float>::kElems + j] = f.v[j];
    }
  } else {
    unpack<T>(*reinterpret_cast<const Vec<T>*>(&raw.words[0]), w);
  }
#pragma unroll
  for (int j = 0; j < Vec<T>::kElems; ++j) w[j] = effective_weight<T, kHfRounding>(w[j], weight_offset);
}

// For v10: a thread's weight vectors for the same slots as load_row_vectors, loaded before any is used.
template <typename T, int kVecs>
__device__ __forceinline__ void load_row_weights(const Row<T>& r, int first, int stride, RawWeights<T> (&w)[kVecs]) {
  const int num_vecs = r.hidden / Vec<T>::kElems;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int vec = first + i * stride;
    if (vec < num_vecs) w[i] = load_raw_weights<T>(r, vec * Vec<T>::kElems);
  }
}

// store_row_vectors with the weights already in registers (v10).
template <typename T, int kVecs, bool kHfRounding, bool kStreaming>
__device__ __forceinline__ void store_row_vectors_held(const Row<T>& r, int first, int stride, const Vec<T> (&x)[kVecs],
                                                       const RawWeights<T> (&w_raw)[kVecs], float rstd,
                                                       float weight_offset) {
  constexpr int kVecElems = Vec<T>::kElems;
  const int num_vecs = r.hidden / kVecElems;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int vec = first + i * stride;
    if (vec < num_vecs) {
      float xf[kVecElems], w[kVecElems], y[kVecElems];
      unpack<T>(x[i], xf);
      effective_weights<T, kHfRounding>(w_raw[i], r.w_is_fp32, weight_offset, w);
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) y[j] = normalized<T, kHfRounding>(xf[j], rstd, w[j]);
      store_x<T, kStreaming>(r.x + vec * kVecElems, pack<T>(y));
    }
  }
}

// A row brought into L2, one prefetch per 128-byte line, spread over the block's threads (v11's
// row a wave ahead, v13's own row before the wait).
template <typename T>
__device__ __forceinline__ void warm_row(const Row<T>& r) {
  for (int col = threadIdx.x * kL2LineElems<T>; col < r.hidden; col += blockDim.x * kL2LineElems<T>) warm_l2(r.x + col);
}

// The CTA's place in grid order (the order CTAs are dispatched in): grid.x alone on v9's grid,
// x fastest then y on the (token, tensor) grid.
template <bool kTokenMajor>
__device__ __forceinline__ int64_t cta_in_grid_order() {
  return kTokenMajor ? static_cast<int64_t>(blockIdx.x) : static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
}

// For v11: the row of the CTA p.rows_ahead after this one in grid order (a CTA of the next wave).
template <typename T, bool kTokenMajor>
__device__ __forceinline__ void warm_row_ahead(const Params& p) {
  const int64_t ahead = cta_in_grid_order<kTokenMajor>() + p.rows_ahead;
  const int64_t token = kTokenMajor ? ahead / kNumTensors : ahead % gridDim.x;
  const int64_t tensor = kTokenMajor ? ahead % kNumTensors : ahead / gridDim.x;
  if (tensor >= kNumTensors || token >= p.num_tokens) return;
  warm_row(locate_row<T>(p, token, static_cast<int>(tensor)));
}

// kStreaming (v5): x is read and written by streaming global accesses (load_vec_streaming).
// kProgrammatic (v6): launched programmatically, so nothing is read before after_prior_grids.
// kTokenMajor (v9): grid.x walks (token, tensor) pairs, CTA 2t + tensor normalizing token t's row.
// kWeightsWithRow (v10): the thread's weight vectors are loaded with its row (just before it),
// before the block sum, and held in registers until the store.
// kWarmAhead (v11): once the row's loads are issued, the row a wave ahead is warmed into L2.
// kBlockThreads (v12): the block's thread count fixed at compile time (0: blockDim.x at run time).
// kWarmOwnRow (v13): the first p.warm_first_ctas CTAs in grid order warm their own row into L2
// before the programmatic wait (warm_l2 says why that is safe).
template <typename T, int kVecsPerThread, bool kHfRounding, bool kStreaming = false, bool kProgrammatic = false,
          bool kTokenMajor = false, bool kWeightsWithRow = false, bool kWarmAhead = false, int kBlockThreads = 0,
          bool kWarmOwnRow = false>
__global__ void __launch_bounds__(kBlockThreads > 0 ? kBlockThreads : kV3MaxThreads) cross_head_norm_v3_kernel(Params p) {
  static_assert(kVecsPerThread >= 1 && kVecsPerThread <= kV3MaxVecsPerThread, "a thread holds 1..8 vectors");
  static_assert(kBlockThreads == 0 || (valid_block_size<kBlockThreads> && kBlockThreads <= kV3MaxThreads),
                "v12: a fixed block is whole warps within v3's bound");
  // The stride between a thread's vectors: a constant with kBlockThreads, so each vector's address
  // is the thread's first one plus an immediate offset.
  const int stride = kBlockThreads > 0 ? kBlockThreads : static_cast<int>(blockDim.x);
  // Where the row lies comes from the kernel's parameters alone, so it may be found before the wait.
  const Row<T> r = kTokenMajor ? locate_row<T>(p, blockIdx.x / kNumTensors, static_cast<int>(blockIdx.x % kNumTensors))
                               : locate_row<T>(p, blockIdx.x, static_cast<int>(blockIdx.y));
  if constexpr (kWarmOwnRow) {
    if (cta_in_grid_order<kTokenMajor>() < p.warm_first_ctas) warm_row(r);  // v13: while the previous kernel drains
  }
  if constexpr (kProgrammatic) after_prior_grids();  // v6: read nothing before the previous kernel is done
  Vec<T> x[kVecsPerThread];  // kept packed across the block reduction: half the registers of float32
  if constexpr (kWeightsWithRow) {
    RawWeights<T> w[kVecsPerThread];
    load_row_weights<T, kVecsPerThread>(r, threadIdx.x, stride, w);  // issued before the sum waits on x
    const float sum_sq = load_row_vectors<T, kVecsPerThread, kStreaming>(r, threadIdx.x, stride, x);
    if constexpr (kWarmAhead) warm_row_ahead<T, kTokenMajor>(p);
    const float rstd = rstd_from(block_sum(sum_sq), static_cast<float>(r.hidden), p.eps);
    store_row_vectors_held<T, kVecsPerThread, kHfRounding, kStreaming>(r, threadIdx.x, stride, x, w, rstd,
                                                                       p.weight_offset);
  } else {
    const float sum_sq = load_row_vectors<T, kVecsPerThread, kStreaming>(r, threadIdx.x, stride, x);
    if constexpr (kWarmAhead) warm_row_ahead<T, kTokenMajor>(p);
    const float rstd = rstd_from(block_sum(sum_sq), static_cast<float>(r.hidden), p.eps);
    store_row_vectors<T, kVecsPerThread, kHfRounding, kStreaming>(r, threadIdx.x, stride, x, rstd, p.weight_offset);
  }
}

// ------------------------------------------------------------------------------------------
// v4: rows wider than v3's two-vector limit (8192 bf16 elements) staged in shared memory by one bulk asynchronous copy (Hopper's TMA engine: one instruction, tracked by an mbarrier), then reduced and written from there; narrower rows run v3 - removes v3's wide-row cost: 64 to 100 registers per thread and one or two CTAs per SM, with 16 bytes in flight per thread
// grid.x: token, grid.y: tensor, kV4Threads threads. Thread 0 arms an mbarrier with the row's
// byte count and issues one cp.async.bulk of the whole row into dynamic shared memory; every
// thread waits on the mbarrier, sums its vectors' squares from shared memory (block_sum), then
// normalizes them and stores to global. The registers hold no row, so the block size no longer
// follows the width, and the bytes in flight per SM are the rows of its resident CTAs (shared
// memory allows 3 CTAs of a 64 KiB, 32768-element bf16 row) instead of 16 bytes per thread.
// Needs sm_90, v3's alignment, and the wider row within the per-CTA shared memory opt-in limit;
// the host launches v3 otherwise, and also for rows v3 holds at one or two vectors per thread:
// measured on the H200 (docs/cross_head_norm.md), this kernel beat v3 by 12 % at 32768-wide
// rows but lost 3-4 % at 2048-8192 tokens x 8192 and about 1 us at 1-16 tokens (its copy and
// barrier wait sit on the critical path before any arithmetic). Those figures predate v3 keeping its row
// packed (32 -> 64 registers at two -> eight vectors per thread): since then v3's eight-vector
// kernel beats this one at the 32768-wide row too (docs/cross_head_norm.md, Results).
// ------------------------------------------------------------------------------------------
constexpr int kV4Threads = 256;
static_assert(valid_block_size<kV4Threads>, "v4: whole warps, at most 1024 threads");

// kStreaming (v5): the stores of x are streaming (the bulk copy already bypasses L1).
// kProgrammatic (v6): launched programmatically, so nothing is read before after_prior_grids.
template <typename T, bool kHfRounding, bool kStreaming = false, bool kProgrammatic = false>
__global__ void __launch_bounds__(kV4Threads) cross_head_norm_v4_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // the host launches v4 on sm_90 and later only
#else
  if constexpr (kProgrammatic) after_prior_grids();  // v6: read nothing before the previous kernel is done
  using Tr = V3Traits<T, 1>;
  extern __shared__ __align__(kVecBytes) unsigned char staged_bytes[];  // the row, launch-sized
  __shared__ __align__(8) uint64_t row_arrived;                         // mbarrier
  const Vec<T>* staged = reinterpret_cast<const Vec<T>*>(staged_bytes);
  const Row<T> r = locate_row<T>(p, blockIdx.x, static_cast<int>(blockIdx.y));
  const int num_vecs = r.hidden / Tr::kVecElems;

  if (threadIdx.x == 0) mbarrier_init(&row_arrived, 1);
  __syncthreads();  // the barrier is initialized before anyone waits on it
  if (threadIdx.x == 0) {
    const unsigned row_bytes = static_cast<unsigned>(r.hidden) * sizeof(T);
    mbarrier_arrive_expect_bytes(&row_arrived, row_bytes);
    bulk_copy_to_shared(staged_bytes, r.x, row_bytes, &row_arrived);
  }
  mbarrier_wait(&row_arrived, 0);  // single use: phase 0

  float sum_sq = 0.f;
  for (int vec = threadIdx.x; vec < num_vecs; vec += kV4Threads) {
    float x[Tr::kVecElems];
    unpack<T>(staged[vec], x);
#pragma unroll
    for (int j = 0; j < Tr::kVecElems; ++j) sum_sq += x[j] * x[j];
  }
  const float rstd = rstd_from(block_sum(sum_sq), static_cast<float>(r.hidden), p.eps);
  for (int vec = threadIdx.x; vec < num_vecs; vec += kV4Threads) {
    float x[Tr::kVecElems], w[Tr::kVecElems], y[Tr::kVecElems];
    unpack<T>(staged[vec], x);
    load_weight_vec<T, kHfRounding>(r.w, r.w_is_fp32, vec * Tr::kVecElems, p.weight_offset, w);
#pragma unroll
    for (int j = 0; j < Tr::kVecElems; ++j) y[j] = normalized<T, kHfRounding>(x[j], rstd, w[j]);
    store_x<T, kStreaming>(r.x + vec * Tr::kVecElems, pack<T>(y));
  }
#endif
}

// ------------------------------------------------------------------------------------------
// v5: v4 with x read and written by streaming (evict-first) global accesses, and the bulk copy kept for rows beyond v3's eight-vector limit (32768 bf16 elements) - removes v4's default caching of bytes that are touched once, and its slower bulk-copy path for 8193- to 32768-wide rows
// The kernels above with kStreaming: every byte of x is read once and written once, so its loads
// and stores carry the evict-first policy (LDG/STG.E.EF) and L2 keeps the weights and the lines
// still to come. Measured on the H200 (docs/cross_head_norm.md) next to v4 and to the packed
// conversions alone. The dispatch moves too: since v3 keeps its row packed (64 registers at eight
// vectors per thread), it beat the bulk copy at 32768-wide rows on the H200 (27.8 against
// 30.7 us, 512 tokens), so v5 runs v3 up to its eight-vector limit and v4's kernel only beyond.
// ------------------------------------------------------------------------------------------
// v6: v5 as a programmatic dependent launch (as qk_norm v6): its CTAs become resident while the previous kernel finishes and wait in hardware (griddepcontrol) for its writes - removes the launch gap between back-to-back kernels from each call
// The kernels above with kProgrammatic, launched with the programmatic-stream-serialization
// attribute (launch_kernel and after_prior_grids in include/common.cuh say how it stays correct).
// One CTA per row means one wave per ~500 rows: at 2048 tokens x 8192 a call is about eight
// waves, and the gap between one call's last wave and the next call's first is a few percent of
// it. The v2 fallback (misaligned rows) stays a plain launch. Measured on the H200:
// docs/cross_head_norm.md.
// ------------------------------------------------------------------------------------------
// v7: v6 with, at batches whose rows fill every SM, four-warp CTAs holding up to eight vectors per thread (v3's rule, the fewest vectors per thread in CTAs of up to 512 threads, kept for smaller batches) - removes v6's 64 KiB in flight per SM at wide rows (four 512-thread CTAs of 16-32 bytes per thread) where the register file holds twice that
// v3's kernel again, launched as v6 is; only the vectors per thread change. v3 picks the fewest
// vectors per thread that fit the wider row in 512 threads: at 8192 bf16 that is two (32 bytes in
// flight per thread), four 32-register CTAs per SM, 64 KiB in flight. A thread that holds more
// of the row issues more loads before the block sum waits on them: at four warps per CTA and
// eight vectors per thread, eight 64-register CTAs fit an SM, 128 KiB in flight, and each block
// sum waits on 4 warps instead of 16. That pays when every SM is kept full; when the rows do not
// fill the GPU once (decode, a few hundred tokens), a call is one wave whose length is one
// thread's serial loads and stores, so v3's shorter threads stay. Measured on the H200 with the
// bench harness before it became a version (CTAs of 128, 256 and up to 512 threads at 1024 to
// 8192 tokens): docs/cross_head_norm.md.
// ------------------------------------------------------------------------------------------
constexpr int kV7Warps = 4;  // per CTA where the rows fill the GPU
constexpr int kV7Threads = kV7Warps * kWarpSize;
static_assert(valid_block_size<kV7Threads> && kV7Threads <= kV3MaxThreads, "v7: whole warps within v3's bound");

// ------------------------------------------------------------------------------------------
// v8: v7 with, at narrow rows (up to 256 vectors, 2048 bf16 elements) and many tokens, one warp per token: q's row then k's, four tokens per CTA, no block barrier - removes v7's two small CTAs per token there (tensor-parallel shards, small models), whose dispatch, not their bytes, set the time
// grid.x: ceil(T / kV8Warps); warp w of CTA b normalizes token b * kV8Warps + w: lane l holds
// vectors l, l + 32, ... of the row (kVecsPerLane slots, the wider row's count), a warp sum gives
// its rstd, and the warp goes on to the token's k row. A CTA is kV8Warps tokens, 2 * kV8Warps of
// v7's CTAs. Wider rows, and batches too small to hide a warp's serial work, run v7.
// Why: v7 launches a CTA per row, 2T CTAs. At MiniMax-M2's TP=8 shard (768 + 128 bf16) a q row is
// 1.5 KiB and a k row 256 bytes, so each CTA lives for a few hundred cycles and the GPU runs out
// of CTA launches before bandwidth: 16384 tokens took 40.6 us under v7 (35 % of copy; ncu: 50 %
// achieved occupancy of 98 % theoretical) and 19.3 us here (72 %). v5's plain launch of the same
// kernel took 24.3: each programmatically launched CTA also waits on griddepcontrol, which is
// free for a few thousand CTAs and not for 32768. Measured on the H200: docs/cross_head_norm.md.
// Tried and dropped (16384 tokens, 768 + 128): the weight lines prefetched into L1 beside the
// loads (40.7 us), all of a lane's weights loaded into registers before its stores (22.3 us), and
// q's and k's rows loaded together, two sums at once (35.6 us). None helped at one token either.
// ------------------------------------------------------------------------------------------
constexpr int kV8Warps = 4;
constexpr int kV8Threads = kV8Warps * kWarpSize;
constexpr int kV8MaxVecsPerLane = 8;  // 8 x 16 bytes = 32 registers of row per lane, as v3's thread
constexpr int kV8MaxVecs = kV8MaxVecsPerLane * kWarpSize;
// Below this many tokens per 16-byte vector of a token (q's and k's together), v7 is faster: a
// warp works through its token's vectors serially and too few warps are resident to hide that
// (crossovers measured on the H200 between 1024 and 2048 tokens at 768 + 128 bf16, near 4096 at
// 2048 + 256, and above 4096 at 1024 + 1024: docs/cross_head_norm.md).
constexpr int kV8TokensPerVector = 18;
static_assert(valid_block_size<kV8Threads>, "v8: whole warps, at most 1024 threads");

template <typename T, int kVecsPerLane, bool kHfRounding>
__global__ void __launch_bounds__(kV8Threads) cross_head_norm_v8_kernel(Params p) {
  static_assert(kVecsPerLane >= 1 && kVecsPerLane <= kV8MaxVecsPerLane, "a lane holds 1..8 vectors");
  after_prior_grids();  // launched as v6 and v7 are
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kV8Warps + threadIdx.x / kWarpSize;
  if (token >= p.num_tokens) return;  // a whole warp leaves: nothing below waits on other warps
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int tensor = kQ; tensor < kNumTensors; ++tensor) {
    const Row<T> r = locate_row<T>(p, token, tensor);
    Vec<T> x[kVecsPerLane];
    const float sum_sq = load_row_vectors<T, kVecsPerLane, true>(r, lane, kWarpSize, x);
    const float rstd = rstd_from(warp_sum(sum_sq), static_cast<float>(r.hidden), p.eps);
    store_row_vectors<T, kVecsPerLane, kHfRounding, true>(r, lane, kWarpSize, x, rstd, p.weight_offset);
  }
}

// ------------------------------------------------------------------------------------------
// v9: v8 with, where q and k are views of one tensor of token rows (a fused qkv projection) and the rows fill the GPU at least three times, the CTAs of a token's q row and k row launched next to each other instead of all q rows before all k rows - removes v8's sparse streams over the fused rows: the rows in flight together now lie side by side in memory (at q, k and v 8192 bf16 wide, 32 KiB of every 48 KiB instead of 16)
// v7's kernels (v8's warp-per-token kernel already takes q's row and then k's), with v3's kernel
// launched on a 1-D grid of (token, tensor) pairs (kTokenMajor) where q and k share a token
// stride wider than either row: views of one tensor of token rows, whose q and k rows of a token
// lie within one stride. The block scheduler hands out CTAs in grid order, so the grid's order
// is the order in which the rows stream through DRAM. On the (tokens, 2) grid of v2-v8 every q
// row comes before every k row: at q, k, v 8192 wide the CTAs in flight read 16 KiB of every
// 48 KiB, and at q 6144, k 1024, v 1024 the k half of the call reads 2 KiB of every 16. With a
// token's two CTAs adjacent, the rows in flight cover 32 KiB of every 48, and 14 of every 16.
// Only where the call is kV9MinWaves waves or more of resident CTAs: in a call of one or two
// waves with unequal widths, the (tokens, 2) grid starts every long q CTA first and the short k
// CTAs fill the tail, while the paired grid leaves q CTAs to start late (1024 x 5120/1024, 1.9
// waves: 8.91 -> 9.19 us; kV9MinWaves lies between that and the 3.9 waves of 2048 x 8192,
// which gained). Separate, packed q and k stay on the (tokens, 2) grid: each tensor's rows
// already follow each other there, and pairing them measured slower at 8192 x 8192 (93.6
// against 95.6 % of the copy). Measured on the H200 with the bench harness:
// docs/cross_head_norm.md.
// ------------------------------------------------------------------------------------------
constexpr int kV9MinWaves = 3;
static_assert(kV9MinWaves >= 1, "v9: at least the one wave that v7 requires");

// ------------------------------------------------------------------------------------------
// v10: v9 with, at calls of fewer than three waves of CTAs (decode and small batches), each thread's weight vectors loaded with its row (issued just before it), before the block sum, and held in registers until the store - removes the weight loads that v3-v9 issue after the reduction: a memory round trip on the critical path of every CTA, which only calls of many waves hide
// v3's kernel with kWeightsWithRow: the loads of a thread's row and of its weights are issued
// together, so the weights' latency hides under the row's, and after the block sum only the
// arithmetic and the stores are left. Found in tp_qk_norm's decode kernel first (its v10):
// clock64 stamps showed the weight loads after the exchange as long as the row's own loads,
// although their lines had been prefetched into L1. A CTA's life here is the same chain (load
// x, block sum, load w, store), and in a call of one or two waves every CTA's chain is on the
// call's critical path; at many waves other CTAs' loads fill the gap, and the held weights
// would only cost registers (v3's kernel with the weights in registers before the block sum
// measured 37.6-38.0 us against v8's 37.3 at 2048 x 8192, 3.9 waves). So v10 holds them below
// kV9MinWaves waves (where v9 keeps the (tokens, 2) grid), and only up to kV10MaxHeldVecs
// vectors per thread: 4 vectors of bf16 row and 4 of fp32 weights are 48 registers of payload.
// ------------------------------------------------------------------------------------------
constexpr int kV10MaxHeldVecs = 4;
static_assert(kV10MaxHeldVecs <= kV3MaxVecsPerThread, "v10 holds at most v3's vectors per thread");

// ------------------------------------------------------------------------------------------
// v11: v10 with, at calls of one to three waves of CTAs, each CTA warming into L2 the row of the CTA a wave after it once its own row's loads are issued - removes the DRAM round trip that every CTA of the later waves waited for before its block sum
// v3's kernel with kWarmAhead (and, at up to kV10MaxHeldVecs vectors per thread, v10's held
// weights): p.rows_ahead is the launch's resident CTAs, so the row warmed is the one that a CTA
// of the next wave will take, and that CTA finds it in L2. One prefetch.global.L2 per 128-byte
// line, spread over the block, issued after the CTA's own loads; no register is held for it.
// Only where v9 keeps the (tokens, 2) grid, below kV9MinWaves waves: with many waves the CTAs in
// flight alone keep the DRAM busy, and a second request per line costs (bench harness, a probe
// not kept in the repository, H100, us, v10 -> v10 with the warm at every size): 1024 x 4096 (1.9 waves) 13.48 ->
// 12.72, 1024 x 5120/1024 11.05 -> 10.21, 4096 x 6144/1024 42.03 -> 41.39, but 2048 x 8192 (3.9
// waves) 48.95 -> 49.73 and 8192 x 8192 186.2 -> 189.0; H200, v10 -> v11: 1024 x 4096 10.33 ->
// 9.53 (77.3 -> 83.8 % of the copy, past a same-size copy_'s 81 %), 1024 x 5120/1024 8.96 ->
// 8.62. docs/cross_head_norm.md has the H200 page.
// ------------------------------------------------------------------------------------------
// v12: v11 with, on v9's token-major grid, v3's kernel compiled for its four-warp CTA (the block size a compile-time constant, also where v7 launches fewer threads) - removes the run-time block size from the address and the bound of every vector a thread loads and stores, in the calls that move the most bytes
// v3's kernel with kBlockThreads = kV7Threads where v9 launches it on the (token, tensor) grid
// (fused q and k views, kV9MinWaves waves or more) and kV7Threads threads hold the wider row at
// the kernel's vectors per thread (float32 rows past 4096 elements keep v9's larger block, set at
// run time). v3-v11 stride a thread's vectors by
// blockDim.x, a value the compiler only sees at run time, so each of up to eight vectors needs its
// own address and bound arithmetic; with the block size a constant, a thread's vectors are its
// first address plus fixed offsets. v7 sizes the block to the wider row (96 threads at 6144
// bf16 elements and 8 vectors each); v12 launches kV7Threads there too, and the vectors past the
// row's end stay unused, as they do for the narrower tensor. Measured on the H200 (bench harness,
// the kernel built as an experiment next to v11, two alternating runs, % of the copy, v11 -> v12):
// 2048 x 8192 87.1 -> 87.5, 8192 x 8192 93.8-93.9 -> 94.5, 4096 x 6144/1024 88.9-89.5 -> 90.2-90.4.
// docs/cross_head_norm.md has the sweep.
// ------------------------------------------------------------------------------------------
// v13: v12 with, at calls of a wave of CTAs or more that move at most 192 MiB, the first CTAs in grid order (2 MiB of rows) warming their own row into L2 before the programmatic wait - removes part of each call's start: the first wave's DRAM round trip, begun while the previous kernel drains
// A programmatic launch's CTAs become resident while the previous kernel's last CTAs run (v6),
// and until now they sat in griddepcontrol.wait with nothing in flight; the first wave then
// asked for its rows all at once, and no CTA could store before its whole row had come back
// (a per-CTA timeline of v11 at 2048 x 8192: 3.7-4.1 us to the first complete row). Here those
// CTAs issue one prefetch.global.L2 per line of their own row before the wait; the loads after
// it find the lines in L2 or on their way. Safe whoever writes x (warm_l2: a hint that returns
// nothing; later stores update the line in L2). Only the first kV13WarmBytes of rows, and only
// in calls of at most kV13MaxCallBytes: measured on the H200 (bench harness, the kernel built as
// an experiment next to v12 with the budget set at run time, two runs, % of the copy, v12 -> v13
// with 1 / 2 / 4 MiB of rows warmed):
//   1024 x 5120/1024 (24 MiB moved)        70.3 -> 74.5 / 77.2 / 72.0
//   1024 x 8192/1024 (36 MiB)              75.1 -> 78.1 / 80.8 / 80.1
//   1500 x 5120/1024 (35 MiB)              73.6 -> 76.0 / 76.3 / 71.9
//   1024 x 4096 (32 MiB)                   85.4 -> 85.1 / 87.3 / 87.1
//   4096 x 6144/1024 (112 MiB)             90.4 -> 90.9 / 91.2 / 92.3
//   2048 x 8192 (128 MiB)                  87.9 -> 88.6 / 88.7 / 88.9
//   4096 x 8192 (256 MiB)                  92.2 -> 92.2 / -    / 92.0
//   12288 x 4096 (384 MiB)                 93.0 -> 92.9 / -    / 92.3
//   8192 x 8192 (512 MiB)                  94.5 -> 94.2 / 94.1 / 93.6
// An earlier run warmed 8 MiB and a whole wave: 1024 x 4096 80.0 and 79.9, 2048 x 8192 88.4 and
// 85.6, 8192 x 8192 93.1 and 92.2: past a few MiB the prefetches delay the end of the call they
// overlap (a stamped probe, docs/cross_head_norm.md), and 2 MiB is the budget that gained at
// every call up to 128 MiB. The calls of 256 MiB and more lost at any budget, most at the
// largest; why is not known (the stamped probe could not show it), so kV13MaxCallBytes sits
// between the gains and the losses.
// ------------------------------------------------------------------------------------------
constexpr int64_t kV13WarmBytes = int64_t{2} << 20;
constexpr int64_t kV13MaxCallBytes = int64_t{192} << 20;
static_assert(kV13WarmBytes < kV13MaxCallBytes, "v13 warms a part of a call's rows");

// v13's p.warm_first_ctas: the CTAs, first in grid order, whose rows add up to at most
// kV13WarmBytes (on the (token, tensor) grid a token's q row then its k row; on the (tokens, 2)
// grid every q row before the first k row), at most the `resident` CTAs of one wave (those that
// can be waiting while the previous kernel drains); none in calls that move (read and write)
// more than kV13MaxCallBytes.
template <typename T, bool kTokenMajor>
inline int64_t v13_warm_ctas(const Params& p, int64_t resident) {
  const int64_t q_row_bytes = static_cast<int64_t>(p.q_hidden) * sizeof(T);
  const int64_t k_row_bytes = static_cast<int64_t>(p.k_hidden) * sizeof(T);
  if (2 * p.num_tokens * (q_row_bytes + k_row_bytes) > kV13MaxCallBytes) return 0;
  int64_t ctas = 0;
  if constexpr (kTokenMajor) {
    const int64_t tokens = kV13WarmBytes / (q_row_bytes + k_row_bytes);
    ctas = kNumTensors * tokens + (kV13WarmBytes - tokens * (q_row_bytes + k_row_bytes) >= q_row_bytes ? 1 : 0);
  } else {
    const int64_t q_rows_in_budget = kV13WarmBytes / q_row_bytes;
    const int64_t q_rows = q_rows_in_budget < p.num_tokens ? q_rows_in_budget : p.num_tokens;
    ctas = q_rows + (q_rows == p.num_tokens ? (kV13WarmBytes - q_rows * q_row_bytes) / k_row_bytes : 0);
  }
  return ctas < resident ? ctas : resident;
}

// ------------------------------------------------------------------------------------------
// v14: v13 with, on the (tokens, 2) grid, rows of 4097 to 8192 bf16 elements with q and k within 2x of each other in width launched in v3's CTA (512 threads x 2 vectors at 8192) instead of v7's four warps x 8 vectors, with v13's warm and without v11's warm-ahead - removes half of v7's 128 KiB per SM requested at once, which in calls of one to a few waves arrives, and then is stored, as one burst per wave (1536 x 8192: 74 -> 85 % of the copy)
// v7 moved wide rows from v3's CTA (512 threads x 2 vectors at 8192 bf16: four CTAs and 64 KiB
// of rows in flight per SM) to four warps x 8 vectors (eight CTAs, 128 KiB), measured at 2048 and
// 8192 tokens on the bench's fused layout, where it gained at 8192. In calls of one to a few
// waves, and on separate q and k tensors, it loses. Every CTA of a wave asks for its whole row at
// once and none can store before its row is back (v11's per-CTA timeline at 2048 x 8192: 3.7-4.1
// us to the first complete row, then 3.5-4.1 us of first-wave stores against 0.8-1.5 later), so
// a wave's reads and then its writes come as bursts, most likely twice as long at 128 KiB per SM
// as at 64 KiB. Measured on the H200 (bench harness, probes not kept in the repository, two runs each, % of the copy,
// v13 -> v3's CTA with v13's warm; fused = q and k views of one qkv tensor, the bench's layout):
//   768 x 8192 (1.5 waves of v7's CTAs)     fused 72.7 -> 80.5    separate 74.2 -> 83.6
//   1024 x 8192                             fused 77.5 -> 83.0    separate 76.6 -> 87.8
//   1536 x 8192                             fused 75.3 -> 85.0    separate 74.7 -> 90.1
//   1024 x 7168                             fused 75.2 -> 81.3    separate 76.1 -> 86.7
//   2048 x 8192 (3.9 waves)                 fused: v9's grid      separate 89.4 -> 91.9
//   3072 x 8192                             fused: v9's grid      separate 92.3 -> 93.5
//   1024 x 6144/1024 (GQA)                  fused 80.7 -> 73.7    separate 80.6 -> 74.0
// The GQA row is why q and k must be alike: v3's CTA is sized to the wider row, and at k rows a
// sixth as wide most of its threads idle in every k CTA (2048 x 6144/1024 separate: 82.8 ->
// 77.8). kV14MaxWidthRatio bounds the idle share at half. On v9's token-major grid (fused views,
// three waves or more) v13's kernels stay: there v3's CTA measured 87.2 against 88.1 at 2048 x
// 8192. 4096 bf16 rows and narrower keep v7's CTA (v6's 512 x 1 CTA measured 70-82 % against
// v7's 74-92 % at 1024-8192 x 4096). docs/cross_head_norm.md has the sweep.
// ------------------------------------------------------------------------------------------
constexpr int kV14VecsPerThread = 2;
constexpr int kV14MaxWidthRatio = 2;  // the wider row at most twice the narrower
static_assert(kV14VecsPerThread * kV3MaxThreads == kV3MaxVecsPerThread * kV7Threads,
              "v14 takes the rows that v7's CTA holds at its most vectors per thread, in v3's largest CTA");
static_assert(kV14MaxWidthRatio >= 1, "v14: a width ratio, wider over narrower");

// Whether v14 launches v3's CTA instead of v7's: the wider row too wide for kV7Threads threads
// at half of v3's most vectors per thread (so v7 takes its eight-vector kernel), held in up to
// kV3MaxThreads threads at kV14VecsPerThread vectors each, and q and k within kV14MaxWidthRatio
// of each other.
template <typename T>
inline bool v14_takes_v3_cta(const Params& p, int widest_vecs) {
  const int narrowest_vecs = (p.q_hidden < p.k_hidden ? p.q_hidden : p.k_hidden) / Vec<T>::kElems;
  return widest_vecs > kV7Threads * (kV3MaxVecsPerThread / 2) && widest_vecs <= kV3MaxThreads * kV14VecsPerThread &&
         widest_vecs <= kV14MaxWidthRatio * narrowest_vecs;
}

// ------------------------------------------------------------------------------------------
// Launchers (host). `launch` is what the binding calls.
// ------------------------------------------------------------------------------------------
inline dim3 token_tensor_grid(const Params& p) {
  return dim3(static_cast<unsigned>(p.num_tokens), kNumTensors);
}

template <typename T, bool kHfRounding>
inline void launch_v1(const Params& p, cudaStream_t stream) {
  cross_head_norm_v1_kernel<T, kHfRounding><<<static_cast<unsigned>(p.num_tokens), kV1Threads, 0, stream>>>(p);
}

template <typename T, bool kHfRounding>
inline void launch_v2(const Params& p, cudaStream_t stream) {
  cross_head_norm_v2_kernel<T, kHfRounding><<<token_tensor_grid(p), kV2Threads, 0, stream>>>(p);
}

// v3's block: enough threads for the wider row at `vecs_per_thread` vectors each, whole warps
// (block_sum needs them).
inline int v3_threads(int widest_vecs, int vecs_per_thread) {
  const int threads_needed = (widest_vecs + vecs_per_thread - 1) / vecs_per_thread;
  return (threads_needed + kWarpSize - 1) / kWarpSize * kWarpSize;
}

// kBlockThreads (v12): launched at that many threads, which must hold the wider row at
// kVecsPerThread vectors each (the caller checks). kWarmOwnRow (v13): v13_warm_ctas sets how many
// CTAs warm their row before the wait.
template <typename T, int kVecsPerThread, bool kHfRounding, bool kStreaming, bool kProgrammatic,
          bool kTokenMajor = false, bool kWeightsWithRow = false, bool kWarmAhead = false, int kBlockThreads = 0,
          bool kWarmOwnRow = false>
inline void launch_v3_fixed(const Params& params, int widest_vecs, cudaStream_t stream) {
  static_assert(!kWarmOwnRow || kProgrammatic, "v13 warms while a programmatic launch waits");
  constexpr auto kernel = cross_head_norm_v3_kernel<T, kVecsPerThread, kHfRounding, kStreaming, kProgrammatic,
                                                    kTokenMajor, kWeightsWithRow, kWarmAhead, kBlockThreads, kWarmOwnRow>;
  const int threads = kBlockThreads > 0 ? kBlockThreads : v3_threads(widest_vecs, kVecsPerThread);
  Params p = params;
  if constexpr (kWarmAhead || kWarmOwnRow) {
    const int resident = persistent_grid_limit<kernel>(threads);  // a wave of CTAs
    if constexpr (kWarmAhead) p.rows_ahead = resident;             // v11
    p.warm_first_ctas = kWarmOwnRow ? v13_warm_ctas<T, kTokenMajor>(p, resident) : 0;
  } else {
    p.warm_first_ctas = 0;
  }
  const dim3 grid = kTokenMajor ? dim3(static_cast<unsigned>(p.num_tokens * kNumTensors)) : token_tensor_grid(p);
  launch_kernel(kProgrammatic, kernel, grid, dim3(threads), 0, stream, p);
}

// The 16-byte path needs every row and both weights to start on 16-byte boundaries.
template <typename T>
inline bool vector_aligned(const Params& p) {
  constexpr int kVecElems = Vec<T>::kElems;
  return is_aligned(p.q, kVecBytes) && is_aligned(p.k, kVecBytes) && is_aligned(p.q_weight, kVecBytes) &&
         is_aligned(p.k_weight, kVecBytes) && p.q_token_stride % kVecElems == 0 && p.k_token_stride % kVecElems == 0 &&
         p.q_hidden % kVecElems == 0 && p.k_hidden % kVecElems == 0;
}

// For v7: launches v3's kernel at kVecsPerThread vectors per thread if the call's rows fill every
// SM's resident CTAs of it at least once; returns whether it did.
// kTokenMajor (v9): on the (token, tensor) grid where the rows fill the GPU kV9MinWaves times.
// kWeightsWithRow (v10): below kV9MinWaves waves, the kernel that loads the weights with the row
// (at most kV10MaxHeldVecs vectors per thread). kWarmAhead (v11): below kV9MinWaves waves, the
// kernels that warm the row a wave ahead. kFixedBlock (v12): on the token-major grid, the kernel
// compiled for kV7Threads threads. kWarmOwnRow (v13): every kernel here warms the first CTAs'
// rows before the wait (v13_warm_ctas). kV3BlockForLikeRows (v14): off v9's token-major grid,
// v3's CTA where v14_takes_v3_cta says so.
template <typename T, int kVecsPerThread, bool kHfRounding, bool kTokenMajor = false, bool kWeightsWithRow = false,
          bool kWarmAhead = false, bool kFixedBlock = false, bool kWarmOwnRow = false, bool kV3BlockForLikeRows = false>
inline bool launch_v7_if_rows_fill_gpu(const Params& p, int widest_vecs, cudaStream_t stream) {
  constexpr auto kernel = cross_head_norm_v3_kernel<T, kVecsPerThread, kHfRounding, true, true>;
  constexpr auto token_major_kernel = cross_head_norm_v3_kernel<T, kVecsPerThread, kHfRounding, true, true, true>;
  constexpr bool kHeld = kWeightsWithRow && kVecsPerThread <= kV10MaxHeldVecs;
  const int threads = v3_threads(widest_vecs, kVecsPerThread);
  const int64_t rows = p.num_tokens * kNumTensors;
  if (rows < persistent_grid_limit<kernel>(threads)) return false;
  const bool many_waves = rows >= kV9MinWaves * static_cast<int64_t>(persistent_grid_limit<token_major_kernel>(threads));
  if (kTokenMajor && many_waves) {
    // v12: kV7Threads threads where they hold the wider row at kVecsPerThread vectors each (float32
    // rows past 4096 elements need more: v3_threads' block, at run time, as in v9). The waves are
    // counted with v9's kernel, as in v11: v12 changes the kernel, not where it runs.
    if (kFixedBlock && widest_vecs <= kV7Threads * kVecsPerThread) {
      launch_v3_fixed<T, kVecsPerThread, kHfRounding, true, true, true, false, false, kFixedBlock ? kV7Threads : 0,
                      kWarmOwnRow>(p, widest_vecs, stream);
    } else {
      launch_v3_fixed<T, kVecsPerThread, kHfRounding, true, true, true, false, false, 0, kWarmOwnRow>(p, widest_vecs,
                                                                                                    stream);
    }
    return true;
  }
  if constexpr (kV3BlockForLikeRows && kVecsPerThread == kV3MaxVecsPerThread) {
    static_assert(kWarmOwnRow, "v14 builds on v13");
    if (v14_takes_v3_cta<T>(p, widest_vecs)) {
      launch_v3_fixed<T, kV14VecsPerThread, kHfRounding, true, true, false, false, false, 0, true>(p, widest_vecs,
                                                                                                stream);
      return true;
    }
  }
  if (!many_waves) {
    if constexpr (kHeld) {
      launch_v3_fixed<T, kVecsPerThread, kHfRounding, true, true, false, true, kWarmAhead, 0, kWarmOwnRow>(
          p, widest_vecs, stream);
      return true;
    }
    if constexpr (kWarmAhead) {
      launch_v3_fixed<T, kVecsPerThread, kHfRounding, true, true, false, false, true, 0, kWarmOwnRow>(p, widest_vecs,
                                                                                                    stream);
      return true;
    }
  }
  launch_v3_fixed<T, kVecsPerThread, kHfRounding, true, true, false, false, false, 0, kWarmOwnRow>(p, widest_vecs,
                                                                                                 stream);
  return true;
}

// v3's rule (the fewest vectors per thread in CTAs of up to kV3MaxThreads): with kWeightsWithRow
// (v10), the kernel that loads the weights with the row where the call's rows are all resident
// at once with it. Its extra registers must not cost a wave: at 256 x 8192 bf16 (512 CTAs of 512
// threads, 2 vectors each) they take 48 registers, 2 CTAs per SM instead of 4, and the call
// measured 6.94 us against v9's 5.76 (H200, bench harness).
template <typename T, int kVecsPerThread, bool kHfRounding, bool kStreaming, bool kProgrammatic, bool kWeightsWithRow>
inline void launch_v3_below_a_wave(const Params& p, int widest_vecs, cudaStream_t stream) {
  if constexpr (kWeightsWithRow && kVecsPerThread <= kV10MaxHeldVecs) {
    constexpr auto held = cross_head_norm_v3_kernel<T, kVecsPerThread, kHfRounding, kStreaming, kProgrammatic, false, true>;
    if (p.num_tokens * kNumTensors <= persistent_grid_limit<held>(v3_threads(widest_vecs, kVecsPerThread))) {
      return launch_v3_fixed<T, kVecsPerThread, kHfRounding, kStreaming, kProgrammatic, false, true>(p, widest_vecs,
                                                                                                     stream);
    }
  }
  launch_v3_fixed<T, kVecsPerThread, kHfRounding, kStreaming, kProgrammatic>(p, widest_vecs, stream);
}

// The fewest vectors per thread that fit the wider row in one CTA of at most kV3MaxThreads
// threads; rows wider than kV3MaxVecsPerThread vectors per thread stream through v2.
// kFillGpu (v7): first, where the rows fill the GPU, the vectors per thread that fit the wider
// row in kV7Threads threads (at most kV3MaxVecsPerThread). kTokenMajor (v9): those on the
// (token, tensor) grid where the rows fill the GPU kV9MinWaves times.
template <typename T, bool kHfRounding, bool kStreaming = false, bool kProgrammatic = false, bool kFillGpu = false,
          bool kTokenMajor = false, bool kWeightsWithRow = false, bool kWarmAhead = false, bool kFixedBlock = false,
          bool kWarmOwnRow = false, bool kV3BlockForLikeRows = false>
inline void launch_v3(const Params& p, cudaStream_t stream) {
  const int widest = p.q_hidden > p.k_hidden ? p.q_hidden : p.k_hidden;
  if (vector_aligned<T>(p)) {
    const int widest_vecs = widest / Vec<T>::kElems;
    if constexpr (kFillGpu) {
      static_assert(kStreaming && kProgrammatic, "v7 builds on v6");
      const int vecs = (widest_vecs + kV7Threads - 1) / kV7Threads;  // per thread, at kV7Threads threads
      const bool fits = widest <= V3Traits<T, kV3MaxVecsPerThread>::kMaxHidden;  // else v2, below
      constexpr bool kW = kWeightsWithRow, kA = kWarmAhead, kF = kFixedBlock, kO = kWarmOwnRow, kL = kV3BlockForLikeRows;
      if (vecs == 2 && launch_v7_if_rows_fill_gpu<T, 2, kHfRounding, kTokenMajor, kW, kA, kF, kO>(p, widest_vecs, stream)) return;
      if (vecs > 2 && vecs <= 4 && launch_v7_if_rows_fill_gpu<T, 4, kHfRounding, kTokenMajor, kW, kA, kF, kO>(p, widest_vecs, stream)) return;
      if (vecs > 4 && fits && launch_v7_if_rows_fill_gpu<T, kV3MaxVecsPerThread, kHfRounding, kTokenMajor, kW, kA, kF, kO, kL>(p, widest_vecs, stream)) {
        return;
      }
    }
    constexpr bool kW = kWeightsWithRow;
    if (widest <= V3Traits<T, 1>::kMaxHidden) return launch_v3_below_a_wave<T, 1, kHfRounding, kStreaming, kProgrammatic, kW>(p, widest_vecs, stream);
    if (widest <= V3Traits<T, 2>::kMaxHidden) return launch_v3_below_a_wave<T, 2, kHfRounding, kStreaming, kProgrammatic, kW>(p, widest_vecs, stream);
    if (widest <= V3Traits<T, 4>::kMaxHidden) return launch_v3_below_a_wave<T, 4, kHfRounding, kStreaming, kProgrammatic, kW>(p, widest_vecs, stream);
    if (widest <= V3Traits<T, 8>::kMaxHidden) return launch_v3_fixed<T, 8, kHfRounding, kStreaming, kProgrammatic>(p, widest_vecs, stream);
  }
  launch_v2<T, kHfRounding>(p, stream);  // general path: any even width, any alignment
}

// v4's shared memory for the wider row, or 0 where v4 cannot run here: a GPU before sm_90 (no
// bulk copies), rows v3's vector path would not take, or a row wider than the per-CTA shared
// memory opt-in limit (227 KiB on H100/H200) minus the kernel's static shared memory.
template <typename T, bool kHfRounding, bool kStreaming, bool kProgrammatic>
inline size_t v4_shared_bytes(const Params& p) {
  constexpr auto kernel = cross_head_norm_v4_kernel<T, kHfRounding, kStreaming, kProgrammatic>;
  static size_t limit[kMaxDevices] = {};  // per device: 0 = not queried yet, 1 = no v4 here
  int device = 0;
  cudaGetDevice(&device);
  if (device >= kMaxDevices) return 0;
  if (limit[device] == 0) {
    int major = 0, optin = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    cudaFuncAttributes attributes{};
    cudaFuncGetAttributes(&attributes, kernel);
    const size_t dynamic = static_cast<size_t>(optin) - attributes.sharedSizeBytes;
    const bool usable = major >= 9 && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                           static_cast<int>(dynamic)) == cudaSuccess;
    limit[device] = usable ? dynamic : 1;
  }
  const int widest = p.q_hidden > p.k_hidden ? p.q_hidden : p.k_hidden;
  const size_t row_bytes = static_cast<size_t>(widest) * sizeof(T);
  return vector_aligned<T>(p) && row_bytes <= limit[device] && limit[device] > 1 ? row_bytes : 0;
}

// kStreaming: v5, streaming accesses to x in both kernels, and v3 for every row it holds in
// registers (up to kV3MaxVecsPerThread vectors per thread) where v4 stops at two vectors.
// kProgrammatic: v6, v5's kernels launched programmatically.
// kFillGpu: v7, v6 with v3's vectors per thread picked for the row count.
// kTokenMajor: v9, v7's kernels on the (token, tensor) grid where the rows fill the GPU kV9MinWaves times.
template <typename T, bool kHfRounding, bool kStreaming = false, bool kProgrammatic = false, bool kFillGpu = false,
          bool kTokenMajor = false, bool kWeightsWithRow = false, bool kWarmAhead = false, bool kFixedBlock = false,
          bool kWarmOwnRow = false, bool kV3BlockForLikeRows = false>
inline void launch_v4(const Params& p, cudaStream_t stream) {
  constexpr int kWidestForV3 = kStreaming ? V3Traits<T, kV3MaxVecsPerThread>::kMaxHidden : V3Traits<T, 2>::kMaxHidden;
  const int widest = p.q_hidden > p.k_hidden ? p.q_hidden : p.k_hidden;
  const size_t shared_bytes = widest > kWidestForV3 ? v4_shared_bytes<T, kHfRounding, kStreaming, kProgrammatic>(p) : 0;
  if (shared_bytes == 0) {
    return launch_v3<T, kHfRounding, kStreaming, kProgrammatic, kFillGpu, kTokenMajor, kWeightsWithRow, kWarmAhead,
                     kFixedBlock, kWarmOwnRow, kV3BlockForLikeRows>(p, stream);
  }
  constexpr auto kernel = cross_head_norm_v4_kernel<T, kHfRounding, kStreaming, kProgrammatic>;
  launch_kernel(kProgrammatic, kernel, token_tensor_grid(p), dim3(kV4Threads), shared_bytes, stream, p);
}

// v8's dispatch: rows of at most kV8MaxVecs vectors (16-byte aligned) at batches of at least
// kV8TokensPerVector tokens per vector of a token (q's and k's) run the warp-per-token kernel at
// the fewest vectors per lane that hold the wider row; the rest run v7 (kTokenMajor: v9's grid).
template <typename T, bool kHfRounding, bool kTokenMajor = false, bool kWeightsWithRow = false, bool kWarmAhead = false,
          bool kFixedBlock = false, bool kWarmOwnRow = false, bool kV3BlockForLikeRows = false>
inline void launch_v8(const Params& p, cudaStream_t stream) {
  const int q_vecs = p.q_hidden / Vec<T>::kElems, k_vecs = p.k_hidden / Vec<T>::kElems;
  const int widest_vecs = q_vecs > k_vecs ? q_vecs : k_vecs;
  const bool warp_per_token = vector_aligned<T>(p) && widest_vecs <= kV8MaxVecs &&
                              p.num_tokens >= kV8TokensPerVector * static_cast<int64_t>(q_vecs + k_vecs);
  if (!warp_per_token) {  // v7's kernels
    return launch_v4<T, kHfRounding, true, true, true, kTokenMajor, kWeightsWithRow, kWarmAhead, kFixedBlock,
                     kWarmOwnRow, kV3BlockForLikeRows>(p, stream);
  }
  const dim3 grid(static_cast<unsigned>((p.num_tokens + kV8Warps - 1) / kV8Warps));
  const int vecs_per_lane = (widest_vecs + kWarpSize - 1) / kWarpSize;
  auto go = [&](auto kernel) { launch_kernel(true, kernel, grid, dim3(kV8Threads), 0, stream, p); };
  if (vecs_per_lane == 1) return go(cross_head_norm_v8_kernel<T, 1, kHfRounding>);
  if (vecs_per_lane == 2) return go(cross_head_norm_v8_kernel<T, 2, kHfRounding>);
  if (vecs_per_lane <= 4) return go(cross_head_norm_v8_kernel<T, 4, kHfRounding>);
  return go(cross_head_norm_v8_kernel<T, kV8MaxVecsPerLane, kHfRounding>);
}

// v9's dispatch: v8, with v7's kernels on the (token, tensor) grid where q and k share a token
// stride wider than either row (views of one tensor of token rows), the rows fill the GPU
// kV9MinWaves times (launch_v7_if_rows_fill_gpu) and grid.x has room for every row.
inline bool rows_share_token_stride(const Params& p) {
  return p.q_token_stride == p.k_token_stride && (p.q_token_stride > p.q_hidden || p.k_token_stride > p.k_hidden);
}

// Where v9's (token, tensor) grid may run: rows sharing a token stride, and grid.x room for them
// (tp_qk_norm's v1 kernels take the same grid on the same condition).
inline bool token_major_grid_fits(const Params& p) {
  constexpr int64_t kMaxGridX = 2147483647;  // 2^31 - 1 CTAs along grid.x
  return rows_share_token_stride(p) && p.num_tokens * kNumTensors <= kMaxGridX;
}

// kWeightsWithRow: v10, v9 with the weights loaded with the row below kV9MinWaves waves.
// kWarmAhead: v11, v10 with the row a wave ahead warmed below kV9MinWaves waves.
// kFixedBlock: v12, v11 with the token-major kernel compiled for kV7Threads threads.
// kWarmOwnRow: v13, v12 with the first CTAs' rows warmed before the wait, on either grid.
// kV3BlockForLikeRows: v14, v13 with v3's CTA for wide rows of alike widths on the (tokens, 2) grid.
template <typename T, bool kHfRounding, bool kWeightsWithRow = false, bool kWarmAhead = false, bool kFixedBlock = false,
          bool kWarmOwnRow = false, bool kV3BlockForLikeRows = false>
inline void launch_v9(const Params& p, cudaStream_t stream) {
  constexpr bool kW = kWeightsWithRow, kA = kWarmAhead, kF = kFixedBlock, kO = kWarmOwnRow, kL = kV3BlockForLikeRows;
  if (token_major_grid_fits(p)) return launch_v8<T, kHfRounding, true, kW, kA, kF, kO, kL>(p, stream);
  launch_v8<T, kHfRounding, false, kW, kA, kF, kO, kL>(p, stream);
}

template <typename T, bool kHfRounding>
inline void launch_version(const Params& p, int version, cudaStream_t stream) {
  switch (version) {
    case 1: return launch_v1<T, kHfRounding>(p, stream);
    case 2: return launch_v2<T, kHfRounding>(p, stream);
    case 3: return launch_v3<T, kHfRounding>(p, stream);
    case 4: return launch_v4<T, kHfRounding>(p, stream);
    case 5: return launch_v4<T, kHfRounding, true>(p, stream);
    case 6: return launch_v4<T, kHfRounding, true, true>(p, stream);
    case 7: return launch_v4<T, kHfRounding, true, true, true>(p, stream);
    case 8: return launch_v8<T, kHfRounding>(p, stream);
    case 9: return launch_v9<T, kHfRounding>(p, stream);
    case 10: return launch_v9<T, kHfRounding, true>(p, stream);
    case 11: return launch_v9<T, kHfRounding, true, true>(p, stream);
    case 12: return launch_v9<T, kHfRounding, true, true, true>(p, stream);
    case 13: return launch_v9<T, kHfRounding, true, true, true, true>(p, stream);
    default: return launch_v9<T, kHfRounding, true, true, true, true, true>(p, stream);  // v14
  }
}

template <typename T>
inline void launch_rounding(const Params& p, bool hf_rounding, int version, cudaStream_t stream) {
  if (hf_rounding) {
    launch_version<T, true>(p, version, stream);
  } else {
    launch_version<T, false>(p, version, stream);
  }
}

constexpr int kNumVersions = 14;

// Launches version `version` (1..kNumVersions) on `stream`; returns the launch error, if any.
inline cudaError_t launch(const Params& p, DType dtype, bool hf_rounding, int version, cudaStream_t stream) {
  if (version < 1 || version > kNumVersions) return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: launch_rounding<float>(p, hf_rounding, version, stream); break;
    case DType::kFloat16: launch_rounding<__half>(p, hf_rounding, version, stream); break;
    case DType::kBFloat16: launch_rounding<__nv_bfloat16>(p, hf_rounding, version, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace cookbook::cross_head_norm
