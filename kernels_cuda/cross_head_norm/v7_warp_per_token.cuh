// v7: narrow rows: a warp per token, q row then k row, no block barrier - removes two short CTAs per token whose launches set the time
//
// grid.x: ceil(T / kWarpsPerBlock); warp w of CTA b normalizes token b * kWarpsPerBlock + w: lane l
// holds vectors l, l + 32, ... of the row (kVecsPerLane slots, as many as the wider row needs), a
// warp sum gives its rstd, and the warp goes on to the token's k row. A CTA is kWarpsPerBlock
// tokens, where rung 6 launches two CTAs per token: at rows of a few hundred to a few thousand
// bytes each CTA lives a few hundred cycles, and the SMs run out of CTA launches before the
// bytes run out of bandwidth. x is streamed and the launch is programmatic, as in rungs 4-5; the
// weights are loaded after the sum (a lane's two rows would hold twice the weights). Rows wider
// than kMaxVecsPerLane vectors per lane, or not whole aligned vectors, run rung 6.
#pragma once

#include "cross_head_norm/rows.cuh"
#include "cross_head_norm/v6_weights_with_the_row.cuh"  // wider rows

namespace cookbook::cross_head_norm::v7 {

constexpr int kWarpsPerBlock = 4;  // tokens per CTA
constexpr int kThreadsPerBlock = kWarpsPerBlock * kWarpSize;
constexpr int kMaxVecsPerLane = 8;  // 8 x 16 bytes = 32 registers of row per lane, as a rung 3 thread's
constexpr int kMaxRowVecs = kMaxVecsPerLane * kWarpSize;
constexpr bool kStreaming = true;
static_assert(valid_block_size<kThreadsPerBlock>, "whole warps, at most 1024 threads");
static_assert(kMaxVecsPerLane == kMaxVecsPerThread, "with_vecs_per_thread compiles the lane's vector counts");

template <typename T, Rounding kRounding, int kVecsPerLane>
__global__ void __launch_bounds__(kThreadsPerBlock) cross_head_norm_v7_kernel(Params p) {
  static_assert(kVecsPerLane >= 1 && kVecsPerLane <= kMaxVecsPerLane, "a lane holds 1..8 vectors");
  constexpr bool kHf = kRounding == Rounding::kHf;
  after_prior_grids();  // read nothing before the previous kernel's writes are visible
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (token >= p.num_tokens) return;  // a whole warp leaves: nothing below waits on other warps
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int tensor = kQ; tensor < kNumTensors; ++tensor) {
    const Row<T> r = locate_row<T>(p, token, tensor);
    Vec<T> x[kVecsPerLane];
    const float sum_sq = load_row_vectors<T, kVecsPerLane, kStreaming>(r, lane, kWarpSize, x);
    const float rstd = rstd_from(warp_sum(sum_sq), static_cast<float>(r.hidden), p.eps);
    store_row_vectors<T, kVecsPerLane, kHf, kStreaming>(r, lane, kWarpSize, x, rstd, p.weight_offset);
  }
}

// The lane's vector slots for rows of `row_vecs` vectors: 1, 2, 4 or 8 (0 past kMaxRowVecs).
constexpr int vecs_per_lane(int row_vecs) {
  for (int vecs = 1; vecs <= kMaxVecsPerLane; vecs *= 2) {
    if (row_vecs <= kWarpSize * vecs) return vecs;
  }
  return 0;
}

// Every token of `p` (p.num_tokens > 0) a warp, where `vecs` is 1, 2, 4 or 8; returns whether it was.
template <typename T, Rounding kRounding>
inline bool launch_tokens(const Params& p, int vecs, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock));
  return with_vecs_per_thread(vecs, [&]<int kVecs>() {
    launch_kernel(/*programmatic=*/true, cross_head_norm_v7_kernel<T, kRounding, kVecs>, grid, dim3(kThreadsPerBlock), 0,
                  stream, p);
  });
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  using T = Storage<kDType>;
  if (p.num_tokens == 0) return cudaSuccess;
  const int widest_vecs = widest_hidden(p) / Vec<T>::kElems;
  const bool narrow = vector_aligned<T>(p) && widest_vecs <= kMaxRowVecs;
  if (!narrow || !launch_tokens<T, kRounding>(p, vecs_per_lane(widest_vecs), stream)) {
    return v6::launch<kDType, kRounding>(p, stream);
  }
  return cudaGetLastError();
}

}  // namespace cookbook::cross_head_norm::v7
