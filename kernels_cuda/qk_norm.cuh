// qk_norm: per-head RMSNorm of q and k, in place, both tensors in one launch.
//
//   per (token, head) row x of length head_dim, float32 accumulation:
//   y = x * rsqrt(mean(x^2) + eps) * (w + weight_offset)
//
// Rows are numbered token-major: row r is token r / (Hq + Hk), head r % (Hq + Hk); heads below Hq
// are q, the rest k. Neighbouring rows are neighbouring memory in a fused qkv tensor.
//
// Versions (cookbook/registry.py is the list; tests/test_cuda_sources.py keeps these lines and
// the registry's leads identical):
// v1: one thread per (token, head) row, the naive port: a warp's loads are head_dim elements apart (uncoalesced)
// v2: one warp per (token, head) with a shuffle reduction: lanes read neighbouring elements (coalesced) - removes v1's scattered loads
// v3: 16-byte vectors held in registers, lanes sized to the head, q and k on a persistent grid with the weights loaded once per thread - removes v2's second read and narrow loads
// v4: a 32-bit row -> (token, head) division where rows < 2^32 - removes most of v3's per-row index arithmetic
// v5: x read and written by streaming (evict-first) global accesses, as qk_norm_rope v5 and cross_head_norm v5 do - removes v4's default caching of bytes that are touched once
// v6: v5 as a programmatic dependent launch (as tp_qk_norm v5): its CTAs become resident while the previous kernel finishes and wait in hardware (griddepcontrol) for its writes - removes the launch gap between back-to-back kernels from each call
// v7: v6 where a call's rows need more than one trip of v6's resident grid but fit in one when each lane group takes two rows: both rows' loads are issued before either is reduced - removes v6's second serial DRAM round trip at mid-size batches (about 180 to 350 tokens of 72 heads on an H200)
// v8: v7 with the row -> (token, head) division done by a multiply-high with a magic number the host computes once per launch - removes the ~20-instruction 32-bit division from every row of every lane
// v9: v8 with, where a call's rows fit in one trip of the grid (decode), a one-trip kernel: a lane group requests its row, then only that row's weight (q's or k's) as 16-byte vectors - removes the loop, the second weight's loads and the q/k select from a decode call's critical path
// v10: v9 with head_dims of a whole number of 16-byte vectors that is not a power of two (80, 96, 160, 192) on the vector path: a row's lane group is padded to the next power of two of lanes, and the lanes past its last vector hold none - removes v9's fall back to v2 (a warp per row, one element per load) at those head_dims, where torch.compile was faster
// v11: v10 with the one-trip kernel at every size: a grid of all the call's rows, which the hardware's block scheduler hands out to SMs as they free a slot - removes the persistent grid's fixed share of rows per SM, which held streaming kernels to 88-90 % of the copy on the H200 where a grid of all rows reached 96-98 %
// v12: v11 with q's and k's weights prefetched into L2 by two lane groups of the first block before the wait, while the previous kernel still runs - removes the weights' DRAM round trip from a decode call, which the one-token probe put at 0.25 of its 1.17 us
// v13: v12 with, at calls of two to eight waves of blocks, each lane group warming into L2 the row a wave of blocks ahead of its own once its row's loads are issued - removes the DRAM round trip that every block of the later waves waited for before its first sum
// v14: v13 with, in calls of at least one wave of v13's blocks, two 16-byte vectors per lane: half as many lanes per row (8 at head_dim 128 in bf16), each doing twice the elements - removes half of the per-row work that every lane of a row repeats (its row's and weight's addresses, predicates, the shuffle sum's steps, rsqrt), which kept the SMs' issue slots about 70 % busy in a memory-bound kernel
//
// Torch-free: raw pointers and element strides (64-bit). bindings/qk_norm.cu is the torch glue.
#pragma once

#include <type_traits>

#include "include/common.cuh"

namespace cookbook::qk_norm {

struct Params {
  void* q;                 // [T, Hq, D], element strides below, last dim contiguous
  void* k;                 // [T, Hk, D]
  const void* q_weight;    // [D], activation dtype or float32
  const void* k_weight;    // [D]
  bool weight_is_fp32;
  int64_t num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  int64_t q_token_stride, q_head_stride;  // in elements
  int64_t k_token_stride, k_head_stride;
  float eps;
  float weight_offset;
  FastDivisor heads_divisor;  // num_q_heads + num_kv_heads, for v8 (`launch` sets it)
  uint32_t rows_ahead;        // v13: a wave of the one-trip grid's rows, how far ahead a lane group warms (the launcher sets it)
};

// One (token, head) row: where it lives and which weight it uses.
template <typename T>
struct Row {
  T* x;
  const void* w;
  bool is_q;
};

// RowIndex: the type of the row -> (token, head) division. int64_t always works; uint32_t (rows
// below 2^32) turns a ~70-instruction 64-bit division into a ~20-instruction one, and
// kFastDivision (v8, uint32_t rows) into a multiply-high, an add and a shift by p.heads_divisor.
// Pointer offsets are 64-bit either way.
template <typename T, typename RowIndex = int64_t, bool kFastDivision = false>
__device__ __forceinline__ Row<T> locate_row(const Params& p, RowIndex row) {
  static_assert(!kFastDivision || std::is_same_v<RowIndex, uint32_t>, "the fast division takes 32-bit rows");
  const RowIndex heads = static_cast<RowIndex>(p.num_q_heads + p.num_kv_heads);
  RowIndex token_index;
  if constexpr (kFastDivision) {
    token_index = p.heads_divisor.divide(row);
  } else {
    token_index = row / heads;
  }
  const int head = static_cast<int>(row - token_index * heads);
  const int64_t token = static_cast<int64_t>(token_index);
  if (head < p.num_q_heads) {
    return {static_cast<T*>(p.q) + token * p.q_token_stride + head * p.q_head_stride, p.q_weight, true};
  }
  const int kv_head = head - p.num_q_heads;
  return {static_cast<T*>(p.k) + token * p.k_token_stride + kv_head * p.k_head_stride, p.k_weight, false};
}

inline int64_t total_rows(const Params& p) {
  return p.num_tokens * (p.num_q_heads + p.num_kv_heads);
}

// ------------------------------------------------------------------------------------------
// v1: one thread per (token, head) row, the naive port: a warp's loads are head_dim elements apart (uncoalesced)
// grid.x: ceil(rows / kV1Threads); thread -> row. Two passes over the row (sum, then write).
// ------------------------------------------------------------------------------------------
constexpr int kV1Threads = 256;

template <typename T, bool kHfRounding>
__global__ void __launch_bounds__(kV1Threads) qk_norm_v1_kernel(Params p, int64_t rows) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (row >= rows) return;  // no barrier or shuffle below: an early exit is safe
  const Row<T> r = locate_row<T>(p, row);
  float sum_sq = 0.f;
  for (int d = 0; d < p.head_dim; ++d) {
    const float x = to_float<T>(r.x[d]);
    sum_sq += x * x;
  }
  const float rstd = rstd_from(sum_sq, static_cast<float>(p.head_dim), p.eps);
  for (int d = 0; d < p.head_dim; ++d) {
    const float w = effective_weight<T, kHfRounding>(load_weight<T>(r.w, p.weight_is_fp32, d), p.weight_offset);
    r.x[d] = normalize<T, kHfRounding>(to_float<T>(r.x[d]), rstd, w);
  }
}

