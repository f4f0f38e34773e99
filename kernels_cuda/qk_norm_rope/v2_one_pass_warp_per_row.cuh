// v2: one kernel, a warp per row, each lane owning whole (a, b) pairs - removes v1's second launch and its float32 round trip through memory
//
// grid.x: ceil(rows / kWarpsPerBlock); warp -> row. Pass 1: lane-strided sum of squares.
// Pass 2: lane -> pairs lane, lane + 32, ...: it reads both members (NeoX: one from each half,
// each coalesced across the warp; interleaved: neighbours), normalizes, rotates and writes both;
// then the pass-through dims. Nothing waits for a partner in another lane. The second read of
// the row is served by L1/L2. Any even head_dim and rope_dim and any alignment: the later rungs
// and the tuned kernel run it for calls their vector kernels do not take.
#pragma once

#include "qk_norm_rope/rows.cuh"

namespace cookbook::qk_norm_rope::v2 {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreadsPerBlock = kWarpsPerBlock * kWarpSize;

template <typename T, Rounding kRounding>
__global__ void __launch_bounds__(kThreadsPerBlock) qk_norm_rope_v2_kernel(Params p, int64_t rows) {
  constexpr bool kHf = kRounding == Rounding::kHf;
  const int64_t row = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= rows) return;  // uniform per warp: the shuffles below always see a whole warp
  const int heads = p.num_q_heads + p.num_kv_heads;
  const int64_t token = row / heads;
  const Row<T> r = row_at<T>(p, token, static_cast<int>(row % heads));
  float sum_sq = 0.f;
  for (int d = lane; d < p.head_dim; d += kWarpSize) {
    const float x = to_float<T>(r.x[d]);
    sum_sq += x * x;
  }
  const float rstd = rstd_from(warp_sum(sum_sq), static_cast<float>(p.head_dim), p.eps);
  auto norm_at = [&](int d) {  // the second read: served by L1/L2
    const float w = effective_weight<T, kHf>(load_weight<T>(r.w, p.weight_is_fp32, d), p.weight_offset);
    return normalized<T, kHf>(to_float<T>(r.x[d]), rstd, w);
  };
  const int64_t cache = cache_row(p, token);
  for (int pair = lane; pair < p.rope_dim / 2; pair += kWarpSize) {
    const int a_dim = p.is_neox ? pair : 2 * pair;
    const int b_dim = pair_slot(a_dim, p.rope_dim, p.is_neox).partner;
    const float a = norm_at(a_dim), b = norm_at(b_dim);
    float cos, sin;
    load_cos_sin<T, kHf>(p, cache, pair, cos, sin);
    r.x[a_dim] = from_float<T>(rotated<T, kHf>(a, b, true, cos, sin));
    r.x[b_dim] = from_float<T>(rotated<T, kHf>(b, a, false, cos, sin));
  }
  for (int d = p.rope_dim + lane; d < p.head_dim; d += kWarpSize) r.x[d] = from_float<T>(norm_at(d));
}

// Every row of `p` (rows of them, rows > 0), on a grid of a warp per row.
template <typename T, Rounding kRounding>
inline void launch_rows(const Params& p, int64_t rows, cudaStream_t stream) {
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  qk_norm_rope_v2_kernel<T, kRounding><<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(p, rows);
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  const int64_t rows = total_rows(p);
  if (rows == 0) return cudaSuccess;
  launch_rows<Storage<kDType>, kRounding>(p, rows, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm_rope::v2
