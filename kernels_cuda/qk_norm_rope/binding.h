// The torch glue of every qk_norm_rope extension (each rung, and the tuned kernel): the cheap checks
// a direct torch.ops caller gets (the Python contract has run the full ones), Params from the
// tensors, and the launcher of the call's dtype and rounding. Host C++ only: a binding compiles
// with the host compiler, while the kernels' translation units compile with nvcc, one per dtype
// and rounding, in parallel.
//
// An extension's binding unit is two lines (cookbook/cuda.py writes it):
//   #include "qk_norm_rope/binding.h"
//   COOKBOOK_QK_NORM_ROPE_EXTENSION(qk_norm_rope_v3, cookbook::qk_norm_rope::v3)
// which registers the op cookbook::qk_norm_rope_v3(q, k, q_weight, k_weight, cos_sin_cache,
// positions, eps, weight_offset, is_neox, rope_dim, position_offset, hf_rounding) -> () and runs
// the kernels of namespace cookbook::qk_norm_rope::v3. The tuned kernel's unit may add a third
// line, COOKBOOK_QK_NORM_ROPE_EXPLAIN(qk_norm_rope_tuned, cookbook::qk_norm_rope::tuned), which
// registers cookbook::qk_norm_rope_tuned_explain: the same arguments, the policy's plan returned.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "qk_norm_rope/params.h"

namespace cookbook::qk_norm_rope {

// The op's schema after its name: q and k are written in place.
constexpr const char* kSchema =
    "(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, Tensor positions, "
    "float eps, float weight_offset, bool is_neox, int rope_dim, int position_offset, bool hf_rounding) -> ()";

// The tuned extension's explain op: the same arguments, nothing written, the plan returned.
constexpr const char* kExplainSchema =
    "(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, Tensor positions, float eps, "
    "float weight_offset, bool is_neox, int rope_dim, int position_offset, bool hf_rounding) -> str";

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
  TORCH_CHECK(x.dim() == 3, name, ": expected [tokens, heads, head_dim], got shape ", x.sizes());
  TORCH_CHECK(x.size(2) <= 1 || x.stride(2) == 1, name, ": expected a contiguous last dim, got stride ", x.strides());
}

inline void check_weight(const char* name, const at::Tensor& w, const at::Tensor& x) {
  TORCH_CHECK(w.device() == x.device(), name, ": expected device ", x.device(), ", got ", w.device());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(2) && (x.size(2) <= 1 || w.stride(0) == 1), name,
              ": expected a contiguous [head_dim=", x.size(2), "], got shape ", w.sizes(), " stride ", w.strides());
  TORCH_CHECK(w.scalar_type() == x.scalar_type() || w.scalar_type() == at::kFloat, name, ": expected ",
              x.scalar_type(), " or float32, got ", w.scalar_type());
}

