// v2: one kernel, a lane group per q, k or v row, k stored twice from registers - removes v1's second launch and re-read
//
// grid.x: ceil(rows / kRowsPerBlock), rows = T * (Hq + 2 Hk); lane group -> row (q's heads, then
// k's, then v's of each token), two 16-byte vectors per lane slot (PairLanes in
// qk_norm_rope/rows.cuh). A q or k row is normalized and rotated in registers as in
// qk_norm_rope; a k row is then stored twice from the same registers: back into k, and into the
// k cache at the token's slot. A v row is read once and stored into the v cache. Every byte of k
// and v crosses memory once each way; the tables are read after the sum, as qk_norm_rope's
// rungs 4 and 5 read them. Calls off the vector path run the split path (cache_copy.cuh).
#pragma once

#include "qk_norm_rope_cache/rows.cuh"
#include "qk_norm_rope_cache/cache_copy.cuh"  // calls off the vector path

namespace cookbook::qk_norm_rope_cache::v2 {

constexpr int kThreadsPerBlock = 256;
static_assert(kThreadsPerBlock % kWarpSize == 0, "whole warps per block");

template <typename T, Rounding kRounding, int kHeadDim, bool kNeox, typename WeightT, typename CosSinT,
          CacheDtype kCache>
__global__ void __launch_bounds__(kThreadsPerBlock) qk_norm_rope_cache_v2_kernel(Params p, int64_t rows) {
  using Lanes = PairLanes<T, kHeadDim>;
  using C = CacheElem<T, kCache>;
  constexpr int kRowsPerBlock = kThreadsPerBlock / Lanes::kLanes;
  constexpr int kVecElems = Lanes::kVecElems;
  constexpr int kUnits = Lanes::kUnitsPerLane;
  constexpr bool kHf = kRounding == Rounding::kHf;
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
  // A v row is copied whole: its units are neighbouring vector pairs (no rope layout).
  const LaneUnits<kUnits> u = lane_units<kUnits, kVecElems>(lane, Lanes::kLanes, is_v ? 0 : r.rope_dim, kNeox);

  T* x = nullptr;  // 1. the row
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

  const int64_t cache = qk_norm_rope::cache_row(r, token);  // 4. per unit: normalize, rotate, store
  C* k_dst = slot >= 0 ? cache_row<C>(p.k_cache, slot, p.block_size, kv_head) : nullptr;
  const float k_scale = k_dst != nullptr ? cache_scale<kCache>(p.k_cache) : 1.f;
#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    float wa[kVecElems], wb[kVecElems], cos[kVecElems] = {}, sin[kVecElems] = {};
    load_table<WeightT, kVecElems>(w, u.col_a[s], wa);
    load_table<WeightT, kVecElems>(w, u.col_b[s], wb);
    if (u.rotates[s]) unit_cos_sin<T, kHf, CosSinT, kVecElems>(r, cache, u.unit[s], cos, sin);
    float ya[kVecElems], yb[kVecElems];
    norm_rope_unit<T, kHf, kNeox>(xa[s], xb[s], wa, wb, cos, sin, u.rotates[s], rstd, r.weight_offset, ya, yb);
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
        qk_norm_rope_cache_v2_kernel<T, kRounding, kHeadDim, kNeox, WeightT, CosSinT, kCache>
            <<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(p, rows);
      });
    });
  });
  if (!on_vectors) return copy::launch_split<kDType, kRounding>(p, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm_rope_cache::v2
