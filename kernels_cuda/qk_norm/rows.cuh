// What every qk_norm kernel shares: where a (token, head) row lives, how a group of lanes splits
// a row into 16-byte vectors, and the host's compile-time dispatch.
// The kernels themselves live one per file (v1_*.cuh ... v6_*.cuh, tuned.cuh), each readable alone.
#pragma once

#include "include/common.cuh"
#include "qk_norm/lanes.h"
#include "qk_norm/params.h"

namespace cookbook::qk_norm {

// One (token, head) row: its first element, its weight (q's or k's), and which tensor it is in.
template <typename T>
struct Row {
  T* x = nullptr;
  const void* w = nullptr;
  bool is_q = false;
};

// The row of `token`, `head` (heads below num_q_heads are q's, the rest k's). Offsets are 64-bit.
template <typename T>
__device__ __forceinline__ Row<T> row_at(const Params& p, int64_t token, int head) {
  if (head < p.num_q_heads) {
    return {static_cast<T*>(p.q) + token * p.q_token_stride + head * p.q_head_stride, p.q_weight, true};
  }
  const int kv_head = head - p.num_q_heads;
  return {static_cast<T*>(p.k) + token * p.k_token_stride + kv_head * p.k_head_stride, p.k_weight, false};
}

// A lane group: the kLanes lanes of a warp that share one row of kHeadDim elements of T, each
// holding kVecsPerLane 16-byte vectors of it in registers (the arithmetic: lane_shape, lanes.h).
template <typename T, int kHeadDim, int kMinVecsPerLane = 1>
struct LaneGroup {
  static constexpr int kVecElems = Vec<T>::kElems;  // 4 fp32, 8 fp16/bf16
  static constexpr LaneShape kShape = lane_shape(kVecElems, kHeadDim, kMinVecsPerLane);
  static constexpr int kVecsPerRow = kShape.vecs_per_row;
  static constexpr int kLanes = kShape.lanes;
  static constexpr int kVecsPerLane = kShape.vecs_per_lane;
  static constexpr bool kPadded = kShape.padded;

  static_assert(kHeadDim % kVecElems == 0, "a row is a whole number of 16-byte vectors");
  static_assert(kWarpSize % kLanes == 0, "groups tile a warp, so a group's shuffles never span two warps");
  static_assert(kVecsPerLane * kLanes - kVecsPerRow < kLanes, "fewer empty slots than lanes in a group");
  static_assert(kMinVecsPerLane >= 1 && next_power_of_two(kMinVecsPerLane) == kMinVecsPerLane,
                "a power of two of vectors per lane keeps a group's lanes a power of two");

  // Whether slot i of `lane` holds a vector of the row (always, unless the group is padded).
  __device__ static bool holds(int lane, int i) { return !kPadded || i * kLanes + lane < kVecsPerRow; }

  // The first column of slot i of `lane`. A group's vectors interleave across its lanes, so one
  // load instruction of the group reads contiguous memory.
  __device__ static int column(int lane, int i) { return (i * kLanes + lane) * kVecElems; }
};

// A vector of zeros: what an idle lane group sums (it still joins its group's shuffles).
template <typename T>
__device__ __forceinline__ Vec<T> zero_vec() {
  Vec<T> out;
#pragma unroll
  for (int j = 0; j < Vec<T>::kElems; ++j) out.v[j] = from_float<T>(0.f);
  return out;
}

// ---- host ------------------------------------------------------------------------------------
// Whether every row starts on a 16-byte boundary, as the vector kernels need.
template <typename T>
inline bool rows_are_vectors(const Params& p) {
  constexpr int kVecElems = Vec<T>::kElems;
  return is_aligned(p.q, kVecBytes) && is_aligned(p.k, kVecBytes) && p.q_token_stride % kVecElems == 0 &&
         p.q_head_stride % kVecElems == 0 && p.k_token_stride % kVecElems == 0 && p.k_head_stride % kVecElems == 0;
}

// Calls launch.template operator()<kHeadDim>() if `head_dim` is one of kHeadDims (each compiled
// as its own kernel, its row held in registers); returns whether it was.
template <int... kHeadDims, typename Launch>
inline bool with_head_dim(int head_dim, Launch&& launch) {
  return ((head_dim == kHeadDims ? (launch.template operator()<kHeadDims>(), true) : false) || ...);
}

}  // namespace cookbook::qk_norm
