// v1: the split path: qk_norm_rope's tuned kernel writes q and k, a copy kernel reads k and v back into the cache slots: two launches
//
// What an engine runs today: its fused norm + RoPE kernel, then a cache-write kernel (vLLM's
// reshape_and_cache_flash, FlashInfer's append_paged_kv_cache). Kernel 1 is qk_norm_rope's tuned
// kernel on q and k, in place (qk_norm_rope/tuned.cuh, as `backend="cuda"` runs it). Kernel 2 is
// the copy (cache_copy.cuh): a warp per (token, kv head) reads the row of k just written and the
// row of v, and stores both at the token's slot (an FP8 cache: x / scale, saturated, to e4m3). k
// crosses memory twice (written, then read again), and the copy cannot start before the rope
// kernel has finished.
#pragma once

#include "qk_norm_rope/tuned.cuh"
#include "qk_norm_rope_cache/cache_copy.cuh"  // the copy kernel

namespace cookbook::qk_norm_rope_cache::v1 {

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  using T = Storage<kDType>;
  if (total_rows(p) == 0) return cudaSuccess;
  const cudaError_t error = qk_norm_rope::tuned::launch<kDType, kRounding>(p.rope, stream);
  if (error != cudaSuccess) return error;
  copy::launch_copy<T>(p, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm_rope_cache::v1
