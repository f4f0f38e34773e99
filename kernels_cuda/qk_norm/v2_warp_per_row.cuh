// v2: one warp per (token, head) row with a shuffle reduction: lanes read neighbouring elements (coalesced) - removes v1's scattered loads
//
// grid.x: ceil(rows / kWarpsPerBlock); warp -> row, lane -> elements lane, lane + 32, ... Any even
// head_dim and any alignment: the later rungs and the tuned kernel run it for rows that are not
// whole 16-byte vectors of a head_dim they compile.
#pragma once

#include "qk_norm/rows.cuh"

namespace cookbook::qk_norm::v2 {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreadsPerBlock = kWarpsPerBlock * kWarpSize;

template <typename T, Rounding kRounding>
__global__ void __launch_bounds__(kThreadsPerBlock) qk_norm_v2_kernel(Params p, int64_t rows) {
  constexpr bool kHf = kRounding == Rounding::kHf;
  const int64_t row = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= rows) return;  // uniform per warp: the shuffles below always see a whole warp
  const int heads = p.num_q_heads + p.num_kv_heads;
  const Row<T> r = row_at<T>(p, row / heads, static_cast<int>(row % heads));
  float sum_sq = 0.f;
  for (int d = lane; d < p.head_dim; d += kWarpSize) {
    const float x = to_float<T>(r.x[d]);
    sum_sq += x * x;
  }
  const float rstd = rstd_from(warp_sum(sum_sq), static_cast<float>(p.head_dim), p.eps);
  for (int d = lane; d < p.head_dim; d += kWarpSize) {  // the second read: served by L1/L2
    const float w = effective_weight<T, kHf>(load_weight<T>(r.w, p.weight_is_fp32, d), p.weight_offset);
    r.x[d] = normalize<T, kHf>(to_float<T>(r.x[d]), rstd, w);
  }
}

// Every row of `p` (rows of them, rows > 0), on a grid of a warp per row.
template <typename T, Rounding kRounding>
inline void launch_rows(const Params& p, int64_t rows, cudaStream_t stream) {
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  qk_norm_v2_kernel<T, kRounding><<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(p, rows);
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  const int64_t rows = total_rows(p);
  if (rows == 0) return cudaSuccess;
  launch_rows<Storage<kDType>, kRounding>(p, rows, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm::v2
