// The torch glue of every tp_qk_norm extension (each rung, and the tuned kernel): the cheap
// checks a direct torch.ops caller gets (the Python contract has run the full ones), the launch
// arguments from the tensors, and the launcher of the call's dtype and rounding. Host C++ only.
//
// An extension's binding unit (cookbook/cuda.py writes it) registers the steps its kernel file
// runs, as torch ops named after the extension (all in place):
//   COOKBOOK_TP_QK_NORM_PIPELINE(tp_qk_norm_v1, cookbook::tp_qk_norm::v1)
//       cookbook::tp_qk_norm_v1_sum_sq   [T, 2] float32 partial sums of squares of this shard
//       cookbook::tp_qk_norm_v1_apply    normalize the shard from the all-reduced sums
//   COOKBOOK_TP_QK_NORM_FUSED(tp_qk_norm_v3, cookbook::tp_qk_norm::v3, 3)
//       cookbook::tp_qk_norm_v3_fused    the whole op in one launch, peers' buffers by address
//   COOKBOOK_TP_QK_NORM_ABSENT(tp_qk_norm_tuned, cookbook::tp_qk_norm::tuned)
//       cookbook::tp_qk_norm_tuned_absent   the launch of a rank that rejected its arguments
//   COOKBOOK_TP_QK_NORM_EXPLAIN(tp_qk_norm_tuned, cookbook::tp_qk_norm::tuned)
//       cookbook::tp_qk_norm_tuned_explain  the fused op's arguments, the policy's plan returned
// The NCCL all-reduce of rung 1 and the symmetric-memory workspace are set up in Python
// (cookbook/cuda.py, cookbook/tp_workspace.py); the fake (meta) kernels are registered there too.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <string>

#include "tp_qk_norm/geometry.h"
#include "tp_qk_norm/params.h"

namespace cookbook::tp_qk_norm {

constexpr int kNumDTypes = 3;
constexpr int kNumRoundings = 2;

inline DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "q_shard: expected float32, float16 or bfloat16, got ", t.scalar_type());
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
  TORCH_CHECK(err == cudaSuccess, "tp_qk_norm: kernel launch failed: ", cudaGetErrorString(err));
}

inline Params shard_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor* q_weight,
                                     const at::Tensor* k_weight, double eps, double weight_offset) {
  check_activation("q_shard", q, 2);
  check_activation("k_shard", k, 2);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && k.device() == q.device(), "k_shard: expected q_shard's dtype and device");
  TORCH_CHECK(k.size(0) == q.size(0), "k_shard: expected [", q.size(0), ", k_shard_width], got ", k.sizes());
  TORCH_CHECK(q.size(0) <= std::numeric_limits<int32_t>::max(), "q_shard: at most 2^31 - 1 tokens, got ", q.size(0));
  Params p{};
  if (q_weight != nullptr) {
    check_weight("q_weight_shard", *q_weight, q, q.size(1));
    check_weight("k_weight_shard", *k_weight, k, k.size(1));
    p.q_weight = q_weight->data_ptr();
    p.k_weight = k_weight->data_ptr();
    p.q_weight_is_fp32 = q_weight->scalar_type() == at::kFloat;
    p.k_weight_is_fp32 = k_weight->scalar_type() == at::kFloat;
  }
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.num_tokens = q.size(0);
  p.q_hidden = static_cast<int>(q.size(1));
  p.k_hidden = static_cast<int>(k.size(1));
  p.q_token_stride = q.stride(0);
  p.k_token_stride = k.stride(0);
  p.eps = static_cast<float>(eps);
  p.weight_offset = static_cast<float>(weight_offset);
  return p;
}

inline void check_sum_sq(const at::Tensor& sum_sq, const at::Tensor& q) {
  TORCH_CHECK(sum_sq.device() == q.device() && sum_sq.scalar_type() == at::kFloat && sum_sq.dim() == 2 &&
                  sum_sq.size(0) == q.size(0) && sum_sq.size(1) == kRowsPerToken && sum_sq.is_contiguous(),
              "sum_sq: expected a contiguous float32 [", q.size(0), ", 2] on ", q.device(), ", got ", sum_sq.sizes(),
              " ", sum_sq.scalar_type());
}

