// qk_norm_rope's launch arguments: what every rung and the tuned kernel take, and what the torch
// binding fills in. Plain C++ (no device code), so the binding compiles with the host compiler.
//
//   per (token, head) row x of length head_dim, float32 accumulation:
//   n  = x * rsqrt(mean(x^2) + eps) * (w + weight_offset)              (qk_norm's math)
//   for pair i < rope_dim / 2, dims (a, b) = (i, i + rope_dim/2) NeoX, or (2i, 2i + 1) interleaved:
//   a' = a * cos_i - b * sin_i,   b' = b * cos_i + a * sin_i           (dims >= rope_dim pass through)
//   cos_i, sin_i: row positions[token] + position_offset of cos_sin_cache [max_position, rope_dim]
//   (cos | sin); an out-of-range row reads nothing and gives cos = sin = NaN.
//
// Rows are numbered token-major: row r is token r / (Hq + Hk), head r % (Hq + Hk); heads below
// Hq are q's, the rest k's. In a fused qkv tensor neighbouring rows are neighbouring memory.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "include/dtype.h"

namespace cookbook::qk_norm_rope {

// Float32 scratch memory lent by the caller for the length of one launch (the torch binding: from
// torch's caching allocator, stream-ordered, so a CUDA graph captures it). Only rung 1, the split
// path, asks for it: the normalized rows between its two kernels.
struct Scratch {
  float* (*allocate)(void* owner, int64_t floats) = nullptr;
  void* owner = nullptr;
};

struct Params {
  void* q;                     // [T, Hq, D]: element strides below, last dim contiguous
  void* k;                     // [T, Hk, D]
  const void* q_weight;        // [D], in the activation dtype or float32
  const void* k_weight;        // [D], the same dtype as q_weight
  const void* cos_sin_cache;   // [max_position, rope_dim], contiguous, in the activation dtype or float32
  const void* positions;       // [T], int32 or int64
  DType dtype;                 // of q and k
  Rounding rounding;
  bool weight_is_fp32;
  bool cache_is_fp32;
  bool positions_are_int64;
  bool is_neox;                // pairs (i, i + rope_dim/2); false: (2i, 2i + 1)
  int64_t num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  int rope_dim;                // even, at most head_dim: the rotated dims
  int64_t max_position;        // the cache's rows
  int64_t position_offset;     // added to every position (64-bit)
  int64_t q_token_stride, q_head_stride;  // in elements, 64-bit
  int64_t k_token_stride, k_head_stride;
  float eps;
  float weight_offset;
  Scratch scratch;
};

inline int64_t total_rows(const Params& p) { return p.num_tokens * (p.num_q_heads + p.num_kv_heads); }

// Every kernel file (a rung or the tuned kernel) defines, in its own namespace,
//   template <DType kDType, Rounding kRounding> cudaError_t launch(const Params& p, cudaStream_t stream);
// which launches on `stream` and returns the launch error, if any. The build compiles one
// translation unit per dtype and rounding of it, in parallel, and the binding picks one.
using Launcher = cudaError_t (*)(const Params&, cudaStream_t);

}  // namespace cookbook::qk_norm_rope
