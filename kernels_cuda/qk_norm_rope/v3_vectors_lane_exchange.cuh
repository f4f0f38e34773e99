// v3: the row in registers as 16-byte vectors, a lane per vector; a NeoX partner fetched by a shuffle - removes v2's second read and 2-byte loads
//
// grid.x: ceil(rows / kRowsPerBlock); lane group -> row (VectorLanes in rows.cuh: one lane per
// 16-byte vector of the row, 16 lanes at head_dim 128 in bf16). The row is read once, into
// registers, and stays there: its sum, its normalization and its rotation. An interleaved pair
// (2i, 2i + 1) sits inside one vector; a NeoX pair (i, i + rope_dim / 2) spans two vectors
// rope_dim / 2 elements apart, held by two lanes of the group, so each lane fetches its partner's
// normalized values with a warp shuffle (which sends one register for every lane at once: a lane
// shuffles each of its slots and keeps the one that holds its partner). Each lane reads the cos
// and sin of its own vector's pairs; the lane of a NeoX pair's other member reads them too.
#pragma once

#include "qk_norm_rope/rows.cuh"
#include "qk_norm_rope/v2_one_pass_warp_per_row.cuh"  // calls off the vector path

namespace cookbook::qk_norm_rope::v3 {

constexpr int kThreadsPerBlock = 256;
static_assert(kThreadsPerBlock % kWarpSize == 0, "whole warps per block");

template <typename T, Rounding kRounding, int kHeadDim>
__global__ void __launch_bounds__(kThreadsPerBlock) qk_norm_rope_v3_kernel(Params p, int64_t rows) {
  using Lanes = VectorLanes<T, kHeadDim>;
  constexpr int kRowsPerBlock = kThreadsPerBlock / Lanes::kLanes;
  constexpr int kVecElems = Lanes::kVecElems;
  constexpr int kSlots = Lanes::kVecsPerLane;
  constexpr bool kHf = kRounding == Rounding::kHf;
  const int lane = threadIdx.x % Lanes::kLanes;
  const int group = threadIdx.x / Lanes::kLanes;
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + group;
  const bool active = row < rows;  // a group past the last row still joins its shuffles, on zeros
  const int heads = p.num_q_heads + p.num_kv_heads;
  const int64_t token = active ? row / heads : 0;
  const Row<T> r = active ? row_at<T>(p, token, static_cast<int>(row % heads)) : Row<T>{};

  float n[kSlots][kVecElems];  // 1. the row, its sum of squares
  float sum_sq = 0.f;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    unpack<T>(active ? load_vec<T>(r.x + Lanes::vector(lane, i) * kVecElems) : zero_vec<T>(), n[i]);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) sum_sq += n[i][j] * n[i][j];
  }
  const float rstd = rstd_from(warp_sum<Lanes::kLanes>(sum_sq), static_cast<float>(kHeadDim), p.eps);
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {  // 2. normalized in place: n = x * rstd * w
    float w[kVecElems] = {};
    if (active) load_floats<T, kVecElems>(r.w, p.weight_is_fp32, Lanes::vector(lane, i) * kVecElems, w);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) n[i][j] = normalized<T, kHf>(n[i][j], rstd, effective_weight<T, kHf>(w[j], p.weight_offset));
  }

  // 3. Each element's partner: interleaved, its neighbour in the same vector; NeoX, the same
  // element of the vector half_vecs away, in lane partner % kLanes, slot partner / kLanes.
  const int half_vecs = p.rope_dim / 2 / kVecElems;
  float partner[kSlots][kVecElems];
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int v = Lanes::vector(lane, i);
    if (p.is_neox) {  // uniform across the grid: every lane of the warp shuffles
      const int other = v >= 2 * half_vecs ? v : v < half_vecs ? v + half_vecs : v - half_vecs;
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
#pragma unroll
        for (int j = 0; j < kVecElems; ++j) {
          const float got = __shfl_sync(kFullMask, n[s][j], other % Lanes::kLanes, Lanes::kLanes);
          if (s == other / Lanes::kLanes) partner[i][j] = got;
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) partner[i][j] = n[i][j ^ 1];
    }
  }

  if (!active) return;  // 4. rotate with the vector's cos/sin run, and store
  const int64_t cache = cache_row(p, token);
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int v = Lanes::vector(lane, i);
    float y[kVecElems];
    if (v >= 2 * half_vecs) {  // past rope_dim: passed through
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) y[j] = n[i][j];
    } else if (p.is_neox) {  // element j is pair (v % half_vecs) * kVecElems + j
      const bool is_first = v < half_vecs;
      float cos[kVecElems], sin[kVecElems];
      load_cos_sin_run<T, kVecElems, kHf>(p, cache, (is_first ? v : v - half_vecs) * kVecElems, cos, sin);
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) y[j] = rotated<T, kHf>(n[i][j], partner[i][j], is_first, cos[j], sin[j]);
    } else {  // element j is pair (v * kVecElems + j) / 2
      float cos[kVecElems / 2], sin[kVecElems / 2];
      load_cos_sin_run<T, kVecElems / 2, kHf>(p, cache, v * kVecElems / 2, cos, sin);
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) y[j] = rotated<T, kHf>(n[i][j], partner[i][j], j % 2 == 0, cos[j / 2], sin[j / 2]);
    }
    store_vec<T>(r.x + v * kVecElems, pack<T>(y));
  }
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  using T = Storage<kDType>;
  const int64_t rows = total_rows(p);
  if (rows == 0) return cudaSuccess;
  const bool on_vectors = vector_path_ok<T>(p) && with_vector_head_dim(p.head_dim, [&]<int kHeadDim>() {
    constexpr int kRowsPerBlock = kThreadsPerBlock / VectorLanes<T, kHeadDim>::kLanes;
    const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
    qk_norm_rope_v3_kernel<T, kRounding, kHeadDim><<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(p, rows);
  });
  if (!on_vectors) v2::launch_rows<T, kRounding>(p, rows, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm_rope::v3