// The workspace's part of the fused kernel's parameters: the peers' buffers, this rank, the
// counters and the status words (cookbook/tp_workspace.py).
inline FusedParams workspace_params(const at::Tensor& counters, c10::IntArrayRef buffers, int64_t status,
                                         int64_t rank, int64_t capacity) {
  FusedParams p{};
  const auto world = static_cast<int64_t>(buffers.size());
  TORCH_CHECK(world >= 1 && world <= kMaxRanks, "buffers: expected 1..", kMaxRanks,
              " peer buffers, got ", world);
  TORCH_CHECK(rank >= 0 && rank < world, "rank: expected 0..", world - 1, ", got ", rank);
  TORCH_CHECK(capacity >= 1, "capacity: expected >= 1 token, got ", capacity);
  TORCH_CHECK(counters.is_cuda() && counters.scalar_type() == at::kInt &&
                  counters.numel() == kNumCounters && counters.is_contiguous(),
              "counters: expected a contiguous CUDA int32 [", kNumCounters, "]");
  for (int64_t r = 0; r < world; ++r) p.buffers[r] = reinterpret_cast<uint64_t*>(buffers[r]);
  p.rank = static_cast<int>(rank);
  p.world = static_cast<int>(world);
  p.capacity = capacity;
  p.counters = reinterpret_cast<uint32_t*>(counters.data_ptr<int32_t>());
  p.status = reinterpret_cast<volatile int64_t*>(status);
  return p;
}

// The fused call's launch arguments, checked.
inline FusedParams fused_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
                                const at::Tensor& k_weight, const at::Tensor& counters, c10::IntArrayRef buffers,
                                int64_t status, int64_t rank, int64_t capacity, double eps, double weight_offset,
                                bool hf_rounding, int implementation) {
  FusedParams p = workspace_params(counters, buffers, status, rank, capacity);
  p.shard = shard_params(q, k, &q_weight, &k_weight, eps, weight_offset);
  p.shard.dtype = dtype_of(q);
  p.shard.rounding = hf_rounding ? Rounding::kHf : Rounding::kFused;
  TORCH_CHECK(counters.device() == q.device(), "counters: expected them on ", q.device(), ", got ", counters.device());
  p.q_full_width = static_cast<float>(p.shard.q_hidden * p.world);
  p.k_full_width = static_cast<float>(p.shard.k_hidden * p.world);
  call_header(p, q.size(0), p.shard.dtype, hf_rounding, implementation, p.status[kStatusCallNumber]);
  return p;
}

using SumSqLaunchers = SumSqLauncher[kNumDTypes];
using ApplyLaunchers = ApplyLauncher[kNumDTypes][kNumRoundings];
using FusedLaunchers = FusedLauncher[kNumDTypes][kNumRoundings];
using AbsentLauncher = cudaError_t (*)(FusedParams, cudaStream_t);
using Explainer = std::string (*)(const FusedParams&);
using Explainers = Explainer[kNumDTypes][kNumRoundings];

template <const SumSqLaunchers& kLaunchers>
void sum_sq(const at::Tensor& q, const at::Tensor& k, at::Tensor sum_sq) {
  const Params p = shard_params(q, k, nullptr, nullptr, 0.0, 0.0);
  check_sum_sq(sum_sq, q);
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device());
  check_launch(kLaunchers[static_cast<int>(dtype_of(q))](p, sum_sq.data_ptr<float>(), stream));
}

template <const ApplyLaunchers& kLaunchers>
void apply(at::Tensor q, at::Tensor k, const at::Tensor& q_weight, const at::Tensor& k_weight, const at::Tensor& sum_sq,
           double eps, double weight_offset, int64_t q_full_width, int64_t k_full_width, bool hf_rounding) {
  ApplyParams a{};
  a.shard = shard_params(q, k, &q_weight, &k_weight, eps, weight_offset);
  check_sum_sq(sum_sq, q);
  a.sum_sq = sum_sq.data_ptr<float>();
  a.q_full_width = static_cast<float>(q_full_width);
  a.k_full_width = static_cast<float>(k_full_width);
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device());
  check_launch(kLaunchers[static_cast<int>(dtype_of(q))][hf_rounding ? 1 : 0](a, stream));
}

