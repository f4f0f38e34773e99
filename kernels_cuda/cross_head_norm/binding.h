// The torch glue of every cross_head_norm extension (each rung, and the tuned kernel): the cheap
// checks a direct torch.ops caller gets (the Python contract has run the full ones), Params from
// the tensors, and the launcher of the call's dtype and rounding. Host C++ only: a binding compiles
// with the host compiler, while the kernels' translation units compile with nvcc, one per dtype
// and rounding, in parallel.
//
// An extension's binding unit is two lines (cookbook/cuda.py writes it):
//   #include "cross_head_norm/binding.h"
//   COOKBOOK_CROSS_HEAD_NORM_EXTENSION(cross_head_norm_v3, cookbook::cross_head_norm::v3)
// which registers the op cookbook::cross_head_norm_v3(q, k, q_weight, k_weight, eps, weight_offset,
// hf_rounding) -> () and runs the kernels of namespace cookbook::cross_head_norm::v3. The tuned
// kernel's unit has a third line, COOKBOOK_CROSS_HEAD_NORM_EXPLAIN(cross_head_norm_tuned,
// cookbook::cross_head_norm::tuned), which registers cookbook::cross_head_norm_tuned_explain: the
// same arguments, the policy's plan returned.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <string>

#include "cross_head_norm/params.h"

namespace cookbook::cross_head_norm {

// The op's schema after its name: q and k are written in place.
constexpr const char* kSchema =
    "(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, float eps, float weight_offset, "
    "bool hf_rounding) -> ()";

// The tuned extension's explain op: the same arguments, nothing written, the plan returned.
constexpr const char* kExplainSchema =
    "(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, float weight_offset, bool hf_rounding) -> str";

constexpr int kNumDTypes = 3;
constexpr int kNumRoundings = 2;
using Launchers = Launcher[kNumDTypes][kNumRoundings];  // [DType][Rounding]

inline DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "q: expected float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return DType::kFloat32;
}

inline void check_rows(const char* name, const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda(), name, ": expected a CUDA tensor, got one on ", x.device());
  TORCH_CHECK(x.dim() == 2, name, ": expected [tokens, hidden], got shape ", x.sizes());
  TORCH_CHECK(x.size(1) <= 1 || x.stride(1) == 1, name, ": expected a contiguous last dim, got stride ", x.strides());
}

inline void check_weight(const char* name, const at::Tensor& w, const at::Tensor& x) {
  TORCH_CHECK(w.device() == x.device(), name, ": expected device ", x.device(), ", got ", w.device());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && (x.size(1) <= 1 || w.stride(0) == 1), name,
              ": expected a contiguous [hidden=", x.size(1), "], got shape ", w.sizes(), " stride ", w.strides());
  TORCH_CHECK(w.scalar_type() == x.scalar_type() || w.scalar_type() == at::kFloat, name, ": expected ",
              x.scalar_type(), " or float32, got ", w.scalar_type());
}

// The checks, and Params from the tensors.
inline Params params_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight,
                        double eps, double weight_offset, bool hf_rounding) {
  check_rows("q", q);
  check_rows("k", k);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && k.device() == q.device(), "k: expected the dtype and device of q");
  TORCH_CHECK(k.size(0) == q.size(0), "k: expected [", q.size(0), ", k_hidden], got ", k.sizes());
  TORCH_CHECK(q.size(0) <= std::numeric_limits<int32_t>::max(), "q: at most 2^31 - 1 tokens (grid.x), got ",
              q.size(0));
  check_weight("q_weight", q_weight, q);
  check_weight("k_weight", k_weight, k);
  Params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.q_weight = q_weight.data_ptr();
  p.k_weight = k_weight.data_ptr();
  p.dtype = dtype_of(q);
  p.rounding = hf_rounding ? Rounding::kHf : Rounding::kFused;
  p.q_weight_is_fp32 = q_weight.scalar_type() == at::kFloat;
  p.k_weight_is_fp32 = k_weight.scalar_type() == at::kFloat;
  p.num_tokens = q.size(0);
  p.q_hidden = static_cast<int>(q.size(1));
  p.k_hidden = static_cast<int>(k.size(1));
  p.q_token_stride = q.stride(0);
  p.k_token_stride = k.stride(0);
  p.eps = static_cast<float>(eps);
  p.weight_offset = static_cast<float>(weight_offset);
  return p;
}

