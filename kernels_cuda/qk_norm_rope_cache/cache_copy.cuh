// The cache copy of the split path: rung 1's second kernel, and, after qk_norm_rope's warp per row,
// the path every later rung and the tuned kernel take off the vector path.
//
// grid.x: ceil(T * Hk / kWarpsPerBlock); warp -> (token, kv head) row, lane -> elements lane,
// lane + 32, ...: it reads the row of k (as the norm + RoPE kernel wrote it) and the row of v, and
// stores both at the token's slot (an FP8 cache: x / scale, saturated, to e4m3). Element-wise:
// any alignment, stride and head_dim.
#pragma once

#include "qk_norm_rope/v2_one_pass_warp_per_row.cuh"
#include "qk_norm_rope_cache/rows.cuh"

namespace cookbook::qk_norm_rope_cache::copy {

constexpr int kWarpsPerBlock = 8;
constexpr int kCopyThreads = kWarpsPerBlock * kWarpSize;

template <typename T, CacheDtype kCache>
__global__ void __launch_bounds__(kCopyThreads) qk_norm_rope_cache_copy_kernel(Params p, int64_t rows) {
  using C = CacheElem<T, kCache>;
  const int64_t row = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= rows) return;  // no barrier or shuffle below: an early exit is safe
  const int kv_heads = p.rope.num_kv_heads;
  const int64_t token = row / kv_heads;
  const int head = static_cast<int>(row - token * kv_heads);
  const int64_t slot = slot_of(p, token);
  if (slot < 0) return;
  const T* k = static_cast<const T*>(p.rope.k) + token * p.rope.k_token_stride + head * p.rope.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + token * p.v_token_stride + head * p.v_head_stride;
  C* k_row = cache_row<C>(p.k_cache, slot, p.block_size, head);
  C* v_row = cache_row<C>(p.v_cache, slot, p.block_size, head);
  const float k_scale = cache_scale<kCache>(p.k_cache);
  const float v_scale = cache_scale<kCache>(p.v_cache);
  for (int d = lane; d < p.rope.head_dim; d += kWarpSize) k_row[d] = cache_element<T, kCache>(to_float<T>(k[d]), k_scale);
  for (int d = lane; d < p.rope.head_dim; d += kWarpSize) v_row[d] = cache_element<T, kCache>(to_float<T>(v[d]), v_scale);
}

// The copy of every (token, kv head) row of k and v into the caches, after what `stream` holds.
template <typename T>
inline void launch_copy(const Params& p, cudaStream_t stream) {
  const int64_t rows = p.rope.num_tokens * p.rope.num_kv_heads;
  if (rows == 0) return;
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  with_cache_dtype(p, [&]<CacheDtype kCache>() {
    qk_norm_rope_cache_copy_kernel<T, kCache><<<static_cast<unsigned>(blocks), kCopyThreads, 0, stream>>>(p, rows);
  });
}

// Off the vector path: qk_norm_rope's rung 2 (a warp per row, any alignment and head_dim) on q and
// k, then the copy.
template <DType kDType, Rounding kRounding>
cudaError_t launch_split(const Params& p, cudaStream_t stream) {
  using T = Storage<kDType>;
  qk_norm_rope::v2::launch_rows<T, kRounding>(p.rope, qk_norm_rope::total_rows(p.rope), stream);
  launch_copy<T>(p, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm_rope_cache::copy
