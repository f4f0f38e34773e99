// v5: the rope layout and the tables' storage types as template arguments - removes v4's per-element layout selects and the loads it issues for both storage types
//
// grid.x: ceil(rows / kRowsPerBlock); lane group -> row, as in v4. v4 decides per element what
// is the same for the whole call: NeoX or interleaved (the compiler keeps both rotations and
// selects between them), and whether a table is stored in the activation dtype or in float32 (a
// flag the compiler can turn into predication, issuing the loads of both storage types). Here the
// launcher picks the kernel compiled for the call's layout and the tables' storage types, and the
// tables are read through the read-only path in whole 16-byte loads (load_table, unit_cos_sin).
#pragma once

#include "qk_norm_rope/rows.cuh"
#include "qk_norm_rope/v2_one_pass_warp_per_row.cuh"  // calls off the vector path

namespace cookbook::qk_norm_rope::v5 {

constexpr int kThreadsPerBlock = 256;
static_assert(kThreadsPerBlock % kWarpSize == 0, "whole warps per block");

template <typename T, Rounding kRounding, int kHeadDim, bool kNeox, typename WeightT, typename CacheT>
__global__ void __launch_bounds__(kThreadsPerBlock) qk_norm_rope_v5_kernel(Params p, int64_t rows) {
  using Lanes = PairLanes<T, kHeadDim>;
  constexpr int kRowsPerBlock = kThreadsPerBlock / Lanes::kLanes;
  constexpr int kVecElems = Lanes::kVecElems;
  constexpr int kUnits = Lanes::kUnitsPerLane;
  constexpr bool kHf = kRounding == Rounding::kHf;
  const int lane = threadIdx.x % Lanes::kLanes;
  const int group = threadIdx.x / Lanes::kLanes;
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + group;
  const bool active = row < rows;  // a group past the last row still joins its shuffles, on zeros
  const int heads = p.num_q_heads + p.num_kv_heads;
  const int64_t token = active ? row / heads : 0;
  const Row<T> r = active ? row_at<T>(p, token, static_cast<int>(row % heads)) : Row<T>{};
  const LaneUnits<kUnits> u = lane_units<kUnits, kVecElems>(lane, Lanes::kLanes, p.rope_dim, kNeox);

  float xa[kUnits][kVecElems], xb[kUnits][kVecElems];  // 1. the row: both vectors of each unit
  float sum_sq = 0.f;
#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    unpack<T>(active ? load_vec<T>(r.x + u.col_a[s]) : zero_vec<T>(), xa[s]);
    unpack<T>(active ? load_vec<T>(r.x + u.col_b[s]) : zero_vec<T>(), xb[s]);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) sum_sq += xa[s][j] * xa[s][j] + xb[s][j] * xb[s][j];
  }
  const float rstd = rstd_from(warp_sum<Lanes::kLanes>(sum_sq), static_cast<float>(kHeadDim), p.eps);
  if (!active) return;

  const int64_t cache = cache_row(p, token);  // 2. per unit: normalize, rotate, store
#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    float wa[kVecElems], wb[kVecElems], na[kVecElems], nb[kVecElems];
    load_table<WeightT, kVecElems>(r.w, u.col_a[s], wa);
    load_table<WeightT, kVecElems>(r.w, u.col_b[s], wb);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) {
      na[j] = normalized<T, kHf>(xa[s][j], rstd, effective_weight<T, kHf>(wa[j], p.weight_offset));
      nb[j] = normalized<T, kHf>(xb[s][j], rstd, effective_weight<T, kHf>(wb[j], p.weight_offset));
    }
    float ya[kVecElems], yb[kVecElems];
    if (u.rotates[s]) {
      float cos[kVecElems], sin[kVecElems];  // the unit's kVecElems pairs
      unit_cos_sin<T, kHf, CacheT, kVecElems>(p, cache, u.unit[s], cos, sin);
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) {
        if constexpr (kNeox) {  // a = na[j], b = nb[j]: pair j
          ya[j] = rotated<T, kHf>(na[j], nb[j], true, cos[j], sin[j]);
          yb[j] = rotated<T, kHf>(nb[j], na[j], false, cos[j], sin[j]);
        } else {  // pairs (j, j ^ 1) inside each vector: pair j / 2 of a, kVecElems / 2 + j / 2 of b
          const bool is_first = j % 2 == 0;
          const int pair_a = j / 2, pair_b = kVecElems / 2 + j / 2;
          ya[j] = rotated<T, kHf>(na[j], na[j ^ 1], is_first, cos[pair_a], sin[pair_a]);
          yb[j] = rotated<T, kHf>(nb[j], nb[j ^ 1], is_first, cos[pair_b], sin[pair_b]);
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
      qk_norm_rope_v5_kernel<T, kRounding, kHeadDim, kNeox, WeightT, CacheT>
          <<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(p, rows);
    });
  });
  if (!on_vectors) v2::launch_rows<T, kRounding>(p, rows, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm_rope::v5