// ------------------------------------------------------------------------------------------
// v2: one warp per (token, head) with a shuffle reduction: lanes read neighbouring elements (coalesced) - removes v1's scattered loads
// grid.x: ceil(rows / kV2WarpsPerBlock); warp -> row, lane -> elements lane, lane + 32, ...
// Works for any head_dim and alignment: it is also v3's general path.
// ------------------------------------------------------------------------------------------
constexpr int kV2WarpsPerBlock = 8;
constexpr int kV2Threads = kV2WarpsPerBlock * kWarpSize;

template <typename T, bool kHfRounding>
__global__ void __launch_bounds__(kV2Threads) qk_norm_v2_kernel(Params p, int64_t rows) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kV2WarpsPerBlock) + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= rows) return;  // uniform per warp: the shuffles below always see a full warp
  const Row<T> r = locate_row<T>(p, row);
  float sum_sq = 0.f;
  for (int d = lane; d < p.head_dim; d += kWarpSize) {
    const float x = to_float<T>(r.x[d]);
    sum_sq += x * x;
  }
  const float rstd = rstd_from(warp_sum(sum_sq), static_cast<float>(p.head_dim), p.eps);
  for (int d = lane; d < p.head_dim; d += kWarpSize) {  // second read: served by L1/L2
    const float w = effective_weight<T, kHfRounding>(load_weight<T>(r.w, p.weight_is_fp32, d), p.weight_offset);
    r.x[d] = normalize<T, kHfRounding>(to_float<T>(r.x[d]), rstd, w);
  }
}

// ------------------------------------------------------------------------------------------
// v3: 16-byte vectors held in registers, lanes sized to the head, q and k on a persistent grid with the weights loaded once per thread - removes v2's second read and narrow loads
// A group of kThreadsPerHead lanes owns one row; each lane holds kVecsPerThread 16-byte vectors
// of it in registers, so x is read once and written once. grid.x: min(row groups, resident
// blocks); blocks stride over rows, and since a lane always covers the same columns, its slice
// of both weights is loaded once, before the loop.
// ------------------------------------------------------------------------------------------
// v7's lane groups take kV7RowsPerGroup rows per trip, and its kernel is built to keep
// kV7MinBlocksPerSm blocks resident per SM: as many as v6's kernel holds at head_dims of one
// vector per lane (40 registers, 6 blocks of 256 threads), so v7's grid covers exactly twice
// v6's rows in one trip. ptxas fits it in 40 registers without spilling (46 unconstrained).
constexpr int kV7RowsPerGroup = 2;
constexpr int kV7MinBlocksPerSm = 6;
static_assert(kV7RowsPerGroup > 1, "v7 takes more rows per lane group than v6");

constexpr int next_power_of_two(int n) { return n <= 1 ? 1 : 2 * next_power_of_two((n + 1) / 2); }

// kRowsPerGroup (v7): the rows a lane group takes per loop trip, all loaded before any is
// reduced (1 for v3 to v6).
// kPadded (v10): a head of a whole number of vectors that is not a power of two (12 at 96 bf16
// elements) gets the next power of two of lanes, at most a warp (16), and the lanes or slots past
// the head's last vector hold nothing (lane_has_vector); v3 to v9 launch power-of-two heads only.
// kMinVecsPerThread (v14): the fewest vectors a lane holds; 2 gives a row half the lanes (8
// instead of 16 at head_dim 128 in bf16), heads already at two or more per lane of a full warp
// (512 bf16 elements and up) are unchanged.
template <typename T, int kHeadDim, int kRowsPerGroup = 1, int kMinVecsPerThread = 1>
struct V3Traits {
  static constexpr int kVecElems = Vec<T>::kElems;                    // 4 fp32, 8 fp16/bf16
  static constexpr int kVecsPerHead = kHeadDim / kVecElems;
  static constexpr int kLanesWanted = next_power_of_two(kVecsPerHead) / kMinVecsPerThread;
  static constexpr int kThreadsPerHead = kLanesWanted < 1 ? 1 : kLanesWanted < kWarpSize ? kLanesWanted : kWarpSize;
  static constexpr int kVecsPerThread = (kVecsPerHead + kThreadsPerHead - 1) / kThreadsPerHead;
  static constexpr bool kPadded = kVecsPerHead % kThreadsPerHead != 0;
  static constexpr int kElemsPerThread = kVecsPerThread * kVecElems;
  static constexpr int kThreadsPerBlock = 256;
  static constexpr int kHeadsPerBlock = kThreadsPerBlock / kThreadsPerHead;  // lane groups per block
  static constexpr int kRowsPerBlock = kHeadsPerBlock * kRowsPerGroup;      // rows per block per loop trip

  static_assert(kHeadDim % kVecElems == 0, "a head is a whole number of 16-byte vectors");
  static_assert(kVecsPerThread * kThreadsPerHead - kVecsPerHead < kThreadsPerHead, "fewer padded slots than lanes in a group");
  static_assert(kWarpSize % kThreadsPerHead == 0, "heads tile a warp, so a shuffle group never spans two warps");
  static_assert(kThreadsPerBlock % kWarpSize == 0, "whole warps per block");
  static_assert(kRowsPerGroup >= 1, "a lane group takes at least one row per trip");
  static_assert(kMinVecsPerThread >= 1 && next_power_of_two(kMinVecsPerThread) == kMinVecsPerThread,
                "a power of two of vectors per lane, so a row's lanes stay a power of two");
};

