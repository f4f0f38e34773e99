// v2: q and k split over grid.y: one row, one sum and one weight per CTA - removes v1's second sum, row and weight from each thread
//
// grid.x: token, grid.y: tensor (kQ, kK); thread t takes columns t, t + kThreadsPerBlock, ... of
// its CTA's row. Half the live registers of rung 1, so more CTAs fit an SM, and twice the CTAs to
// spread over the SMs. Any even width at any alignment: the later rungs and the tuned kernel run
// it for rows that are not whole 16-byte vectors, or wider than a block's registers hold.
#pragma once

#include "cross_head_norm/rows.cuh"

namespace cookbook::cross_head_norm::v2 {

constexpr int kThreadsPerBlock = 256;
static_assert(valid_block_size<kThreadsPerBlock>, "block_sum: whole warps, at most 1024 threads");

template <typename T, Rounding kRounding>
__global__ void __launch_bounds__(kThreadsPerBlock) cross_head_norm_v2_kernel(Params p) {
  constexpr bool kHf = kRounding == Rounding::kHf;
  const Row<T> r = locate_row<T>(p, blockIdx.x, static_cast<int>(blockIdx.y));

  float sum_sq = 0.f;
  for (int d = threadIdx.x; d < r.hidden; d += kThreadsPerBlock) {
    const float x = to_float<T>(r.x[d]);
    sum_sq += x * x;
  }
  const float rstd = rstd_from(block_sum(sum_sq), static_cast<float>(r.hidden), p.eps);

  for (int d = threadIdx.x; d < r.hidden; d += kThreadsPerBlock) {  // the second read: served by L1/L2
    const float w = effective_weight<T, kHf>(load_weight<T>(r.w, r.w_is_fp32, d), p.weight_offset);
    r.x[d] = normalize<T, kHf>(to_float<T>(r.x[d]), rstd, w);
  }
}

// Every row of `p` (p.num_tokens > 0), on the (tokens, 2) grid.
template <typename T, Rounding kRounding>
inline void launch_rows(const Params& p, cudaStream_t stream) {
  cross_head_norm_v2_kernel<T, kRounding><<<token_tensor_grid(p), kThreadsPerBlock, 0, stream>>>(p);
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  launch_rows<Storage<kDType>, kRounding>(p, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::cross_head_norm::v2