// The checks, and Params from the tensors.
inline Params params_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight,
                        const at::Tensor& cos_sin_cache, const at::Tensor& positions, double eps, double weight_offset,
                        bool is_neox, int64_t rope_dim, int64_t position_offset, bool hf_rounding) {
  check_rows("q", q);
  check_rows("k", k);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && k.device() == q.device(), "k: expected the dtype and device of q");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2), "k: expected [", q.size(0), ", num_kv_heads, ",
              q.size(2), "], got ", k.sizes());
  check_weight("q_weight", q_weight, q);
  check_weight("k_weight", k_weight, k);
  TORCH_CHECK(q_weight.scalar_type() == k_weight.scalar_type(), "k_weight: expected the dtype of q_weight");
  TORCH_CHECK(rope_dim >= 2 && rope_dim % 2 == 0 && rope_dim <= q.size(2), "rope_dim: expected an even value in [2, ",
              q.size(2), "], got ", rope_dim);
  TORCH_CHECK(cos_sin_cache.device() == q.device() && cos_sin_cache.dim() == 2 && cos_sin_cache.size(0) >= 1 &&
                  cos_sin_cache.size(1) == rope_dim && cos_sin_cache.is_contiguous(),
              "cos_sin_cache: expected a contiguous [max_position, rope_dim=", rope_dim, "] on ", q.device(),
              ", got shape ", cos_sin_cache.sizes());
  TORCH_CHECK(cos_sin_cache.scalar_type() == q.scalar_type() || cos_sin_cache.scalar_type() == at::kFloat,
              "cos_sin_cache: expected ", q.scalar_type(), " or float32, got ", cos_sin_cache.scalar_type());
  TORCH_CHECK(positions.device() == q.device() && positions.dim() == 1 && positions.size(0) == q.size(0) &&
                  positions.is_contiguous() &&
                  (positions.scalar_type() == at::kInt || positions.scalar_type() == at::kLong),
              "positions: expected a contiguous int32 or int64 [", q.size(0), "] on ", q.device(), ", got shape ",
              positions.sizes(), " dtype ", positions.scalar_type());
  Params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.q_weight = q_weight.data_ptr();
  p.k_weight = k_weight.data_ptr();
  p.cos_sin_cache = cos_sin_cache.data_ptr();
  p.positions = positions.data_ptr();
  p.dtype = dtype_of(q);
  p.rounding = hf_rounding ? Rounding::kHf : Rounding::kFused;
  p.weight_is_fp32 = q_weight.scalar_type() == at::kFloat;
  p.cache_is_fp32 = cos_sin_cache.scalar_type() == at::kFloat;
  p.positions_are_int64 = positions.scalar_type() == at::kLong;
  p.is_neox = is_neox;
  p.num_tokens = q.size(0);
  p.num_q_heads = static_cast<int>(q.size(1));
  p.num_kv_heads = static_cast<int>(k.size(1));
  p.head_dim = static_cast<int>(q.size(2));
  p.rope_dim = static_cast<int>(rope_dim);
  p.max_position = cos_sin_cache.size(0);
  p.position_offset = position_offset;
  p.q_token_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.k_token_stride = k.stride(0);
  p.k_head_stride = k.stride(1);
  p.eps = static_cast<float>(eps);
  p.weight_offset = static_cast<float>(weight_offset);
  return p;
}

// Float32 scratch from torch's caching allocator, held until the call returns: the allocator
// orders its reuse on the stream (and a CUDA graph captures it), so freeing it after the launch
// is safe. What Params::scratch lends to the kernels that ask (rung 1).
struct ScratchTensors {
  at::TensorOptions options;
  std::vector<at::Tensor> held;

  static float* allocate(void* owner, int64_t floats) {
    auto* self = static_cast<ScratchTensors*>(owner);
    self->held.push_back(at::empty({floats}, self->options));
    return self->held.back().data_ptr<float>();
  }
};

// The op: checks, Params, and the launcher of the call's dtype and rounding.
template <const Launchers& kLaunchers>
void run(at::Tensor q, at::Tensor k, const at::Tensor& q_weight, const at::Tensor& k_weight,
         const at::Tensor& cos_sin_cache, const at::Tensor& positions, double eps, double weight_offset, bool is_neox,
         int64_t rope_dim, int64_t position_offset, bool hf_rounding) {
  const c10::cuda::CUDAGuard guard(q.device());
  Params p = params_of(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, is_neox, rope_dim,
                       position_offset, hf_rounding);
  ScratchTensors scratch{q.options().dtype(at::kFloat), {}};
  p.scratch = {&ScratchTensors::allocate, &scratch};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device());
  const cudaError_t error = kLaunchers[static_cast<int>(p.dtype)][static_cast<int>(p.rounding)](p, stream);
  TORCH_CHECK(error == cudaSuccess, "qk_norm_rope: kernel launch failed: ", cudaGetErrorString(error));
}

// The tuned kernel's explain op: what `run` would launch for these tensors on their GPU, as the
// host policy's key=value lines (policy.h), without launching anything.
using Explainer = std::string (*)(const Params&);
using Explainers = Explainer[kNumDTypes][kNumRoundings];

