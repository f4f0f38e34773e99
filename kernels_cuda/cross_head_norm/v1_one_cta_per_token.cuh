// v1: one CTA per token normalizes its q row and its k row together: two sums of squares, both weights live, a two-value block reduction
//
// grid.x: token; thread t takes columns t, t + kThreadsPerBlock, ... of BOTH rows in one loop.
// Two passes over memory (the sums, then the writes); the second read is served by L1/L2.
#pragma once

#include "cross_head_norm/rows.cuh"

namespace cookbook::cross_head_norm::v1 {

constexpr int kThreadsPerBlock = 256;
static_assert(valid_block_size<kThreadsPerBlock>, "block_sum: whole warps, at most 1024 threads");

template <typename T, Rounding kRounding>
__global__ void __launch_bounds__(kThreadsPerBlock) cross_head_norm_v1_kernel(Params p) {
  constexpr bool kHf = kRounding == Rounding::kHf;
  const int64_t token = blockIdx.x;
  T* const q = static_cast<T*>(p.q) + token * p.q_token_stride;
  T* const k = static_cast<T*>(p.k) + token * p.k_token_stride;
  const int widest = p.q_hidden > p.k_hidden ? p.q_hidden : p.k_hidden;

  float sum_sq[kNumTensors] = {0.f, 0.f};
  for (int d = threadIdx.x; d < widest; d += kThreadsPerBlock) {
    if (d < p.q_hidden) {
      const float x = to_float<T>(q[d]);
      sum_sq[kQ] += x * x;
    }
    if (d < p.k_hidden) {
      const float x = to_float<T>(k[d]);
      sum_sq[kK] += x * x;
    }
  }
  block_sum<kNumTensors>(sum_sq);  // every thread reaches it: no early exit above
  const float rstd_q = rstd_from(sum_sq[kQ], static_cast<float>(p.q_hidden), p.eps);
  const float rstd_k = rstd_from(sum_sq[kK], static_cast<float>(p.k_hidden), p.eps);

  for (int d = threadIdx.x; d < widest; d += kThreadsPerBlock) {
    if (d < p.q_hidden) {
      const float w = effective_weight<T, kHf>(load_weight<T>(p.q_weight, p.q_weight_is_fp32, d), p.weight_offset);
      q[d] = normalize<T, kHf>(to_float<T>(q[d]), rstd_q, w);
    }
    if (d < p.k_hidden) {
      const float w = effective_weight<T, kHf>(load_weight<T>(p.k_weight, p.k_weight_is_fp32, d), p.weight_offset);
      k[d] = normalize<T, kHf>(to_float<T>(k[d]), rstd_k, w);
    }
  }
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  cross_head_norm_v1_kernel<Storage<kDType>, kRounding><<<static_cast<unsigned>(p.num_tokens), kThreadsPerBlock, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cookbook::cross_head_norm::v1
