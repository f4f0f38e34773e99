// cross_head_norm's launch arguments: what every rung and the tuned kernel take, and what the
// torch binding fills in. Plain C++ (no device code), so the binding compiles with the host compiler.
//
//   per token row x of q (length q_hidden) and of k (length k_hidden), float32 accumulation:
//   y = x * rsqrt(mean(x^2 over the row) + eps) * (w + weight_offset)
//
// A row is a token's whole q (or k): every head at once, thousands of elements, so a CTA owns a
// row (from rung 2 on; rung 7 gives narrow rows a warp) and the sum of squares is a block
// reduction. q_hidden and k_hidden may differ (GQA).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "include/dtype.h"

namespace cookbook::cross_head_norm {

struct Params {
  void* q;                // [T, q_hidden]: the token stride below, last dim contiguous
  void* k;                // [T, k_hidden]
  const void* q_weight;   // [q_hidden], in the activation dtype or float32
  const void* k_weight;   // [k_hidden], either storage, independently of q_weight
  DType dtype;            // of q and k
  Rounding rounding;
  bool q_weight_is_fp32;
  bool k_weight_is_fp32;
  int64_t num_tokens;
  int q_hidden;
  int k_hidden;
  int64_t q_token_stride, k_token_stride;  // in elements, 64-bit
  float eps;
  float weight_offset;
};

// Every kernel file (a rung or the tuned kernel) defines, in its own namespace,
//   template <DType kDType, Rounding kRounding> cudaError_t launch(const Params& p, cudaStream_t stream);
// which launches on `stream` and returns the launch error, if any. The build compiles one
// translation unit per dtype and rounding of it, in parallel, and the binding picks one.
using Launcher = cudaError_t (*)(const Params&, cudaStream_t);

}  // namespace cookbook::cross_head_norm
