// v6: a programmatic launch, the tables warmed into L2 during its wait and read with the row - removes the launch gap and decode's table round trips
//
// grid.x: ceil(rows / kRowsPerBlock); lane group -> row, as in v5. At decode a call is a few
// hundred rows: its time is the launch and a chain of DRAM round trips (the row and the token's
// position together, then the cos/sin run the position points at, then, after the sum, the
// weights). Launched as a programmatic dependent launch (launch_kernel in include/common.cuh),
// the kernel's blocks become resident while the previous kernel still runs and wait in hardware
// (after_prior_grids) for its writes. The wait is free time for reads of what no kernel in flight
// writes: block 0's first two lane groups warm q's and k's weights into L2 (warm_l2), and the
// group of each token's first head warms its position and its cos/sin run, aimed by a speculative
// read of the position (from L2 only, possibly stale, used for nothing but the prefetch address:
// the position is read again after the wait). One group per line: thousands of requests for the
// same lines would queue. After the wait a lane reads its tables right behind its row, before the
// sum, so their round trips overlap the row's.
#pragma once

#include "qk_norm_rope/rows.cuh"
#include "qk_norm_rope/v2_one_pass_warp_per_row.cuh"  // calls off the vector path

namespace cookbook::qk_norm_rope::v6 {

constexpr int kThreadsPerBlock = 256;
constexpr int kNumWeights = 2;  // q's and k's
static_assert(kThreadsPerBlock % kWarpSize == 0, "whole warps per block");

template <typename T, Rounding kRounding, int kHeadDim, bool kNeox, typename WeightT, typename CacheT>
__global__ void __launch_bounds__(kThreadsPerBlock) qk_norm_rope_v6_kernel(Params p, int64_t rows) {
  using Lanes = PairLanes<T, kHeadDim>;
  constexpr int kRowsPerBlock = kThreadsPerBlock / Lanes::kLanes;
  constexpr int kVecElems = Lanes::kVecElems;
  constexpr int kUnits = Lanes::kUnitsPerLane;
  constexpr bool kHf = kRounding == Rounding::kHf;
  static_assert(kRowsPerBlock >= kNumWeights, "block 0 has a lane group per weight");
  const int lane = threadIdx.x % Lanes::kLanes;
  const int group = threadIdx.x / Lanes::kLanes;
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + group;
  const bool active = row < rows;  // a group past the last row still joins its shuffles, on zeros
  const int heads = p.num_q_heads + p.num_kv_heads;
  const int64_t token = active ? row / heads : 0;
  const int head = active ? static_cast<int>(row % heads) : 0;
  const Row<T> r = active ? row_at<T>(p, token, head) : Row<T>{};
  const LaneUnits<kUnits> u = lane_units<kUnits, kVecElems>(lane, Lanes::kLanes, p.rope_dim, kNeox);

  if (blockIdx.x == 0 && group < kNumWeights) {  // 0. while the previous kernel still runs
    const WeightT* w = static_cast<const WeightT*>(group == 0 ? p.q_weight : p.k_weight);
#pragma unroll
    for (int s = 0; s < kUnits; ++s) {
      warm_l2(w + u.col_a[s]);
      warm_l2(w + u.col_b[s]);
    }
  }
  if (active && head == 0) {
    const int64_t guess = (p.positions_are_int64 ? __ldcg(static_cast<const long long*>(p.positions) + token)
                                                 : __ldcg(static_cast<const int*>(p.positions) + token)) +
                          p.position_offset;
    if (guess >= 0 && guess < p.max_position) {
      const CacheT* cos_row = static_cast<const CacheT*>(p.cos_sin_cache) + guess * p.rope_dim;
#pragma unroll
      for (int s = 0; s < kUnits; ++s) {
        if (!u.rotates[s]) continue;
        warm_l2(cos_row + u.unit[s] * kVecElems);
        warm_l2(cos_row + p.rope_dim / 2 + u.unit[s] * kVecElems);
      }
    }
  }
  after_prior_grids();  // nothing is read before the previous kernel's writes are visible

  const int64_t cache = active ? cache_row(p, token) : -1;  // 1. the row, and right behind it its tables
  Vec<T> a[kUnits], b[kUnits];
#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    a[s] = active ? load_vec<T>(r.x + u.col_a[s]) : zero_vec<T>();
    b[s] = active ? load_vec<T>(r.x + u.col_b[s]) : zero_vec<T>();
  }
  float wa[kUnits][kVecElems] = {}, wb[kUnits][kVecElems] = {}, cos[kUnits][kVecElems] = {}, sin[kUnits][kVecElems] = {};
  if (active) {
#pragma unroll
    for (int s = 0; s < kUnits; ++s) {
      load_table<WeightT, kVecElems>(r.w, u.col_a[s], wa[s]);
      load_table<WeightT, kVecElems>(r.w, u.col_b[s], wb[s]);
      if (u.rotates[s]) unit_cos_sin<T, kHf, CacheT, kVecElems>(p, cache, u.unit[s], cos[s], sin[s]);
    }
  }
  float xa[kUnits][kVecElems], xb[kUnits][kVecElems];  // 2. the sum of squares
  float sum_sq = 0.f;
#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    unpack<T>(a[s], xa[s]);
    unpack<T>(b[s], xb[s]);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) sum_sq += xa[s][j] * xa[s][j] + xb[s][j] * xb[s][j];
  }
  const float rstd = rstd_from(warp_sum<Lanes::kLanes>(sum_sq), static_cast<float>(kHeadDim), p.eps);
  if (!active) return;

