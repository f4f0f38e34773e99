// qk_norm_rope_cache's launch arguments: qk_norm_rope's, plus v, the two paged caches and the slots.
// Plain C++ (no device code), so the binding compiles with the host compiler.
//
//   q, k: normalized and rotated in place, exactly as qk_norm_rope (position_offset 0);
//   for token t with slot s = slot_mapping[t] (-1, or out of range: nothing written) and kv head h:
//   k_cache[s / block_size][s % block_size][h] = store(k'[t][h]),  v_cache[...][h] = store(v[t][h])
//   store(x) = x in the activation dtype, or e4m3(saturate(float(x) / scale)) for an FP8 cache,
//   x being k' as rounded to the activation dtype (the value k holds).
//
// Rows are numbered token-major over q's heads, then k's, then v's: row r is token
// r / (Hq + 2 Hk), head r % (Hq + 2 Hk). Rung 1 hands q and k to qk_norm_rope's tuned kernel as
// they are (`rope`), then copies k and v.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "include/dtype.h"
#include "qk_norm_rope/params.h"
#include "qk_norm_rope_cache/cache_dtype.h"

namespace cookbook::qk_norm_rope_cache {

// One paged cache [num_blocks, block_size, num_kv_heads, head_dim], strides in elements of its
// dtype, the last dim contiguous.
struct Cache {
  void* data = nullptr;
  int64_t block_stride = 0;
  int64_t slot_stride = 0;
  int64_t head_stride = 0;
  const float* scale = nullptr;  // an FP8 cache's per-tensor scale: one float32 on the device
};

struct Params {
  qk_norm_rope::Params rope;   // q, k, the weights, the cos/sin table, positions (position_offset 0)
  const void* v;               // [T, Hk, D] in the activation dtype, last dim contiguous
  int64_t v_token_stride, v_head_stride;  // in elements
  Cache k_cache;
  Cache v_cache;
  CacheDtype cache_dtype;
  const void* slot_mapping;    // [T], int32 or int64
  bool slots_are_int64;
  int64_t block_size;
  int64_t num_slots;           // num_blocks * block_size
};

// The rows of a token: q's heads, k's heads, v's heads.
inline int heads_per_token(const Params& p) { return p.rope.num_q_heads + 2 * p.rope.num_kv_heads; }
inline int64_t total_rows(const Params& p) { return p.rope.num_tokens * heads_per_token(p); }

// Every kernel file (a rung or the tuned kernel) defines, in its own namespace,
//   template <DType kDType, Rounding kRounding> cudaError_t launch(const Params& p, cudaStream_t stream);
using Launcher = cudaError_t (*)(const Params&, cudaStream_t);

}  // namespace cookbook::qk_norm_rope_cache
