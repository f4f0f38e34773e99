// v3: 16-byte vectors of the row held in registers, the block sized to the wider row - removes v2's second read and its one-element loads
//
// grid (tokens, 2) as in rung 2; thread t holds vectors t, t + blockDim.x, ... of its row
// (kVecsPerThread slots, load_row_vectors in rows.cuh), so x is read once and written once, and
// one load instruction of the block reads contiguous memory. The block: the fewest vectors per
// thread (1, 2, 4 or 8) that fit the wider row in kMaxThreads threads, in whole warps; the
// narrower tensor's CTAs leave threads idle. Rows that are not whole aligned vectors, or wider
// than kMaxThreads x kMaxVecsPerThread vectors, take rung 2's kernel.
#pragma once

#include "cross_head_norm/rows.cuh"
#include "cross_head_norm/v2_q_and_k_on_grid_y.cuh"  // rows off the vector path

namespace cookbook::cross_head_norm::v3 {

constexpr bool kStreaming = false;  // x through the caches' default policy

template <typename T, Rounding kRounding, int kVecsPerThread>
__global__ void __launch_bounds__(kMaxThreads) cross_head_norm_v3_kernel(Params p) {
  constexpr bool kHf = kRounding == Rounding::kHf;
  const Row<T> r = locate_row<T>(p, blockIdx.x, static_cast<int>(blockIdx.y));
  Vec<T> x[kVecsPerThread];  // kept packed across the block reduction: half the registers of float32
  const float sum_sq = load_row_vectors<T, kVecsPerThread, kStreaming>(r, threadIdx.x, blockDim.x, x);
  const float rstd = rstd_from(block_sum(sum_sq), static_cast<float>(r.hidden), p.eps);
  store_row_vectors<T, kVecsPerThread, kHf, kStreaming>(r, threadIdx.x, blockDim.x, x, rstd, p.weight_offset);
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  using T = Storage<kDType>;
  if (p.num_tokens == 0) return cudaSuccess;
  const int widest_vecs = widest_hidden(p) / Vec<T>::kElems;
  const int vecs = fewest_vecs_per_thread(widest_vecs);
  const bool on_vectors = vector_aligned<T>(p) && with_vecs_per_thread(vecs, [&]<int kVecs>() {
    cross_head_norm_v3_kernel<T, kRounding, kVecs><<<token_tensor_grid(p), threads_for(widest_vecs, kVecs), 0, stream>>>(p);
  });
  if (!on_vectors) v2::launch_rows<T, kRounding>(p, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::cross_head_norm::v3
