// v1: the split path: a norm kernel writes float32 scratch, a rope kernel reads it back and rotates: two launches, two passes over q and k
//
// What a model runs without a fused op: RMSNorm, then rotary embedding, each its own kernel.
// Kernel 1 (norm): grid.x: ceil(rows / kWarpsPerBlock); warp -> row, lane -> elements lane,
// lane + 32, ...: a shuffle sum of squares, then n = x * rstd * w written to scratch in float32 (a
// rounded intermediate would add a rounding the fused contract does not allow).
// Kernel 2 (rope): grid.x: ceil(rows * head_dim / kRopeThreads); thread -> one element: it reads
// its element and its partner's from scratch, its token's cos and sin, and writes x.
// Every element crosses memory four times (x read, n written, n read, x written) where the op
// needs two, and the second kernel cannot start before the first has finished.
#pragma once

#include "qk_norm_rope/rows.cuh"

namespace cookbook::qk_norm_rope::v1 {

constexpr int kWarpsPerBlock = 8;
constexpr int kNormThreads = kWarpsPerBlock * kWarpSize;
constexpr int kRopeThreads = 256;
static_assert(kRopeThreads % kWarpSize == 0, "whole warps per block");

template <typename T, Rounding kRounding>
__global__ void __launch_bounds__(kNormThreads) qk_norm_rope_v1_norm_kernel(Params p, float* n, int64_t rows) {
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
  float* n_row = n + row * p.head_dim;
  for (int d = lane; d < p.head_dim; d += kWarpSize) {
    const float w = effective_weight<T, kHf>(load_weight<T>(r.w, p.weight_is_fp32, d), p.weight_offset);
    n_row[d] = normalized<T, kHf>(to_float<T>(r.x[d]), rstd, w);
  }
}

template <typename T, Rounding kRounding>
__global__ void __launch_bounds__(kRopeThreads) qk_norm_rope_v1_rope_kernel(Params p, const float* n, int64_t elements) {
  constexpr bool kHf = kRounding == Rounding::kHf;
  const int64_t e = blockIdx.x * int64_t{kRopeThreads} + threadIdx.x;
  if (e >= elements) return;  // no barrier or shuffle below: an early exit is safe
  const int64_t row = e / p.head_dim;
  const int d = static_cast<int>(e - row * p.head_dim);
  const int heads = p.num_q_heads + p.num_kv_heads;
  const int64_t token = row / heads;
  const Row<T> r = row_at<T>(p, token, static_cast<int>(row % heads));
  const float* n_row = n + row * p.head_dim;
  float y = n_row[d];
  if (d < p.rope_dim) {
    const PairSlot s = pair_slot(d, p.rope_dim, p.is_neox);
    float cos, sin;
    load_cos_sin<T, kHf>(p, cache_row(p, token), s.pair, cos, sin);
    y = rotated<T, kHf>(y, n_row[s.partner], s.is_first, cos, sin);
  }
  r.x[d] = from_float<T>(y);
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  using T = Storage<kDType>;
  const int64_t rows = total_rows(p);
  if (rows == 0) return cudaSuccess;
  const int64_t elements = rows * p.head_dim;
  float* n = p.scratch.allocate == nullptr ? nullptr : p.scratch.allocate(p.scratch.owner, elements);
  if (n == nullptr) return cudaErrorInvalidValue;  // the split path needs its scratch
  const int64_t norm_blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  qk_norm_rope_v1_norm_kernel<T, kRounding><<<static_cast<unsigned>(norm_blocks), kNormThreads, 0, stream>>>(p, n, rows);
  const int64_t rope_blocks = (elements + kRopeThreads - 1) / kRopeThreads;
  qk_norm_rope_v1_rope_kernel<T, kRounding><<<static_cast<unsigned>(rope_blocks), kRopeThreads, 0, stream>>>(p, n, elements);
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm_rope::v1
