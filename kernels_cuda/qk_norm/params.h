// qk_norm's launch arguments: what every rung and the tuned kernel take, and what the torch
// binding fills in. Plain C++ (no device code), so the binding compiles with the host compiler.
//
//   per (token, head) row x of length head_dim, float32 accumulation:
//   y = x * rsqrt(mean(x^2) + eps) * (w + weight_offset)
//
// Rows are numbered token-major: row r is token r / (Hq + Hk), head r % (Hq + Hk); heads below
// Hq are q's, the rest k's. In a fused qkv tensor neighbouring rows are neighbouring memory.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "include/dtype.h"

namespace cookbook::qk_norm {

struct Params {
  void* q;               // [T, Hq, D]: element strides below, last dim contiguous
  void* k;               // [T, Hk, D]
  const void* q_weight;  // [D], in the activation dtype or float32
  const void* k_weight;  // [D], the same dtype as q_weight
  DType dtype;           // of q and k
  Rounding rounding;
  bool weight_is_fp32;
  int64_t num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  int64_t q_token_stride, q_head_stride;  // in elements, 64-bit
  int64_t k_token_stride, k_head_stride;
  float eps;
  float weight_offset;
};

inline int64_t total_rows(const Params& p) { return p.num_tokens * (p.num_q_heads + p.num_kv_heads); }

// Every kernel file (a rung or the tuned kernel) defines, in its own namespace,
//   template <DType kDType> cudaError_t launch(const Params& p, cudaStream_t stream);
// which launches on `stream` and returns the launch error, if any. The build compiles one
// translation unit per dtype of it, in parallel, and the binding picks one by p.dtype.
using Launcher = cudaError_t (*)(const Params&, cudaStream_t);

}  // namespace cookbook::qk_norm
