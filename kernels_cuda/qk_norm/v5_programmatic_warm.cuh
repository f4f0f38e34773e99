// v5: a programmatic dependent launch whose first block warms the weights into L2 while waiting - removes the launch gap and the weights' DRAM round trip
//
// A programmatic dependent launch (launch_kernel in include/common.cuh) lets this kernel's blocks
// become resident while the previous kernel in the stream is still running; each block then
// waits in hardware (after_prior_grids) until that kernel's writes are visible. The wait is free
// time for reads of what no kernel in flight writes: block 0's first two lane groups ask L2 for
// q's and k's weights (warm_l2), so every group's weight loads after the wait hit L2. One group
// per weight for the whole call: thousands of requests for the same two lines would queue up.
#pragma once

#include "qk_norm/rows.cuh"
#include "qk_norm/v2_warp_per_row.cuh"  // rows off the vector path

namespace cookbook::qk_norm::v5 {

constexpr int kThreadsPerBlock = 256;
constexpr int kNumWeights = 2;  // q's and k's
static_assert(kThreadsPerBlock % kWarpSize == 0, "whole warps per block");

template <typename T, Rounding kRounding, int kHeadDim>
__global__ void __launch_bounds__(kThreadsPerBlock) qk_norm_v5_kernel(Params p, int64_t rows) {
  using Group = LaneGroup<T, kHeadDim>;
  constexpr int kRowsPerBlock = kThreadsPerBlock / Group::kLanes;
  constexpr bool kHf = kRounding == Rounding::kHf;
  const int lane = threadIdx.x % Group::kLanes;
  const int group = threadIdx.x / Group::kLanes;
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + group;
  const bool active = row < rows;  // a group past the last row still joins its shuffles, on zeros
  const int heads = p.num_q_heads + p.num_kv_heads;
  const Row<T> r = active ? row_at<T>(p, row / heads, static_cast<int>(row % heads)) : Row<T>{};
  static_assert(kRowsPerBlock >= kNumWeights, "block 0 has a lane group per weight");
  if (blockIdx.x == 0 && group < kNumWeights) {  // while the previous kernel still runs
    const void* w = group == 0 ? p.q_weight : p.k_weight;
    const int weight_bytes = p.weight_is_fp32 ? static_cast<int>(sizeof(float)) : static_cast<int>(sizeof(T));
#pragma unroll
    for (int i = 0; i < Group::kVecsPerLane; ++i) warm_l2(static_cast<const char*>(w) + Group::column(lane, i) * weight_bytes);
  }
  after_prior_grids();  // nothing is read before the previous kernel's writes are visible

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
    launch_kernel(/*programmatic=*/true, qk_norm_v5_kernel<T, kRounding, kHeadDim>, dim3(static_cast<unsigned>(blocks)),
                  dim3(kThreadsPerBlock), 0, stream, p, rows);
  });
  if (!on_vectors) v2::launch_rows<T, kRounding>(p, rows, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm::v5
