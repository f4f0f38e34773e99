// Torch glue shared by every binding: dtype mapping and the cheap re-checks a direct
// torch.ops caller gets (the Python contract has already run the full, friendlier checks).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "include/common.cuh"

namespace cookbook::glue {

inline DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "expected float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return DType::kFloat32;
}

inline void check_activation(const char* name, const at::Tensor& t, int64_t dims) {
  TORCH_CHECK(t.is_cuda(), name, ": expected a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.dim() == dims, name, ": expected ", dims, " dims, got shape ", t.sizes());
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, name, ": expected a contiguous last dim, got stride ", t.strides());
}

inline void check_weight(const char* name, const at::Tensor& w, const at::Tensor& act, int64_t width) {
  TORCH_CHECK(w.device() == act.device(), name, ": expected device ", act.device(), ", got ", w.device());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == width && (width <= 1 || w.stride(0) == 1), name,
              ": expected a contiguous [", width, "], got shape ", w.sizes(), " stride ", w.strides());
  TORCH_CHECK(w.scalar_type() == act.scalar_type() || w.scalar_type() == at::kFloat, name,
              ": expected ", act.scalar_type(), " or float32, got ", w.scalar_type());
}

inline void check_launch(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace cookbook::glue
