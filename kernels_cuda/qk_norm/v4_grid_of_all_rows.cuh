// v4: a grid of all rows, one per lane group, handed to SMs as they free a slot - removes v3's fixed share of rows per SM
//
// grid.x: ceil(rows / kRowsPerBlock); lane group -> row. A persistent grid gives every SM the
// same share of rows up front, and a call lasts as long as its slowest SM; here a block that
// finishes frees its slot for the next one. What it gives up is v3's weights held for a whole
// walk: each group loads its row's weight right after the row, while the row is in flight.
#pragma once

#include "qk_norm/rows.cuh"
#include "qk_norm/v2_warp_per_row.cuh"  // rows off the vector path

namespace cookbook::qk_norm::v4 {

constexpr int kThreadsPerBlock = 256;
static_assert(kThreadsPerBlock % kWarpSize == 0, "whole warps per block");

template <typename T, Rounding kRounding, int kHeadDim>
__global__ void __launch_bounds__(kThreadsPerBlock) qk_norm_v4_kernel(Params p, int64_t rows) {
  using Group = LaneGroup<T, kHeadDim>;
  constexpr int kRowsPerBlock = kThreadsPerBlock / Group::kLanes;
  constexpr bool kHf = kRounding == Rounding::kHf;
  const int lane = threadIdx.x % Group::kLanes;
  const int group = threadIdx.x / Group::kLanes;
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + group;
  const bool active = row < rows;  // a group past the last row still joins its shuffles, on zeros
  const int heads = p.num_q_heads + p.num_kv_heads;
  const Row<T> r = active ? row_at<T>(p, row / heads, static_cast<int>(row % heads)) : Row<T>{};

  Vec<T> packed[Group::kVecsPerLane];  // 1. the row
#pragma unroll
  for (int i = 0; i < Group::kVecsPerLane; ++i) packed[i] = active ? load_vec<T>(r.x + Group::column(lane, i)) : zero_vec<T>();
  float w[Group::kVecsPerLane][Group::kVecElems] = {};  // 2. its weight, while the row is in flight
  if (active) {
#pragma unroll
    for (int i = 0; i < Group::kVecsPerLane; ++i) {
#pragma unroll
      for (int j = 0; j < Group::kVecElems; ++j) {
        w[i][j] = effective_weight<T, kHf>(load_weight<T>(r.w, p.weight_is_fp32, Group::column(lane, i) + j), p.weight_offset);
      }
    }
  }
  float x[Group::kVecsPerLane][Group::kVecElems];  // 3. sum, rstd, normalize, store
  float sum_sq = 0.f;
#pragma unroll
  for (int i = 0; i < Group::kVecsPerLane; ++i) {
    unpack<T>(packed[i], x[i]);
#pragma unroll
    for (int j = 0; j < Group::kVecElems; ++j) sum_sq += x[i][j] * x[i][j];
  }
  const float rstd = rstd_from(warp_sum<Group::kLanes>(sum_sq), static_cast<float>(kHeadDim), p.eps);
  if (active) {
#pragma unroll
    for (int i = 0; i < Group::kVecsPerLane; ++i) {
      float y[Group::kVecElems];
#pragma unroll
      for (int j = 0; j < Group::kVecElems; ++j) y[j] = normalized<T, kHf>(x[i][j], rstd, w[i][j]);
      store_vec<T>(r.x + Group::column(lane, i), pack<T>(y));
    }
  }
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  using T = Storage<kDType>;
  const int64_t rows = total_rows(p);
  if (rows == 0) return cudaSuccess;
  const bool on_vectors = rows_are_vectors<T>(p) && with_head_dim<64, 128, 256, 512, 1024>(p.head_dim, [&]<int kHeadDim>() {
    constexpr int kRowsPerBlock = kThreadsPerBlock / LaneGroup<T, kHeadDim>::kLanes;
    const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
    qk_norm_v4_kernel<T, kRounding, kHeadDim><<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(p, rows);
  });
  if (!on_vectors) v2::launch_rows<T, kRounding>(p, rows, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm::v4
