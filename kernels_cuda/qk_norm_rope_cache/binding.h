// The torch glue of every qk_norm_rope_cache extension (each rung, and the tuned kernel): qk_norm_rope's
// checks and Params for q, k and the tables (qk_norm_rope/binding.h), the cheap checks of v, the
// caches, the slots and the scales a direct torch.ops caller gets (the Python contract has run the
// full ones), and the launcher of the call's dtype and rounding. Host C++ only.
//
// An extension's binding unit is two lines (cookbook/cuda.py writes it):
//   #include "qk_norm_rope_cache/binding.h"
//   COOKBOOK_QK_NORM_ROPE_CACHE_EXTENSION(qk_norm_rope_cache_v2, cookbook::qk_norm_rope_cache::v2)
// which registers cookbook::qk_norm_rope_cache_v2(q, k, v, q_weight, k_weight, cos_sin_cache,
// positions, k_cache, v_cache, slot_mapping, k_scale, v_scale, eps, weight_offset, is_neox,
// rope_dim, hf_rounding) -> (). The tuned kernel's unit adds COOKBOOK_QK_NORM_ROPE_CACHE_EXPLAIN,
// registering cookbook::qk_norm_rope_cache_tuned_explain: the same arguments, the plan returned.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <optional>
#include <string>

#include "qk_norm_rope/binding.h"
#include "qk_norm_rope_cache/params.h"

namespace cookbook::qk_norm_rope_cache {

// The op's schema after its name: q, k and both caches are written.
constexpr const char* kSchema =
    "(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, Tensor positions, "
    "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, Tensor? k_scale, Tensor? v_scale, float eps, "
    "float weight_offset, bool is_neox, int rope_dim, bool hf_rounding) -> ()";

// The tuned extension's explain op: the same arguments, nothing written, the plan returned.
constexpr const char* kExplainSchema =
    "(Tensor q, Tensor k, Tensor v, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, Tensor positions, "
    "Tensor k_cache, Tensor v_cache, Tensor slot_mapping, Tensor? k_scale, Tensor? v_scale, float eps, "
    "float weight_offset, bool is_neox, int rope_dim, bool hf_rounding) -> str";

constexpr int kNumDTypes = 3;
constexpr int kNumRoundings = 2;
using Launchers = Launcher[kNumDTypes][kNumRoundings];  // [DType][Rounding]

inline Cache cache_of(const char* name, const at::Tensor& cache, const at::Tensor& k,
                      const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(cache.device() == k.device() && cache.dim() == 4 && cache.size(2) == k.size(1) &&
                  cache.size(3) == k.size(2) && (cache.size(3) <= 1 || cache.stride(3) == 1),
              name, ": expected [num_blocks, block_size, num_kv_heads=", k.size(1), ", head_dim=", k.size(2),
              "] with a contiguous last dim on ", k.device(), ", got shape ", cache.sizes(), " stride ", cache.strides());
  const bool fp8 = cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || cache.scalar_type() == k.scalar_type(), name, ": expected ", k.scalar_type(),
              " or Float8_e4m3fn, got ", cache.scalar_type());
  TORCH_CHECK(fp8 == scale.has_value(), name, ": an FP8 cache takes a scale, another cache none");
  Cache c;
  c.data = cache.data_ptr();
  c.block_stride = cache.stride(0);
  c.slot_stride = cache.stride(1);
  c.head_stride = cache.stride(2);
  if (fp8) {
    TORCH_CHECK(scale->device() == k.device() && scale->scalar_type() == at::kFloat && scale->numel() == 1, name,
                "'s scale: expected one float32 on ", k.device());
    c.scale = scale->data_ptr<float>();
  }
  return c;
}

// The checks, and Params from the tensors.
inline Params params_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_weight,
                        const at::Tensor& k_weight, const at::Tensor& cos_sin_cache, const at::Tensor& positions,
                        const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                        const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale, double eps,
                        double weight_offset, bool is_neox, int64_t rope_dim, bool hf_rounding) {
  Params p{};
  p.rope = qk_norm_rope::params_of(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, is_neox,
                                   rope_dim, /*position_offset=*/0, hf_rounding);
  TORCH_CHECK(v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type() && v.device() == k.device() &&
                  (v.size(2) <= 1 || v.stride(2) == 1),
              "v: expected k's shape ", k.sizes(), ", dtype and device with a contiguous last dim, got shape ", v.sizes(),
              " stride ", v.strides());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "v_cache: expected the shape and dtype of k_cache");
  TORCH_CHECK(slot_mapping.device() == q.device() && slot_mapping.dim() == 1 && slot_mapping.size(0) == q.size(0) &&
                  slot_mapping.is_contiguous() &&
                  (slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong),
              "slot_mapping: expected a contiguous int32 or int64 [", q.size(0), "] on ", q.device(), ", got shape ",
              slot_mapping.sizes(), " dtype ", slot_mapping.scalar_type());
  p.v = v.data_ptr();
  p.v_token_stride = v.stride(0);
  p.v_head_stride = v.stride(1);
  p.k_cache = cache_of("k_cache", k_cache, k, k_scale);
  p.v_cache = cache_of("v_cache", v_cache, k, v_scale);
  p.cache_dtype = k_cache.scalar_type() == at::kFloat8_e4m3fn ? CacheDtype::kFp8E4m3 : CacheDtype::kActivation;
  p.slot_mapping = slot_mapping.data_ptr();
  p.slots_are_int64 = slot_mapping.scalar_type() == at::kLong;
  p.block_size = k_cache.size(1);
  p.num_slots = k_cache.size(0) * k_cache.size(1);
  return p;
}