template <const FusedLaunchers& kLaunchers, int kImplementation>
void fused(at::Tensor q, at::Tensor k, const at::Tensor& q_weight, const at::Tensor& k_weight, at::Tensor counters,
           c10::IntArrayRef buffers, int64_t status, int64_t rank, int64_t capacity, double eps, double weight_offset,
           bool hf_rounding) {
  const FusedParams p = fused_params(q, k, q_weight, k_weight, counters, buffers, status, rank, capacity, eps,
                                     weight_offset, hf_rounding, kImplementation);
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device());
  check_launch(kLaunchers[static_cast<int>(p.shard.dtype)][hf_rounding ? 1 : 0](p, stream));
}

template <AbsentLauncher kAbsent>
void absent(at::Tensor counters, c10::IntArrayRef buffers, int64_t status, int64_t rank, int64_t capacity) {
  const FusedParams p = workspace_params(counters, buffers, status, rank, capacity);
  const c10::cuda::CUDAGuard guard(counters.device());
  check_launch(kAbsent(p, c10::cuda::getCurrentCUDAStream(counters.get_device())));
}

template <const Explainers& kExplainers>
std::string explain(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight,
                    const at::Tensor& counters, c10::IntArrayRef buffers, int64_t status, int64_t rank,
                    int64_t capacity, double eps, double weight_offset, bool hf_rounding) {
  const FusedParams p = fused_params(q, k, q_weight, k_weight, counters, buffers, status, rank, capacity, eps,
                                     weight_offset, hf_rounding, kTunedImplementation);
  const c10::cuda::CUDAGuard guard(q.device());
  return kExplainers[static_cast<int>(p.shard.dtype)][hf_rounding ? 1 : 0](p);
}

constexpr const char* kSumSqSchema = "(Tensor q, Tensor k, Tensor(a!) sum_sq) -> ()";
constexpr const char* kApplySchema =
    "(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, Tensor sum_sq, float eps, float weight_offset, "
    "int q_full_width, int k_full_width, bool hf_rounding) -> ()";
constexpr const char* kFusedSchema =
    "(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, Tensor(c!) counters, int[] buffers, int status, "
    "int rank, int capacity, float eps, float weight_offset, bool hf_rounding) -> ()";
constexpr const char* kAbsentSchema = "(Tensor(a!) counters, int[] buffers, int status, int rank, int capacity) -> ()";
constexpr const char* kExplainSchema =
    "(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor counters, int[] buffers, int status, int rank, "
    "int capacity, float eps, float weight_offset, bool hf_rounding) -> str";

}  // namespace cookbook::tp_qk_norm

#define COOKBOOK_TP_DTYPE_ROUNDING_TABLE(F)                                                           \
  {{&F<::cookbook::DType::kFloat32, ::cookbook::Rounding::kFused>,                                    \
    &F<::cookbook::DType::kFloat32, ::cookbook::Rounding::kHf>},                                      \
   {&F<::cookbook::DType::kFloat16, ::cookbook::Rounding::kFused>,                                    \
    &F<::cookbook::DType::kFloat16, ::cookbook::Rounding::kHf>},                                      \
   {&F<::cookbook::DType::kBFloat16, ::cookbook::Rounding::kFused>,                                   \
    &F<::cookbook::DType::kBFloat16, ::cookbook::Rounding::kHf>}}

