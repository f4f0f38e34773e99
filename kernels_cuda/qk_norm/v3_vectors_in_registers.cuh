// v3: 16-byte vectors held in registers by a lane group sized to the head, on a persistent grid - removes v2's second read and one-element loads
//
// A group of Group::kLanes lanes owns a row; each lane loads Group::kVecsPerLane 16-byte vectors
// of it into registers, so x is read once and written once. grid.x: the blocks resident at once
// (or fewer); each block takes kRowsPerBlock neighbouring rows per trip and walks on a grid's
// worth of rows at a time. A lane covers the same columns of every row it takes, so it loads its
// columns of both weights once, before the walk.
#pragma once

#include "qk_norm/rows.cuh"
#include "qk_norm/v2_warp_per_row.cuh"  // rows off the vector path

namespace cookbook::qk_norm::v3 {

constexpr int kThreadsPerBlock = 256;
static_assert(kThreadsPerBlock % kWarpSize == 0, "whole warps per block");

template <typename T, Rounding kRounding, int kHeadDim>
__global__ void __launch_bounds__(kThreadsPerBlock) qk_norm_v3_kernel(Params p, int64_t rows) {
  using Group = LaneGroup<T, kHeadDim>;
  constexpr int kRowsPerBlock = kThreadsPerBlock / Group::kLanes;
  constexpr bool kHf = kRounding == Rounding::kHf;
  const int lane = threadIdx.x % Group::kLanes;
  const int group = threadIdx.x / Group::kLanes;
  const int heads = p.num_q_heads + p.num_kv_heads;

  float w_q[Group::kVecsPerLane][Group::kVecElems], w_k[Group::kVecsPerLane][Group::kVecElems];
#pragma unroll
  for (int i = 0; i < Group::kVecsPerLane; ++i) {
#pragma unroll
    for (int j = 0; j < Group::kVecElems; ++j) {
      const int column = Group::column(lane, i) + j;
      w_q[i][j] = effective_weight<T, kHf>(load_weight<T>(p.q_weight, p.weight_is_fp32, column), p.weight_offset);
      w_k[i][j] = effective_weight<T, kHf>(load_weight<T>(p.k_weight, p.weight_is_fp32, column), p.weight_offset);
    }
  }

  // `first` is the same for the whole block, so every lane of a group makes the same trips and the
  // group's shuffles never miss a lane; a group past the last row sums zeros and stores nothing.
  for (int64_t first = blockIdx.x * int64_t{kRowsPerBlock}; first < rows; first += gridDim.x * int64_t{kRowsPerBlock}) {
    const int64_t row = first + group;
    const bool active = row < rows;
    const Row<T> r = active ? row_at<T>(p, row / heads, static_cast<int>(row % heads)) : Row<T>{};
    Vec<T> packed[Group::kVecsPerLane];  // every load of the row in flight before any is used
#pragma unroll
    for (int i = 0; i < Group::kVecsPerLane; ++i) packed[i] = active ? load_vec<T>(r.x + Group::column(lane, i)) : zero_vec<T>();
    float x[Group::kVecsPerLane][Group::kVecElems];
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
        for (int j = 0; j < Group::kVecElems; ++j) y[j] = normalized<T, kHf>(x[i][j], rstd, r.is_q ? w_q[i][j] : w_k[i][j]);
        store_vec<T>(r.x + Group::column(lane, i), pack<T>(y));
      }
    }
  }
}

template <typename T, Rounding kRounding, int kHeadDim>
inline void launch_walk(const Params& p, int64_t rows, cudaStream_t stream) {
  constexpr auto kernel = qk_norm_v3_kernel<T, kRounding, kHeadDim>;
  constexpr int kRowsPerBlock = kThreadsPerBlock / LaneGroup<T, kHeadDim>::kLanes;
  const int64_t needed = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t resident = persistent_grid_limit<kernel>(kThreadsPerBlock);
  kernel<<<static_cast<unsigned>(needed < resident ? needed : resident), kThreadsPerBlock, 0, stream>>>(p, rows);
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  using T = Storage<kDType>;
  const int64_t rows = total_rows(p);
  if (rows == 0) return cudaSuccess;
  const bool on_vectors = rows_are_vectors<T>(p) && with_head_dim<64, 128, 256, 512, 1024>(p.head_dim, [&]<int kHeadDim>() {
    launch_walk<T, kRounding, kHeadDim>(p, rows, stream);
  });
  if (!on_vectors) v2::launch_rows<T, kRounding>(p, rows, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm::v3