template <const Explainers& kExplainers>
std::string explain(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight,
                    const at::Tensor& cos_sin_cache, const at::Tensor& positions, double eps, double weight_offset,
                    bool is_neox, int64_t rope_dim, int64_t position_offset, bool hf_rounding) {
  const c10::cuda::CUDAGuard guard(q.device());
  const Params p = params_of(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, is_neox, rope_dim,
                             position_offset, hf_rounding);
  return kExplainers[static_cast<int>(p.dtype)][static_cast<int>(p.rounding)](p);
}

}  // namespace cookbook::qk_norm_rope

// Declares the launchers of namespace NS (each defined in its own nvcc translation unit), and
// registers cookbook::NAME running them.
#define COOKBOOK_QK_NORM_ROPE_EXTENSION(NAME, NS)                                                                \
  namespace NS {                                                                                                 \
  template <::cookbook::DType kDType, ::cookbook::Rounding kRounding>                                            \
  cudaError_t launch(const ::cookbook::qk_norm_rope::Params& p, cudaStream_t stream);                           \
  constexpr ::cookbook::qk_norm_rope::Launchers kLaunchers = {                                                   \
      {&launch<::cookbook::DType::kFloat32, ::cookbook::Rounding::kFused>,                                       \
       &launch<::cookbook::DType::kFloat32, ::cookbook::Rounding::kHf>},                                         \
      {&launch<::cookbook::DType::kFloat16, ::cookbook::Rounding::kFused>,                                       \
       &launch<::cookbook::DType::kFloat16, ::cookbook::Rounding::kHf>},                                         \
      {&launch<::cookbook::DType::kBFloat16, ::cookbook::Rounding::kFused>,                                      \
       &launch<::cookbook::DType::kBFloat16, ::cookbook::Rounding::kHf>}};                                       \
  }                                                                                                              \
  TORCH_LIBRARY_FRAGMENT(cookbook, m) { m.def((std::string(#NAME) + ::cookbook::qk_norm_rope::kSchema).c_str()); } \
  TORCH_LIBRARY_IMPL(cookbook, CUDA, m) { m.impl(#NAME, &::cookbook::qk_norm_rope::run<NS::kLaunchers>); }

// The tuned extension's second op, cookbook::NAME_explain(the op's arguments) -> str: NS::explain
// of the call's dtype and rounding (each defined in the nvcc unit of that dtype and rounding).
#define COOKBOOK_QK_NORM_ROPE_EXPLAIN(NAME, NS)                                                                  \
  namespace NS {                                                                                                 \
  template <::cookbook::DType kDType, ::cookbook::Rounding kRounding>                                            \
  std::string explain(const ::cookbook::qk_norm_rope::Params& p);                                               \
  constexpr ::cookbook::qk_norm_rope::Explainers kExplainers = {                                                 \
      {&explain<::cookbook::DType::kFloat32, ::cookbook::Rounding::kFused>,                                      \
       &explain<::cookbook::DType::kFloat32, ::cookbook::Rounding::kHf>},                                        \
      {&explain<::cookbook::DType::kFloat16, ::cookbook::Rounding::kFused>,                                      \
       &explain<::cookbook::DType::kFloat16, ::cookbook::Rounding::kHf>},                                        \
      {&explain<::cookbook::DType::kBFloat16, ::cookbook::Rounding::kFused>,                                     \
       &explain<::cookbook::DType::kBFloat16, ::cookbook::Rounding::kHf>}};                                      \
  }                                                                                                              \
  TORCH_LIBRARY_FRAGMENT(cookbook, m) {                                                                          \
    m.def((std::string(#NAME) + "_explain" + ::cookbook::qk_norm_rope::kExplainSchema).c_str());                \
  }                                                                                                              \
  TORCH_LIBRARY_IMPL(cookbook, CUDA, m) {                                                                        \
    m.impl(#NAME "_explain", &::cookbook::qk_norm_rope::explain<NS::kExplainers>);                              \
  }