// Whether slot i of lane `lane` holds a vector of the head (always, unless the group is padded).
template <typename Tr>
__device__ __forceinline__ bool lane_has_vector(int lane, int i) {
  return !Tr::kPadded || i * Tr::kThreadsPerHead + lane < Tr::kVecsPerHead;
}

// Column of element j of vector i of lane `lane` of a row's group: vectors interleave across the
// group's lanes so that one load instruction of the group covers contiguous memory.
template <typename Tr>
__device__ __forceinline__ int lane_column(int lane, int i, int j) {
  return (i * Tr::kThreadsPerHead + lane) * Tr::kVecElems + j;
}

// v3 divides with RowIndex = int64_t; v4 (below) is this kernel with RowIndex = uint32_t, v5 with
// RowIndex = uint32_t and kStreaming, v6 with kProgrammatic too, v7 launches it with kRowsPerGroup
// = 2 where that pays, v8 with kFastDivision too.
template <typename T, int kHeadDim, bool kHfRounding, typename RowIndex, bool kStreaming = false,
          bool kProgrammatic = false, int kRowsPerGroup = 1, bool kFastDivision = false>
__global__ void __launch_bounds__(V3Traits<T, kHeadDim>::kThreadsPerBlock, kRowsPerGroup > 1 ? kV7MinBlocksPerSm : 1)
    qk_norm_v3_kernel(Params p, int64_t rows) {
  using Tr = V3Traits<T, kHeadDim, kRowsPerGroup>;
  if constexpr (kProgrammatic) after_prior_grids();  // v6: read nothing before the previous kernel is done
  const int lane = threadIdx.x % Tr::kThreadsPerHead;  // lane within its head group
  const int head_in_block = threadIdx.x / Tr::kThreadsPerHead;

  auto column = [&](int i, int j) { return lane_column<Tr>(lane, i, j); };

  float w_q[Tr::kElemsPerThread], w_k[Tr::kElemsPerThread];
#pragma unroll
  for (int i = 0; i < Tr::kVecsPerThread; ++i) {
#pragma unroll
    for (int j = 0; j < Tr::kVecElems; ++j) {
      const int e = i * Tr::kVecElems + j;
      const bool in_head = lane_has_vector<Tr>(lane, i);  // a padded slot's weight is never used
      w_q[e] = in_head ? effective_weight<T, kHfRounding>(load_weight<T>(p.q_weight, p.weight_is_fp32, column(i, j)),
                                                          p.weight_offset)
                       : 0.f;
      w_k[e] = in_head ? effective_weight<T, kHfRounding>(load_weight<T>(p.k_weight, p.weight_is_fp32, column(i, j)),
                                                          p.weight_offset)
                       : 0.f;
    }
  }

  // `first` is uniform across the block, so every lane runs the same iterations and the group
  // shuffles never miss a lane; rows past the end compute on zeros and store nothing. Per trip a
  // group takes rows first + g * kHeadsPerBlock + head_in_block (g < kRowsPerGroup): for each g
  // the block's groups cover neighbouring rows, so its loads stay contiguous.
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * Tr::kRowsPerBlock;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * Tr::kRowsPerBlock; first < rows; first += row_stride) {
    Row<T> r[kRowsPerGroup];
    bool active[kRowsPerGroup];
    Vec<T> packed[kRowsPerGroup][Tr::kVecsPerThread];
    // Every load of the trip is issued before any is used: kRowsPerGroup x kVecsPerThread in flight.
#pragma unroll
    for (int g = 0; g < kRowsPerGroup; ++g) {
      const int64_t row = first + g * Tr::kHeadsPerBlock + head_in_block;
      active[g] = row < rows;
      r[g] = active[g] ? locate_row<T, RowIndex, kFastDivision>(p, static_cast<RowIndex>(row))
                       : Row<T>{nullptr, nullptr, false};
#pragma unroll
      for (int i = 0; i < Tr::kVecsPerThread; ++i) {
        if (active[g] && lane_has_vector<Tr>(lane, i)) {
          packed[g][i] = load_x<T, kStreaming>(r[g].x + column(i, 0));
        } else {
#pragma unroll
          for (int j = 0; j < Tr::kVecElems; ++j) packed[g][i].v[j] = from_float<T>(0.f);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kRowsPerGroup; ++g) {
      float x[Tr::kVecsPerThread][Tr::kVecElems];
      float sum_sq = 0.f;
#pragma unroll
      for (int i = 0; i < Tr::kVecsPerThread; ++i) {
        unpack<T>(packed[g][i], x[i]);
#pragma unroll
        for (int j = 0; j < Tr::kVecElems; ++j) sum_sq += x[i][j] * x[i][j];
      }
      const float rstd = rstd_from(warp_sum<Tr::kThreadsPerHead>(sum_sq), static_cast<float>(kHeadDim), p.eps);
      if (active[g]) {
#pragma unroll
        for (int i = 0; i < Tr::kVecsPerThread; ++i) {
          float y[Tr::kVecElems];
#pragma unroll
          for (int j = 0; j < Tr::kVecElems; ++j) {
            const int e = i * Tr::kVecElems + j;
            y[j] = normalized<T, kHfRounding>(x[i][j], rstd, r[g].is_q ? w_q[e] : w_k[e]);
          }
          if (lane_has_vector<Tr>(lane, i)) store_x<T, kStreaming>(r[g].x + column(i, 0), pack<T>(y));
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// v4: a 32-bit row -> (token, head) division where rows < 2^32 - removes most of v3's per-row index arithmetic
// The same kernel as v3 with a 32-bit RowIndex (launch_v3_fixed picks it). At 8192 tokens a v3
// lane spends roughly 200 instructions per 16-byte vector, a 64-bit division among them: the SMs
// issue for about as long as DRAM takes to move the bytes, so fewer instructions can show.
// ------------------------------------------------------------------------------------------
// v5: x read and written by streaming (evict-first) global accesses, as qk_norm_rope v5 and cross_head_norm v5 do - removes v4's default caching of bytes that are touched once
// The same kernel again, with kStreaming: the loads and stores of x carry the evict-first policy
// (LDG/STG.E.EF). Each byte of x is touched once, while the weights stay in L1 and the next
// rows' lines are what L2 should keep; measured on the H200 (docs/qk_norm.md) this is worth
// 0.5 % at 8192 tokens x 72 heads and 3-5 % at 1024 tokens and at the GQA and 256-dim shapes.
// ------------------------------------------------------------------------------------------
// v6: v5 as a programmatic dependent launch (as tp_qk_norm v5): its CTAs become resident while the previous kernel finishes and wait in hardware (griddepcontrol) for its writes - removes the launch gap between back-to-back kernels from each call
// The same kernel again, with kProgrammatic, launched with the programmatic-stream-serialization
// attribute (launch_kernel and after_prior_grids in include/common.cuh say how it stays correct).
// At one token a call is one CTA with one row per tensor to normalize; the kernel boundary is
// then a large part of the call, and this overlaps it with the previous kernel's tail when that
// kernel lets it (the bench's previous call does). Measured on the H200: docs/qk_norm.md.
// ------------------------------------------------------------------------------------------
// v7: v6 where a call's rows need more than one trip of v6's resident grid but fit in one when each lane group takes two rows: both rows' loads are issued before either is reduced - removes v6's second serial DRAM round trip at mid-size batches (about 180 to 350 tokens of 72 heads on an H200)
// The same kernel with kRowsPerGroup = kV7RowsPerGroup, picked per call. v6's persistent grid
// holds a fixed number of lane groups (6 blocks of 16 groups per SM at head_dim 128 bf16); a
// call with more rows than that makes some groups walk a second row after their first, and the
// call then waits for two DRAM round trips one after the other (at 256 tokens x 72 heads, 18432
// rows against 12672 resident groups). Two rows per group, both loaded before either is
// reduced, cover such a call in one trip. Past two trips' worth of rows the grid loops anyway
// and v7 launches v6's kernel (measured: two rows per trip did not pay at 1024 tokens and
// beyond), as it does for heads of several vectors per lane, which already have that many
// loads in flight. Measured on the H200: docs/qk_norm.md.
// ------------------------------------------------------------------------------------------
// v8: v7 with the row -> (token, head) division done by a multiply-high with a magic number the host computes once per launch - removes the ~20-instruction 32-bit division from every row of every lane
// The same kernel with kFastDivision: locate_row divides by p.heads_divisor (FastDivisor in
// include/common.cuh), which `launch` builds for num_q_heads + num_kv_heads. Every lane of a
// row's group runs that division for every row (16 lanes per row at head_dim 128 bf16); at 8192
// tokens the SMs issue for about as long as DRAM takes to move the bytes, so fewer instructions
// per row show there. Measured on the H200: docs/qk_norm.md.
// ------------------------------------------------------------------------------------------
// v9: v8 with, where a call's rows fit in one trip of the grid (decode), a one-trip kernel: a lane group requests its row, then only that row's weight (q's or k's) as 16-byte vectors - removes the loop, the second weight's loads and the q/k select from a decode call's critical path
// A persistent lane holds both weights in registers, since its rows alternate between q and k;
// loading them costs every lane 2 x kElemsPerThread scalar loads before its first row. A call
// whose rows all fit in one trip (a decode step: 72 rows at one token) never reuses them. Probes
// of the one-token call (tools/qk_norm_decode_probe_v8.py, bench harness, H200): v8 1.34 us; its body
// without the loop 1.26; the row loaded before the weights 1.18; only q's weight loaded (no
// select, half the loads) 1.04 against 1.24 with both. This kernel takes all three: no loop, the
// row first, then the row's own weight, one 16-byte load per vector where both weights are
// 16-byte aligned (kWeightVectors; element by element otherwise). Larger calls run v8.
// ------------------------------------------------------------------------------------------
// The effective float32 weights of the kVecElems columns from `first_column` of weight `w`.
template <typename T, bool kHfRounding, bool kWeightVectors>
__device__ __forceinline__ void load_weight_vector(const Params& p, const void* w, int first_column,
                                                   float (&out)[Vec<T>::kElems]) {
  constexpr int kVecElems = Vec<T>::kElems;
  constexpr int kFloatsPerLoad = kVecBytes / sizeof(float);
  if constexpr (kWeightVectors) {
    if (p.weight_is_fp32) {
      const float4* w4 = reinterpret_cast<const float4*>(static_cast<const float*>(w) + first_column);
#pragma unroll
      for (int h = 0; h < kVecElems / kFloatsPerLoad; ++h) {
        const float4 f = w4[h];
        out[kFloatsPerLoad * h] = f.x;
        out[kFloatsPerLoad * h + 1] = f.y;
        out[kFloatsPerLoad * h + 2] = f.z;
        out[kFloatsPerLoad * h + 3] = f.w;
      }
    } else {
      unpack<T>(load_vec<T>(static_cast<const T*>(w) + first_column), out);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) out[j] = load_weight<T>(w, p.weight_is_fp32, first_column + j);
  }
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) out[j] = effective_weight<T, kHfRounding>(out[j], p.weight_offset);
}

constexpr int kNumWeights = 2;  // q's and k's

// kWarmWeights (v12): before the wait, block 0's first two lane groups prefetch q's and k's
// weights into L2 (warm_l2, include/common.cuh), so that after it every lane group's weight
// loads are L2 hits. One group per weight for the whole call: when every lane group warmed its
// own row's weight, thousands of prefetches of the same two lines (most likely queued at their
// L2 slices) slowed the call 2-3x from 64 tokens up (docs/qk_norm.md).
// kWarmAhead (v13): once its row's loads are issued, a lane group brings into L2 the row
// p.rows_ahead further on in grid order, by the lanes whose vectors start an L2 line.
// kMinVecsPerThread (v14): V3Traits' fewest vectors per lane (2: half the lanes per row).
template <typename T, int kHeadDim, bool kHfRounding, bool kWeightVectors, bool kWarmWeights = false,
          bool kWarmAhead = false, int kMinVecsPerThread = 1>
__global__ void __launch_bounds__(V3Traits<T, kHeadDim, 1, kMinVecsPerThread>::kThreadsPerBlock)
    qk_norm_one_trip_kernel(Params p, uint32_t rows) {
  using Tr = V3Traits<T, kHeadDim, 1, kMinVecsPerThread>;
  static_assert(kVecBytes % sizeof(float) == 0 && Tr::kVecElems % (kVecBytes / sizeof(float)) == 0,
                "a vector of float32 weights is whole 16-byte loads");
  if constexpr (!kWarmWeights) after_prior_grids();  // read nothing before the previous kernel is done
  const int lane = threadIdx.x % Tr::kThreadsPerHead;
  const uint32_t row = blockIdx.x * Tr::kHeadsPerBlock + threadIdx.x / Tr::kThreadsPerHead;
  const bool active = row < rows;  // idle groups still join their group's shuffles, on zeros
  const Row<T> r = active ? locate_row<T, uint32_t, true>(p, row) : Row<T>{nullptr, nullptr, false};
  if constexpr (kWarmWeights) {  // v12: while the previous kernel still runs
    static_assert(Tr::kHeadsPerBlock >= kNumWeights, "block 0 has a lane group per weight");
    const int group = threadIdx.x / Tr::kThreadsPerHead;
    if (blockIdx.x == 0 && group < kNumWeights) {
      const void* w = group == 0 ? p.q_weight : p.k_weight;
      const int weight_bytes = p.weight_is_fp32 ? static_cast<int>(sizeof(float)) : static_cast<int>(sizeof(T));
#pragma unroll
      for (int i = 0; i < Tr::kVecsPerThread; ++i) {
        if (lane_has_vector<Tr>(lane, i)) {
          warm_l2(static_cast<const char*>(w) + lane_column<Tr>(lane, i, 0) * weight_bytes);
        }
      }
    }
    after_prior_grids();
  }

  Vec<T> packed[Tr::kVecsPerThread];  // 1. the row
#pragma unroll
  for (int i = 0; i < Tr::kVecsPerThread; ++i) {
    if (active && lane_has_vector<Tr>(lane, i)) {
      packed[i] = load_x<T, true>(r.x + lane_column<Tr>(lane, i, 0));
    } else {
#pragma unroll
      for (int j = 0; j < Tr::kVecElems; ++j) packed[i].v[j] = from_float<T>(0.f);
    }
  }
  if constexpr (kWarmAhead) {  // v13: the row a wave ahead
    if (active && p.rows_ahead < rows - row) {
      const Row<T> ahead = locate_row<T, uint32_t, true>(p, row + p.rows_ahead);
#pragma unroll
      for (int i = 0; i < Tr::kVecsPerThread; ++i) {
        const int column = lane_column<Tr>(lane, i, 0);
        if (lane_has_vector<Tr>(lane, i) && column % kL2LineElems<T> == 0) warm_l2(ahead.x + column);
      }
    }
  }
  float w[Tr::kVecsPerThread][Tr::kVecElems] = {};  // 2. its weight, while the row is in flight
  if (active) {
#pragma unroll
    for (int i = 0; i < Tr::kVecsPerThread; ++i) {
      if (lane_has_vector<Tr>(lane, i)) load_weight_vector<T, kHfRounding, kWeightVectors>(p, r.w, lane_column<Tr>(lane, i, 0), w[i]);
    }
  }
  float x[Tr::kVecsPerThread][Tr::kVecElems];  // 3. sum, rstd, normalize, store
  float sum_sq = 0.f;
#pragma unroll
  for (int i = 0; i < Tr::kVecsPerThread; ++i) {
    unpack<T>(packed[i], x[i]);
#pragma unroll
    for (int j = 0; j < Tr::kVecElems; ++j) sum_sq += x[i][j] * x[i][j];
  }
  const float rstd = rstd_from(warp_sum<Tr::kThreadsPerHead>(sum_sq), static_cast<float>(kHeadDim), p.eps);
  if (active) {
#pragma unroll
    for (int i = 0; i < Tr::kVecsPerThread; ++i) {
      float y[Tr::kVecElems];
#pragma unroll
      for (int j = 0; j < Tr::kVecElems; ++j) y[j] = normalized<T, kHfRounding>(x[i][j], rstd, w[i][j]);
      if (lane_has_vector<Tr>(lane, i)) store_x<T, true>(r.x + lane_column<Tr>(lane, i, 0), pack<T>(y));
    }
  }
}

// ------------------------------------------------------------------------------------------
// v10: v9 with head_dims of a whole number of 16-byte vectors that is not a power of two (80, 96, 160, 192) on the vector path: a row's lane group is padded to the next power of two of lanes, and the lanes past its last vector hold none - removes v9's fall back to v2 (a warp per row, one element per load) at those head_dims, where torch.compile was faster
// The kernels above with V3Traits' padding (kPadded): at 96 bf16 elements a head is 12 vectors,
// so a group of 16 lanes takes a row and lanes 12-15 load, weigh and store nothing but join the
// group's shuffle sum with zeros. A quarter of those lanes idle costs issue slots, not bytes: the
// call moves exactly the row's bytes in 16-byte accesses. v2's general path, which v3 to v9 keep
// for these head_dims, gives a warp to a row and reads one element per load: at 1024 tokens x 8/1
// heads of 96, 6.1 us against torch.compile's 5.0 in the sweep of commit 3a29bfe; v10 2.65 us
// (H200, docs/qk_norm.md).
// The head_dims of launch_v3's v10 switch are compiled (each is a set of kernels); others stay with v2.
// ------------------------------------------------------------------------------------------
// v11: v10 with the one-trip kernel at every size: a grid of all the call's rows, which the hardware's block scheduler hands out to SMs as they free a slot - removes the persistent grid's fixed share of rows per SM, which held streaming kernels to 88-90 % of the copy on the H200 where a grid of all rows reached 96-98 %
// No new kernel: v9's one-trip kernel, launched with a block for every kHeadsPerBlock rows at
// any size instead of only where the rows fit in one trip of the resident grid. A persistent
// grid gives every SM the same rows up front, and the call lasts as long as the slowest SM's
// share (the likely reason it loses); with a grid of all rows the block scheduler gives a freed
// slot the next block. tools/grid_probe.py measured the difference on a bare streaming kernel
// (16-byte ld/st, programmatic launch, bench harness, H200): 151 MB moved in place, 79.3 us on
// 8 blocks per SM, 72.9 us on a grid of all 16-byte vectors (98 % of the 256 MiB copy). What
// v11 gives up is the persistent lane's weights in registers: each lane group loads its row's
// weight vector (L1 hits after the first block on an SM). Two rows per lane group and blocks of
// 64, 128 or 512 threads on this grid were slower (docs/qk_norm.md).
// ------------------------------------------------------------------------------------------
// v12: v11 with q's and k's weights prefetched into L2 by two lane groups of the first block before the wait, while the previous kernel still runs - removes the weights' DRAM round trip from a decode call, which the one-token probe put at 0.25 of its 1.17 us
// v9's kernel requests the weight right after the row, so both round trips overlap, yet the
// one-token probe (tools/qk_norm_decode_probe.py, H200) timed the same traffic and arithmetic
// without weights at 0.92 us against 1.17: the weight's reads, every lane group of the call
// asking for the same two 256-byte lines at once, apparently come back after the row's. A
// programmatic launch spends the previous kernel's last microseconds parked at
// griddepcontrol.wait; v12's kernel (kWarmWeights) has block 0 issue prefetch.global.L2 for both
// weights first, so they are L2 hits by the time any block reads them. Block 0 is in the first
// wave at every size, so the kernel is the same at every size; past the first wave it changes
// nothing.
// Probed on the H200 (bench harness, us, v11 against v12 in one run): one token x 72 heads
// 1.15 / 0.95, 64 tokens 1.98 / 1.76, 1024 tokens x 8/1 heads 2.86 / 2.63. The first try warmed
// each lane group's own weight: 0.92 at one token, but 4.06 against 1.98 at 64 tokens and 9.5
// against 2.9 at 1024 x 8/1 (thousands of prefetches of the same two lines, most likely queued
// at their L2 slices in the way of the previous call's own loads of them; not profiled); one
// lane group per weight and block still lost at 1024 x 8/1 (5.0 us). docs/qk_norm.md has the
// sweep.
// ------------------------------------------------------------------------------------------
// v13: v12 with, at calls of two to eight waves of blocks, each lane group warming into L2 the row a wave of blocks ahead of its own once its row's loads are issued - removes the DRAM round trip that every block of the later waves waited for before its first sum
// The one-trip kernel with kWarmAhead: p.rows_ahead is a wave of resident blocks' rows, so the
// row warmed is the one a block of the next wave will take, and that block finds it in L2. One
// prefetch per 128-byte line, issued after the lane group's own loads; no register is held for
// it. Only up to kV13MaxWaves waves: at many waves the blocks in flight alone keep the DRAM busy,
// and a second request per line costs (bench harness, `build/` probe, H100, us, v12 -> v12 with
// the warm at every size): 8192 x 8/1 heads (4.4 waves) 14.41 -> 14.00, 1024 x 64/8 14.50 ->
// 14.07, 2048 x 16/4 heads of 256 (4.8 waves) 16.26 -> 15.65, 8192 x 32/8 heads of 64 (9.7
// waves) 29.94 -> 29.88, 8192 x 64/8 (35 waves) 103.4 -> 104.1; H200, v12 -> v13: 8192 x 8/1
// 11.03 -> 10.62 (81.3 -> 84.4 % of the copy), 1024 x 64/8 10.96 -> 10.53, 2048 x 16/4 heads of
// 256 12.19 -> 11.64, 8192 x 32/8 heads of 64 22.39 both. The distance is a whole wave because
// that measured best (H200, 8192 x 8/1, % of the copy at 0.7 / 1 / 1.5 / 2 waves ahead: 82.0 /
// 84.4-84.5 / 83.3 / 82.5; 1024 x 64/8 and 2048 x 16/4 the same way): nearer, the row is not in
// L2 yet when its block starts; farther, it waits there longer for it. Calls of one wave have no
// row a wave ahead. docs/qk_norm.md has the H200 page.
// ------------------------------------------------------------------------------------------
constexpr int kV13MaxWaves = 8;
static_assert(kV13MaxWaves >= 2, "v13 warms calls of at least two waves");

// ------------------------------------------------------------------------------------------
// v14: v13 with, in calls of at least one wave of v13's blocks, two 16-byte vectors per lane: half as many lanes per row (8 at head_dim 128 in bf16), each doing twice the elements - removes half of the per-row work that every lane of a row repeats (its row's and weight's addresses, predicates, the shuffle sum's steps, rsqrt), which kept the SMs' issue slots about 70 % busy in a memory-bound kernel
// The one-trip kernel with kMinVecsPerThread = 2. Every lane of a row's group repeats the row's
// fixed work: locate the row (a multiply-high and two 64-bit products), the weight's address,
// the predicates, log2(lanes) shuffle steps, rsqrt, the stores' addresses. With one 16-byte
// vector per lane that is most of the lane's code: v13's kernel at head_dim 128 in bf16 is about
// 250 PTX instructions (both sides of its branches), of which its 8 elements' conversions and
// arithmetic are about 60; and Nsight Compute put the SMs' issue slots 70-74 % busy at 8192 x
// 8/1 (docs/results/qk_norm_h200_ncu_v12_v13.md). With two vectors per lane each row's fixed work
// is done by half as many lanes: 47 registers instead of 29 at head_dim 128 in bf16, so five
// 256-thread blocks per SM instead of eight, but 32 rows per block, 160 per SM against 128, and
// 32 bytes of loads in flight per lane. In small calls the lanes' serial work is the time, and
// one vector per lane wins (bench harness, `build/` probe, H200, us, v13 against two vectors per
// lane): 64/8 heads of 128 at 1, 64, 128, 192 and 256 tokens 0.92 / 1.11, 1.79 / 1.83, 2.62 /
// 2.38, 2.97 / 3.31, 3.89 / 3.56; 8/1 heads at 512, 1024 and 2048 tokens 1.78 / 1.84, 2.65 /
// 2.37, 3.91 / 3.54; 32/8 heads of 64 at 64 and 512 tokens 1.12 / 1.29, 2.61 / 2.59; 16/4 heads
// of 256 at 16 and 128 tokens 1.12 / 1.25, 1.88 / 1.94. From one wave of v13's blocks up (256
// tokens x 72 heads of 128 is 1.09) two vectors won at every shape; between half a wave and one
// they won at three of five shapes and lost 11 % at one (192 tokens), so below a wave v13
// stays. Four vectors per lane (80 registers, three blocks per SM) was no better than two at
// head_dim 256 and worse elsewhere (8192 x 8/1 10.81 against 10.37 us). docs/qk_norm.md has the
// sweep.
constexpr int kV14VecsPerThread = 2;

// ------------------------------------------------------------------------------------------
// Launchers (host). `launch` is what the binding calls.
// ------------------------------------------------------------------------------------------
template <typename T, bool kHfRounding>
inline void launch_v1(const Params& p, int64_t rows, cudaStream_t stream) {
  const int64_t blocks = (rows + kV1Threads - 1) / kV1Threads;
  qk_norm_v1_kernel<T, kHfRounding><<<static_cast<unsigned>(blocks), kV1Threads, 0, stream>>>(p, rows);
}

template <typename T, bool kHfRounding>
inline void launch_v2(const Params& p, int64_t rows, cudaStream_t stream) {
  const int64_t blocks = (rows + kV2WarpsPerBlock - 1) / kV2WarpsPerBlock;
  qk_norm_v2_kernel<T, kHfRounding><<<static_cast<unsigned>(blocks), kV2Threads, 0, stream>>>(p, rows);
}

// Launches kKernel, whose blocks take kRowsPerBlock rows per trip, on a persistent grid of
// min(blocks needed, blocks resident).
template <auto kKernel, int kThreadsPerBlock, int kRowsPerBlock>
inline void launch_persistent(bool programmatic, const Params& p, int64_t rows, cudaStream_t stream) {
  const int64_t needed = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t resident = persistent_grid_limit<kKernel>(kThreadsPerBlock);
  const int64_t blocks = needed < resident ? needed : resident;
  launch_kernel(programmatic, kKernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreadsPerBlock), 0, stream, p, rows);
}

// Rows in one wave of kKernel's blocks: the blocks resident at once, times Tr's rows per block.
template <auto kKernel, typename Tr>
inline int64_t wave_rows() {
  return static_cast<int64_t>(persistent_grid_limit<kKernel>(Tr::kThreadsPerBlock)) * Tr::kHeadsPerBlock;
}

// v9 to v14's one-trip kernel on a grid of all rows (rows < 2^32), kMinVecsPerThread vectors per
// lane at least: v12 on with the weights warmed before the wait, v13 on with the row a wave
// ahead warmed in calls of more than one and at most kV13MaxWaves waves.
template <typename T, int kHeadDim, bool kHfRounding, int kVersion, int kMinVecsPerThread>
inline void launch_one_trip(const Params& p, int64_t rows, cudaStream_t stream) {
  using Tr = V3Traits<T, kHeadDim, 1, kMinVecsPerThread>;
  static_assert(Tr::kHeadsPerBlock >= 2, "rows < 2^32 need fewer than 2^31 blocks");
  const auto blocks = static_cast<unsigned>((rows + Tr::kHeadsPerBlock - 1) / Tr::kHeadsPerBlock);
  const bool weight_vectors = is_aligned(p.q_weight, kVecBytes) && is_aligned(p.k_weight, kVecBytes);
  constexpr bool kWarm = kVersion >= 12;  // v12: the weights warmed before the wait
  constexpr auto one_trip_vectors = qk_norm_one_trip_kernel<T, kHeadDim, kHfRounding, true, kWarm, false, kMinVecsPerThread>;
  constexpr auto one_trip_elements = qk_norm_one_trip_kernel<T, kHeadDim, kHfRounding, false, kWarm, false, kMinVecsPerThread>;
  if constexpr (kVersion >= 13) {  // v13: calls of more than one and at most kV13MaxWaves waves
    constexpr auto ahead_vectors = qk_norm_one_trip_kernel<T, kHeadDim, kHfRounding, true, kWarm, true, kMinVecsPerThread>;
    constexpr auto ahead_elements = qk_norm_one_trip_kernel<T, kHeadDim, kHfRounding, false, kWarm, true, kMinVecsPerThread>;
    const int64_t wave = wave_rows<ahead_vectors, Tr>();
    if (rows > wave && rows <= kV13MaxWaves * wave) {
      Params ahead = p;
      ahead.rows_ahead = static_cast<uint32_t>(wave);
      launch_kernel(true, weight_vectors ? ahead_vectors : ahead_elements, dim3(blocks), dim3(Tr::kThreadsPerBlock), 0,
                    stream, ahead, static_cast<uint32_t>(rows));
      return;
    }
  }
  launch_kernel(true, weight_vectors ? one_trip_vectors : one_trip_elements, dim3(blocks), dim3(Tr::kThreadsPerBlock), 0,
                stream, p, static_cast<uint32_t>(rows));
}

// kVersion 3: 64-bit row index; 4: 32-bit row index where rows < 2^32; 5: v4 with streaming x;
// 6: v5 as a programmatic dependent launch; 7: v6, or two rows per lane group where that makes
// a call that needs two trips of v6's grid fit in one; 8: v7 with the fast division; 9: v8, or
// the one-trip kernel where the rows fit in one trip of v8's grid; 10: v9 (launch_v3 adds the
// padded head_dims); 11: the one-trip kernel on a grid of all rows, at every size; 12: v11
// with the weights warmed before the wait; 13: v12 with the row a wave ahead warmed at two to
// kV13MaxWaves waves; 14: v13 with two vectors per lane from one wave of v13's blocks up.
template <typename T, int kHeadDim, bool kHfRounding, int kVersion>
inline void launch_v3_fixed(const Params& p, int64_t rows, cudaStream_t stream) {
  if constexpr (kVersion >= 4) {
    if (rows > static_cast<int64_t>(UINT32_MAX)) return launch_v3_fixed<T, kHeadDim, kHfRounding, 3>(p, rows, stream);
  }
  using Tr = V3Traits<T, kHeadDim>;
  using RowIndex = std::conditional_t<kVersion >= 4, uint32_t, int64_t>;
  constexpr bool kStreaming = kVersion >= 5;
  constexpr bool kProgrammatic = kVersion >= 6;
  constexpr bool kFastDivision = kVersion >= 8;
  constexpr auto kernel =
      qk_norm_v3_kernel<T, kHeadDim, kHfRounding, RowIndex, kStreaming, kProgrammatic, 1, kFastDivision>;
  if constexpr (kVersion >= 9) {
    const int64_t one_trip = static_cast<int64_t>(persistent_grid_limit<kernel>(Tr::kThreadsPerBlock)) * Tr::kRowsPerBlock;
    if (kVersion >= 11 || rows <= one_trip) {  // v11: at every size (rows < 2^32 here)
      if constexpr (kVersion >= 14) {  // v14: two vectors per lane from one wave of v13's blocks up
        constexpr auto v13_kernel = qk_norm_one_trip_kernel<T, kHeadDim, kHfRounding, true, true, true>;
        if (rows >= wave_rows<v13_kernel, Tr>()) {
          return launch_one_trip<T, kHeadDim, kHfRounding, kVersion, kV14VecsPerThread>(p, rows, stream);
        }
      }
      return launch_one_trip<T, kHeadDim, kHfRounding, kVersion, 1>(p, rows, stream);
    }
  }
  // Padded groups get no two-row kernel: ptxas spilled it under v7's register bound (40).
  if constexpr (kVersion >= 7 && Tr::kVecsPerThread == 1 && !Tr::kPadded) {
    using Tr7 = V3Traits<T, kHeadDim, kV7RowsPerGroup>;
    constexpr auto kernel7 = qk_norm_v3_kernel<T, kHeadDim, kHfRounding, RowIndex, kStreaming, kProgrammatic,
                                               kV7RowsPerGroup, kFastDivision>;
    const int64_t one_trip_v6 = static_cast<int64_t>(persistent_grid_limit<kernel>(Tr::kThreadsPerBlock)) * Tr::kRowsPerBlock;
    const int64_t one_trip_v7 = static_cast<int64_t>(persistent_grid_limit<kernel7>(Tr7::kThreadsPerBlock)) * Tr7::kRowsPerBlock;
    if (rows > one_trip_v6 && rows <= one_trip_v7) {
      return launch_persistent<kernel7, Tr7::kThreadsPerBlock, Tr7::kRowsPerBlock>(kProgrammatic, p, rows, stream);
    }
  }
  launch_persistent<kernel, Tr::kThreadsPerBlock, Tr::kRowsPerBlock>(kProgrammatic, p, rows, stream);
}

// The 16-byte path needs both tensors' rows to start on 16-byte boundaries.
template <typename T>
inline bool vector_aligned(const Params& p) {
  constexpr int kVecElems = Vec<T>::kElems;
  return is_aligned(p.q, kVecBytes) && is_aligned(p.k, kVecBytes) && p.q_token_stride % kVecElems == 0 &&
         p.q_head_stride % kVecElems == 0 && p.k_token_stride % kVecElems == 0 && p.k_head_stride % kVecElems == 0;
}

template <typename T, bool kHfRounding, int kVersion>
inline void launch_v3(const Params& p, int64_t rows, cudaStream_t stream) {
  if (vector_aligned<T>(p)) {
    switch (p.head_dim) {
      case 64: return launch_v3_fixed<T, 64, kHfRounding, kVersion>(p, rows, stream);
      case 128: return launch_v3_fixed<T, 128, kHfRounding, kVersion>(p, rows, stream);
      case 256: return launch_v3_fixed<T, 256, kHfRounding, kVersion>(p, rows, stream);
      case 512: return launch_v3_fixed<T, 512, kHfRounding, kVersion>(p, rows, stream);
      case 1024: return launch_v3_fixed<T, 1024, kHfRounding, kVersion>(p, rows, stream);
      default: break;
    }
    if constexpr (kVersion >= 10) {  // padded lane groups (V3Traits::kPadded)
      switch (p.head_dim) {
        case 80: return launch_v3_fixed<T, 80, kHfRounding, kVersion>(p, rows, stream);
        case 96: return launch_v3_fixed<T, 96, kHfRounding, kVersion>(p, rows, stream);
        case 160: return launch_v3_fixed<T, 160, kHfRounding, kVersion>(p, rows, stream);
        case 192: return launch_v3_fixed<T, 192, kHfRounding, kVersion>(p, rows, stream);
        default: break;
      }
    }
  }
  launch_v2<T, kHfRounding>(p, rows, stream);  // general path: any even head_dim, any alignment
}

template <typename T, bool kHfRounding>
inline void launch_version(const Params& p, int version, cudaStream_t stream) {
  const int64_t rows = total_rows(p);
  switch (version) {
    case 1: return launch_v1<T, kHfRounding>(p, rows, stream);
    case 2: return launch_v2<T, kHfRounding>(p, rows, stream);
    case 3: return launch_v3<T, kHfRounding, 3>(p, rows, stream);
    case 4: return launch_v3<T, kHfRounding, 4>(p, rows, stream);
    case 5: return launch_v3<T, kHfRounding, 5>(p, rows, stream);
    case 6: return launch_v3<T, kHfRounding, 6>(p, rows, stream);
    case 7: return launch_v3<T, kHfRounding, 7>(p, rows, stream);
    case 8: return launch_v3<T, kHfRounding, 8>(p, rows, stream);
    case 9: return launch_v3<T, kHfRounding, 9>(p, rows, stream);
    case 10: return launch_v3<T, kHfRounding, 10>(p, rows, stream);
    case 11: return launch_v3<T, kHfRounding, 11>(p, rows, stream);
    case 12: return launch_v3<T, kHfRounding, 12>(p, rows, stream);
    case 13: return launch_v3<T, kHfRounding, 13>(p, rows, stream);
    default: return launch_v3<T, kHfRounding, 14>(p, rows, stream);
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
inline cudaError_t launch(const Params& params, DType dtype, bool hf_rounding, int version, cudaStream_t stream) {
  if (version < 1 || version > kNumVersions) return cudaErrorInvalidValue;
  if (total_rows(params) == 0) return cudaSuccess;
  Params p = params;
  p.heads_divisor = FastDivisor(static_cast<uint32_t>(p.num_q_heads + p.num_kv_heads));
  switch (dtype) {
    case DType::kFloat32: launch_rounding<float>(p, hf_rounding, version, stream); break;
    case DType::kFloat16: launch_rounding<__half>(p, hf_rounding, version, stream); break;
    case DType::kBFloat16: launch_rounding<__nv_bfloat16>(p, hf_rounding, version, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm
