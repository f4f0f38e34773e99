// v1: one thread per (token, head) row, the naive port: a warp's loads are head_dim elements apart (uncoalesced)
//
// grid.x: ceil(rows / kThreadsPerBlock); thread -> row. Two passes over the row: the sum of
// squares, then the normalized write (which reads the row again).
#pragma once

#include "qk_norm/rows.cuh"

namespace cookbook::qk_norm::v1 {

constexpr int kThreadsPerBlock = 256;
static_assert(kThreadsPerBlock % kWarpSize == 0, "whole warps per block");

template <typename T, Rounding kRounding>
__global__ void __launch_bounds__(kThreadsPerBlock) qk_norm_v1_kernel(Params p, int64_t rows) {
  constexpr bool kHf = kRounding == Rounding::kHf;
  const int64_t row = blockIdx.x * int64_t{kThreadsPerBlock} + threadIdx.x;
  if (row >= rows) return;  // no barrier or shuffle below: an early exit is safe
  const int heads = p.num_q_heads + p.num_kv_heads;
  const Row<T> r = row_at<T>(p, row / heads, static_cast<int>(row % heads));
  float sum_sq = 0.f;
  for (int d = 0; d < p.head_dim; ++d) {
    const float x = to_float<T>(r.x[d]);
    sum_sq += x * x;
  }
  const float rstd = rstd_from(sum_sq, static_cast<float>(p.head_dim), p.eps);
  for (int d = 0; d < p.head_dim; ++d) {
    const float w = effective_weight<T, kHf>(load_weight<T>(r.w, p.weight_is_fp32, d), p.weight_offset);
    r.x[d] = normalize<T, kHf>(to_float<T>(r.x[d]), rstd, w);
  }
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  using T = Storage<kDType>;
  const int64_t rows = total_rows(p);
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = (rows + kThreadsPerBlock - 1) / kThreadsPerBlock;
  qk_norm_v1_kernel<T, kRounding><<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(p, rows);
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm::v1