// The op: checks, Params, and the launcher of the call's dtype and rounding.
template <const Launchers& kLaunchers>
void run(at::Tensor q, at::Tensor k, const at::Tensor& q_weight, const at::Tensor& k_weight, double eps,
         double weight_offset, bool hf_rounding) {
  const c10::cuda::CUDAGuard guard(q.device());
  const Params p = params_of(q, k, q_weight, k_weight, eps, weight_offset, hf_rounding);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device());
  const cudaError_t error = kLaunchers[static_cast<int>(p.dtype)][static_cast<int>(p.rounding)](p, stream);
  TORCH_CHECK(error == cudaSuccess, "cross_head_norm: kernel launch failed: ", cudaGetErrorString(error));
}

// The tuned kernel's explain op: what `run` would launch for these tensors on their GPU, as the
// host policy's key=value lines (policy.h), without launching anything.
using Explainer = std::string (*)(const Params&);
using Explainers = Explainer[kNumDTypes][kNumRoundings];

template <const Explainers& kExplainers>
std::string explain(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight,
                    double eps, double weight_offset, bool hf_rounding) {
  const c10::cuda::CUDAGuard guard(q.device());
  const Params p = params_of(q, k, q_weight, k_weight, eps, weight_offset, hf_rounding);
  return kExplainers[static_cast<int>(p.dtype)][static_cast<int>(p.rounding)](p);
}

}  // namespace cookbook::cross_head_norm

// Declares the launchers of namespace NS (each defined in its own nvcc translation unit), and
// registers cookbook::NAME running them.
#define COOKBOOK_CROSS_HEAD_NORM_EXTENSION(NAME, NS)                                                             \
  namespace NS {                                                                                                 \
  template <::cookbook::DType kDType, ::cookbook::Rounding kRounding>                                            \
  cudaError_t launch(const ::cookbook::cross_head_norm::Params& p, cudaStream_t stream);                        \
  constexpr ::cookbook::cross_head_norm::Launchers kLaunchers = {                                                \
      {&launch<::cookbook::DType::kFloat32, ::cookbook::Rounding::kFused>,                                       \
       &launch<::cookbook::DType::kFloat32, ::cookbook::Rounding::kHf>},                                         \
      {&launch<::cookbook::DType::kFloat16, ::cookbook::Rounding::kFused>,                                       \
       &launch<::cookbook::DType::kFloat16, ::cookbook::Rounding::kHf>},                                         \
      {&launch<::cookbook::DType::kBFloat16, ::cookbook::Rounding::kFused>,                                      \
       &launch<::cookbook::DType::kBFloat16, ::cookbook::Rounding::kHf>}};                                       \
  }                                                                                                              \
  TORCH_LIBRARY_FRAGMENT(cookbook, m) { m.def((std::string(#NAME) + ::cookbook::cross_head_norm::kSchema).c_str()); } \
  TORCH_LIBRARY_IMPL(cookbook, CUDA, m) { m.impl(#NAME, &::cookbook::cross_head_norm::run<NS::kLaunchers>); }

// The tuned extension's second op, cookbook::NAME_explain(q, k, q_weight, k_weight, eps,
// weight_offset, hf_rounding) -> str: NS::explain of the call's dtype and rounding.
#define COOKBOOK_CROSS_HEAD_NORM_EXPLAIN(NAME, NS)                                                               \
  namespace NS {                                                                                                 \
  template <::cookbook::DType kDType, ::cookbook::Rounding kRounding>                                            \
  std::string explain(const ::cookbook::cross_head_norm::Params& p);                                            \
  constexpr ::cookbook::cross_head_norm::Explainers kExplainers = {                                              \
      {&explain<::cookbook::DType::kFloat32, ::cookbook::Rounding::kFused>,                                      \
       &explain<::cookbook::DType::kFloat32, ::cookbook::Rounding::kHf>},                                        \
      {&explain<::cookbook::DType::kFloat16, ::cookbook::Rounding::kFused>,                                      \
       &explain<::cookbook::DType::kFloat16, ::cookbook::Rounding::kHf>},                                        \
      {&explain<::cookbook::DType::kBFloat16, ::cookbook::Rounding::kFused>,                                     \
       &explain<::cookbook::DType::kBFloat16, ::cookbook::Rounding::kHf>}};                                      \
  }                                                                                                              \
  TORCH_LIBRARY_FRAGMENT(cookbook, m) {                                                                          \
    m.def((std::string(#NAME) + "_explain" + ::cookbook::cross_head_norm::kExplainSchema).c_str());             \
  }                                                                                                              \
  TORCH_LIBRARY_IMPL(cookbook, CUDA, m) {                                                                        \
    m.impl(#NAME "_explain", &::cookbook::cross_head_norm::explain<NS::kExplainers>);                           \
  }
