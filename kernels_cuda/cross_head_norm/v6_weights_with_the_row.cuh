// v6: each thread's weight vectors loaded with its row, before the block sum, held in registers - removes the weights' round trip after the reduction
//
// grid (tokens, 2) as in rung 2; thread t holds vectors t, t + blockDim.x, ... of its row
// (kVecsPerThread slots, load_row_vectors in rows.cuh), so x is read once and written once, and
// one load instruction of the block reads contiguous memory. The block: the fewest vectors per
// thread (1, 2, 4 or 8) that fit the wider row in kMaxThreads threads, in whole warps; the
// narrower tensor's CTAs leave threads idle. Rows that are not whole aligned vectors, or wider
// than kMaxThreads x kMaxVecsPerThread vectors, take rung 2's kernel. Each byte of x is read once
// and written once, so its loads and stores carry the evict-first policy (ld/st.global.cs:
// load_vec_streaming in include/common.cuh) and the caches keep what is reused: the weights.
// Launched programmatically (launch_kernel in include/common.cuh): the kernel's CTAs become
// resident while the previous kernel in the stream still runs, and after_prior_grids holds each
// in hardware until that kernel's writes are visible; nothing is read before it. A thread's
// weight vectors are loaded just before its row (load_row_weights), so their latency hides under
// the row's, and after the block sum only the arithmetic and the stores are left: a CTA's chain
// is load, sum, store instead of load, sum, load, store.
#pragma once

#include "cross_head_norm/rows.cuh"
#include "cross_head_norm/v2_q_and_k_on_grid_y.cuh"  // rows off the vector path

namespace cookbook::cross_head_norm::v6 {

constexpr bool kStreaming = true;  // x evict-first

template <typename T, Rounding kRounding, int kVecsPerThread>
__global__ void __launch_bounds__(kMaxThreads) cross_head_norm_v6_kernel(Params p) {
  constexpr bool kHf = kRounding == Rounding::kHf;
  const Row<T> r = locate_row<T>(p, blockIdx.x, static_cast<int>(blockIdx.y));
  after_prior_grids();  // read nothing before the previous kernel's writes are visible
  RawWeights<T> w[kVecsPerThread];  // issued first: in flight while the sum waits on x
  load_row_weights<T, kVecsPerThread>(r, threadIdx.x, blockDim.x, w);
  Vec<T> x[kVecsPerThread];  // kept packed across the block reduction: half the registers of float32
  const float sum_sq = load_row_vectors<T, kVecsPerThread, kStreaming>(r, threadIdx.x, blockDim.x, x);
  const float rstd = rstd_from(block_sum(sum_sq), static_cast<float>(r.hidden), p.eps);
  store_row_vectors_held<T, kVecsPerThread, kHf, kStreaming>(r, threadIdx.x, blockDim.x, x, w, rstd, p.weight_offset);
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  using T = Storage<kDType>;
  if (p.num_tokens == 0) return cudaSuccess;
  const int widest_vecs = widest_hidden(p) / Vec<T>::kElems;
  const int vecs = fewest_vecs_per_thread(widest_vecs);
  const bool on_vectors = vector_aligned<T>(p) && with_vecs_per_thread(vecs, [&]<int kVecs>() {
    launch_kernel(/*programmatic=*/true, cross_head_norm_v6_kernel<T, kRounding, kVecs>, token_tensor_grid(p),
                  dim3(threads_for(widest_vecs, kVecs)), 0, stream, p);
  });
  if (!on_vectors) v2::launch_rows<T, kRounding>(p, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::cross_head_norm::v6
