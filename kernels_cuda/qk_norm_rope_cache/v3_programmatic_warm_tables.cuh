// v3: a programmatic launch, tables and slots warmed into L2 during its wait, read with the row - removes the launch gap and decode's table round trips
//
// grid.x: ceil(rows / kRowsPerBlock); lane group -> row, as in v2. At decode a call is a few
// hundred rows and its time a chain of round trips: the row, its token's position and slot, the
// cos/sin run the position points at, the weights. Launched as a programmatic dependent launch
// (launch_kernel in include/common.cuh), the blocks become resident while the previous kernel
// still runs and wait in hardware (after_prior_grids) for its writes. During the wait, block 0's
// first two lane groups warm q's and k's weights into L2 (warm_l2), and the group of each
// token's first head warms its position, its slot and its cos/sin run (aimed by a speculative
// read of the position from L2, used for nothing but the prefetch address), as qk_norm_rope's
// rung 6 does. After the wait a lane reads its tables right behind its row, before the sum.
#pragma once

#include "qk_norm_rope_cache/rows.cuh"
#include "qk_norm_rope_cache/cache_copy.cuh"  // calls off the vector path

namespace cookbook::qk_norm_rope_cache::v3 {

constexpr int kThreadsPerBlock = 256;
constexpr int kNumWeights = 2;  // q's and k's
static_assert(kThreadsPerBlock % kWarpSize == 0, "whole warps per block");

template <typename T, Rounding kRounding, int kHeadDim, bool kNeox, typename WeightT, typename CosSinT,
          CacheDtype kCache>
__global__ void __launch_bounds__(kThreadsPerBlock) qk_norm_rope_cache_v3_kernel(Params p, int64_t rows) {
  using Lanes = PairLanes<T, kHeadDim>;
  using C = CacheElem<T, kCache>;
  constexpr int kRowsPerBlock = kThreadsPerBlock / Lanes::kLanes;
  constexpr int kVecElems = Lanes::kVecElems;
  constexpr int kUnits = Lanes::kUnitsPerLane;
  constexpr bool kHf = kRounding == Rounding::kHf;
  static_assert(kRowsPerBlock >= kNumWeights, "block 0 has a lane group per weight");
  const qk_norm_rope::Params& r = p.rope;
  const int lane = threadIdx.x % Lanes::kLanes;
  const int group = threadIdx.x / Lanes::kLanes;
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + group;
  const bool active = row < rows;  // a group past the last row still joins its shuffles, on zeros
  const int heads = r.num_q_heads + 2 * r.num_kv_heads;  // q's, k's and v's
  const int64_t token = active ? row / heads : 0;
  const int head = active ? static_cast<int>(row % heads) : 0;
  const int kv_head = head - r.num_q_heads;  // k's head (< Hk), then v's (>= Hk)
  const bool is_v = kv_head >= r.num_kv_heads;
  const bool is_k = kv_head >= 0 && !is_v;
  const LaneUnits<kUnits> u = lane_units<kUnits, kVecElems>(lane, Lanes::kLanes, is_v ? 0 : r.rope_dim, kNeox);

  if (blockIdx.x == 0 && group < kNumWeights) {  // 0. while the previous kernel still runs
    const WeightT* w = static_cast<const WeightT*>(group == 0 ? r.q_weight : r.k_weight);
#pragma unroll
    for (int s = 0; s < kUnits; ++s) {
      warm_l2(w + u.col_a[s]);
      warm_l2(w + u.col_b[s]);
    }
  }
  if (active && head == 0) {
    warm_l2(static_cast<const char*>(p.slot_mapping) + token * (p.slots_are_int64 ? 8 : 4));
    const int64_t guess = (r.positions_are_int64 ? __ldcg(static_cast<const long long*>(r.positions) + token)
                                                 : __ldcg(static_cast<const int*>(r.positions) + token));
    if (guess >= 0 && guess < r.max_position) {
      const CosSinT* cos_row = static_cast<const CosSinT*>(r.cos_sin_cache) + guess * r.rope_dim;
#pragma unroll
      for (int s = 0; s < kUnits; ++s) {
        if (!u.rotates[s]) continue;
        warm_l2(cos_row + u.unit[s] * kVecElems);
        warm_l2(cos_row + r.rope_dim / 2 + u.unit[s] * kVecElems);
      }
    }
  }
  after_prior_grids();  // nothing is read before the previous kernel's writes are visible

  T* x = nullptr;  // 1. the row, and right behind it its tables and slot
  const void* w = nullptr;
  if (active && !is_v) {
    const qk_norm_rope::Row<T> at = qk_norm_rope::row_at<T>(r, token, head);
    x = at.x;
    w = at.w;
  } else if (active) {
    x = const_cast<T*>(static_cast<const T*>(p.v)) + token * p.v_token_stride + (kv_head - r.num_kv_heads) * p.v_head_stride;
  }
  Vec<T> a[kUnits], b[kUnits];
#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    a[s] = active ? load_vec<T>(x + u.col_a[s]) : zero_vec<T>();
    b[s] = active ? load_vec<T>(x + u.col_b[s]) : zero_vec<T>();
  }
  const int64_t slot = active && (is_k || is_v) ? slot_of(p, token) : -1;
  const int64_t cache = active && !is_v ? qk_norm_rope::cache_row(r, token) : -1;
  float wa[kUnits][kVecElems] = {}, wb[kUnits][kVecElems] = {}, cos[kUnits][kVecElems] = {}, sin[kUnits][kVecElems] = {};
  if (active && !is_v) {
#pragma unroll
    for (int s = 0; s < kUnits; ++s) {
      load_table<WeightT, kVecElems>(w, u.col_a[s], wa[s]);
      load_table<WeightT, kVecElems>(w, u.col_b[s], wb[s]);
      if (u.rotates[s]) unit_cos_sin<T, kHf, CosSinT, kVecElems>(r, cache, u.unit[s], cos[s], sin[s]);
    }
  }