// The op: checks, Params, and the launcher of the call's dtype and rounding.
template <const Launchers& kLaunchers>
void run(at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& q_weight, const at::Tensor& k_weight,
         const at::Tensor& cos_sin_cache, const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache,
         const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
         const std::optional<at::Tensor>& v_scale, double eps, double weight_offset, bool is_neox, int64_t rope_dim,
         bool hf_rounding) {
  const c10::cuda::CUDAGuard guard(q.device());
  const Params p = params_of(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping,
                             k_scale, v_scale, eps, weight_offset, is_neox, rope_dim, hf_rounding);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device());
  const cudaError_t error = kLaunchers[static_cast<int>(p.rope.dtype)][static_cast<int>(p.rope.rounding)](p, stream);
  TORCH_CHECK(error == cudaSuccess, "qk_norm_rope_cache: kernel launch failed: ", cudaGetErrorString(error));
}

// The tuned kernel's explain op: what `run` would launch for these tensors on their GPU, as the
// host policy's key=value lines (policy.h), without launching anything.
using Explainer = std::string (*)(const Params&);
using Explainers = Explainer[kNumDTypes][kNumRoundings];

template <const Explainers& kExplainers>
std::string explain(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_weight,
                    const at::Tensor& k_weight, const at::Tensor& cos_sin_cache, const at::Tensor& positions,
                    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale, double eps,
                    double weight_offset, bool is_neox, int64_t rope_dim, bool hf_rounding) {
  const c10::cuda::CUDAGuard guard(q.device());
  const Params p = params_of(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping,
                             k_scale, v_scale, eps, weight_offset, is_neox, rope_dim, hf_rounding);
  return kExplainers[static_cast<int>(p.rope.dtype)][static_cast<int>(p.rope.rounding)](p);
}

}  // namespace cookbook::qk_norm_rope_cache

// Declares the launchers of namespace NS (each defined in its own nvcc translation unit), and
// registers cookbook::NAME running them.
#define COOKBOOK_QK_NORM_ROPE_CACHE_EXTENSION(NAME, NS)                                                           \
  namespace NS {                                                                                                 \
  template <::cookbook::DType kDType, ::cookbook::Rounding kRounding>                                            \
  cudaError_t launch(const ::cookbook::qk_norm_rope_cache::Params& p, cudaStream_t stream);                     \
  constexpr ::cookbook::qk_norm_rope_cache::Launchers kLaunchers = {                                             \
      {&launch<::cookbook::DType::kFloat32, ::cookbook::Rounding::kFused>,                                       \
       &launch<::cookbook::DType::kFloat32, ::cookbook::Rounding::kHf>},                                         \
      {&launch<::cookbook::DType::kFloat16, ::cookbook::Rounding::kFused>,                                       \
       &launch<::cookbook::DType::kFloat16, ::cookbook::Rounding::kHf>},                                         \
      {&launch<::cookbook::DType::kBFloat16, ::cookbook::Rounding::kFused>,                                      \
       &launch<::cookbook::DType::kBFloat16, ::cookbook::Rounding::kHf>}};                                       \
  }                                                                                                              \
  TORCH_LIBRARY_FRAGMENT(cookbook, m) {                                                                          \
    m.def((std::string(#NAME) + ::cookbook::qk_norm_rope_cache::kSchema).c_str());                              \
  }                                                                                                              \
  TORCH_LIBRARY_IMPL(cookbook, CUDA, m) { m.impl(#NAME, &::cookbook::qk_norm_rope_cache::run<NS::kLaunchers>); }

// The tuned extension's second op, cookbook::NAME_explain(the op's arguments) -> str.
#define COOKBOOK_QK_NORM_ROPE_CACHE_EXPLAIN(NAME, NS)                                                             \
  namespace NS {                                                                                                 \
  template <::cookbook::DType kDType, ::cookbook::Rounding kRounding>                                            \
  std::string explain(const ::cookbook::qk_norm_rope_cache::Params& p);                                         \
  constexpr ::cookbook::qk_norm_rope_cache::Explainers kExplainers = {                                           \
      {&explain<::cookbook::DType::kFloat32, ::cookbook::Rounding::kFused>,                                      \
       &explain<::cookbook::DType::kFloat32, ::cookbook::Rounding::kHf>},                                        \
      {&explain<::cookbook::DType::kFloat16, ::cookbook::Rounding::kFused>,                                      \
       &explain<::cookbook::DType::kFloat16, ::cookbook::Rounding::kHf>},                                        \
      {&explain<::cookbook::DType::kBFloat16, ::cookbook::Rounding::kFused>,                                     \
       &explain<::cookbook::DType::kBFloat16, ::cookbook::Rounding::kHf>}};                                      \
  }                                                                                                              \
  TORCH_LIBRARY_FRAGMENT(cookbook, m) {                                                                          \
    m.def((std::string(#NAME) + "_explain" + ::cookbook::qk_norm_rope_cache::kExplainSchema).c_str());          \
  }                                                                                                              \
  TORCH_LIBRARY_IMPL(cookbook, CUDA, m) {                                                                        \
    m.impl(#NAME "_explain", &::cookbook::qk_norm_rope_cache::explain<NS::kExplainers>);                        \
  }