#define COOKBOOK_TP_DEF(NAME, STEP, SCHEMA, IMPL)                                                     \
  TORCH_LIBRARY_FRAGMENT(cookbook, m) { m.def((std::string(#NAME "_" STEP) + (SCHEMA)).c_str()); }  \
  TORCH_LIBRARY_IMPL(cookbook, CUDA, m) { m.impl(#NAME "_" STEP, (IMPL)); }

// Rung 1's two steps (and the tuned kernel's NCCL path): NAME_sum_sq and NAME_apply.
#define COOKBOOK_TP_QK_NORM_PIPELINE(NAME, NS)                                                        \
  namespace NS {                                                                                      \
  template <::cookbook::DType kDType>                                                                 \
  cudaError_t launch_sum_sq(const ::cookbook::tp_qk_norm::Params&, float*, cudaStream_t);            \
  template <::cookbook::DType kDType, ::cookbook::Rounding kRounding>                                 \
  cudaError_t launch_apply(const ::cookbook::tp_qk_norm::ApplyParams&, cudaStream_t);                \
  constexpr ::cookbook::tp_qk_norm::SumSqLaunchers kSumSqLaunchers = {                                \
      &launch_sum_sq<::cookbook::DType::kFloat32>, &launch_sum_sq<::cookbook::DType::kFloat16>,       \
      &launch_sum_sq<::cookbook::DType::kBFloat16>};                                                  \
  constexpr ::cookbook::tp_qk_norm::ApplyLaunchers kApplyLaunchers = COOKBOOK_TP_DTYPE_ROUNDING_TABLE(launch_apply); \
  }                                                                                                   \
  COOKBOOK_TP_DEF(NAME, "sum_sq", ::cookbook::tp_qk_norm::kSumSqSchema,                              \
                  &::cookbook::tp_qk_norm::sum_sq<NS::kSumSqLaunchers>)                               \
  COOKBOOK_TP_DEF(NAME, "apply", ::cookbook::tp_qk_norm::kApplySchema,                               \
                  &::cookbook::tp_qk_norm::apply<NS::kApplyLaunchers>)

// The fused call (v2 on, tuned): NAME_fused, its header naming IMPLEMENTATION.
#define COOKBOOK_TP_QK_NORM_FUSED(NAME, NS, IMPLEMENTATION)                                           \
  namespace NS {                                                                                      \
  template <::cookbook::DType kDType, ::cookbook::Rounding kRounding>                                 \
  cudaError_t launch(const ::cookbook::tp_qk_norm::FusedParams&, cudaStream_t);                      \
  constexpr ::cookbook::tp_qk_norm::FusedLaunchers kFusedLaunchers = COOKBOOK_TP_DTYPE_ROUNDING_TABLE(launch); \
  }                                                                                                   \
  COOKBOOK_TP_DEF(NAME, "fused", ::cookbook::tp_qk_norm::kFusedSchema,                               \
                  (&::cookbook::tp_qk_norm::fused<NS::kFusedLaunchers, IMPLEMENTATION>))

// The launch of a rank that does not take part: NAME_absent.
#define COOKBOOK_TP_QK_NORM_ABSENT(NAME, NS)                                                          \
  namespace NS {                                                                                      \
  template <::cookbook::DType kDType>                                                                 \
  cudaError_t absent(::cookbook::tp_qk_norm::FusedParams, cudaStream_t);                             \
  }                                                                                                   \
  COOKBOOK_TP_DEF(NAME, "absent", ::cookbook::tp_qk_norm::kAbsentSchema,                             \
                  &::cookbook::tp_qk_norm::absent<&NS::absent<::cookbook::DType::kFloat32>>)

// The tuned kernel's plan for a fused call: NAME_explain.
#define COOKBOOK_TP_QK_NORM_EXPLAIN(NAME, NS)                                                         \
  namespace NS {                                                                                      \
  template <::cookbook::DType kDType, ::cookbook::Rounding kRounding>                                 \
  std::string explain(const ::cookbook::tp_qk_norm::FusedParams&);                                   \
  constexpr ::cookbook::tp_qk_norm::Explainers kExplainers = COOKBOOK_TP_DTYPE_ROUNDING_TABLE(explain); \
  }                                                                                                   \
  COOKBOOK_TP_DEF(NAME, "explain", ::cookbook::tp_qk_norm::kExplainSchema,                           \
                  &::cookbook::tp_qk_norm::explain<NS::kExplainers>)