  if (is_v && slot >= 0) {  // 2v. the v row into its slot, before the sum (which it only joins)
    C* dst = cache_row<C>(p.v_cache, slot, p.block_size, kv_head - r.num_kv_heads);
    const float scale = cache_scale<kCache>(p.v_cache);
#pragma unroll
    for (int s = 0; s < kUnits; ++s) {
      store_cache<T, kCache, 1>(dst + u.col_a[s], {a[s]}, scale);
      store_cache<T, kCache, 1>(dst + u.col_b[s], {b[s]}, scale);
    }
  }
  float xa[kUnits][kVecElems], xb[kUnits][kVecElems];  // 3. the sum of squares (v rows add nothing)
  float sum_sq = 0.f;
#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    unpack<T>(a[s], xa[s]);
    unpack<T>(b[s], xb[s]);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) sum_sq += is_v ? 0.f : xa[s][j] * xa[s][j] + xb[s][j] * xb[s][j];
  }
  const float rstd = rstd_from(warp_sum<Lanes::kLanes>(sum_sq), static_cast<float>(kHeadDim), r.eps);
  if (!active || is_v) return;

  C* k_dst = slot >= 0 ? cache_row<C>(p.k_cache, slot, p.block_size, kv_head) : nullptr;  // 4. per unit
  const float k_scale = k_dst != nullptr ? cache_scale<kCache>(p.k_cache) : 1.f;
#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    float ya[kVecElems], yb[kVecElems];
    norm_rope_unit<T, kHf, kNeox>(xa[s], xb[s], wa[s], wb[s], cos[s], sin[s], u.rotates[s], rstd, r.weight_offset, ya,
                                  yb);
    const Vec<T> ra = pack<T>(ya), rb = pack<T>(yb);
    store_vec<T>(x + u.col_a[s], ra);
    store_vec<T>(x + u.col_b[s], rb);
    if (k_dst != nullptr) {  // the same registers into the k cache
      store_cache<T, kCache, 1>(k_dst + u.col_a[s], {ra}, k_scale);
      store_cache<T, kCache, 1>(k_dst + u.col_b[s], {rb}, k_scale);
    }
  }
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  using T = Storage<kDType>;
  const int64_t rows = total_rows(p);
  if (rows == 0) return cudaSuccess;
  const bool on_vectors = vector_path_ok<T>(p) && qk_norm_rope::with_vector_head_dim(p.rope.head_dim, [&]<int kHeadDim>() {
    constexpr int kRowsPerBlock = kThreadsPerBlock / PairLanes<T, kHeadDim>::kLanes;
    const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
    with_tables<T>(p, [&]<bool kNeox, typename WeightT, typename CosSinT>() {
      with_cache_dtype(p, [&]<CacheDtype kCache>() {
        launch_kernel(/*programmatic=*/true, qk_norm_rope_cache_v3_kernel<T, kRounding, kHeadDim, kNeox, WeightT, CosSinT, kCache>,
                      dim3(static_cast<unsigned>(blocks)), dim3(kThreadsPerBlock), 0, stream, p, rows);
      });
    });
  });
  if (!on_vectors) return copy::launch_split<kDType, kRounding>(p, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm_rope_cache::v3