#pragma unroll
  for (int s = 0; s < kUnits; ++s) {  // 3. per unit: normalize, rotate, store
    float na[kVecElems], nb[kVecElems];
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) {
      na[j] = normalized<T, kHf>(xa[s][j], rstd, effective_weight<T, kHf>(wa[s][j], p.weight_offset));
      nb[j] = normalized<T, kHf>(xb[s][j], rstd, effective_weight<T, kHf>(wb[s][j], p.weight_offset));
    }
    float ya[kVecElems], yb[kVecElems];
    if (u.rotates[s]) {
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) {
        if constexpr (kNeox) {  // a = na[j], b = nb[j]: pair j
          ya[j] = rotated<T, kHf>(na[j], nb[j], true, cos[s][j], sin[s][j]);
          yb[j] = rotated<T, kHf>(nb[j], na[j], false, cos[s][j], sin[s][j]);
        } else {  // pairs (j, j ^ 1) inside each vector: pair j / 2 of a, kVecElems / 2 + j / 2 of b
          const bool is_first = j % 2 == 0;
          const int pair_a = j / 2, pair_b = kVecElems / 2 + j / 2;
          ya[j] = rotated<T, kHf>(na[j], na[j ^ 1], is_first, cos[s][pair_a], sin[s][pair_a]);
          yb[j] = rotated<T, kHf>(nb[j], nb[j ^ 1], is_first, cos[s][pair_b], sin[s][pair_b]);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) {
        ya[j] = na[j];
        yb[j] = nb[j];
      }
    }
    store_vec<T>(r.x + u.col_a[s], pack<T>(ya));
    store_vec<T>(r.x + u.col_b[s], pack<T>(yb));
  }
}

// Calls launch.template operator()<kNeox, WeightT, CacheT>() for the call's layout and the
// tables' storage types (T or float32).
template <typename T, typename Launch>
inline void with_call_kind(const Params& p, Launch&& launch) {
  const auto with_cache = [&]<bool kNeox, typename WeightT>() {
    if (p.cache_is_fp32) return launch.template operator()<kNeox, WeightT, float>();
    launch.template operator()<kNeox, WeightT, T>();
  };
  const auto with_weights = [&]<bool kNeox>() {
    if (p.weight_is_fp32) return with_cache.template operator()<kNeox, float>();
    with_cache.template operator()<kNeox, T>();
  };
  if (p.is_neox) return with_weights.template operator()<true>();
  with_weights.template operator()<false>();
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  using T = Storage<kDType>;
  const int64_t rows = total_rows(p);
  if (rows == 0) return cudaSuccess;
  const bool on_vectors = vector_path_ok<T>(p) && with_vector_head_dim(p.head_dim, [&]<int kHeadDim>() {
    constexpr int kRowsPerBlock = kThreadsPerBlock / PairLanes<T, kHeadDim>::kLanes;
    const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
    with_call_kind<T>(p, [&]<bool kNeox, typename WeightT, typename CacheT>() {
      launch_kernel(/*programmatic=*/true, qk_norm_rope_v6_kernel<T, kRounding, kHeadDim, kNeox, WeightT, CacheT>,
                    dim3(static_cast<unsigned>(blocks)), dim3(kThreadsPerBlock), 0, stream, p, rows);
    });
  });
  if (!on_vectors) v2::launch_rows<T, kRounding>(p, rows, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm_rope::v6
