// Torch binding of kernels_cuda/tp_qk_norm.cuh: four ops, all in place.
//   cookbook::tp_qk_norm_sum_sq   v1 step 1: [T, 2] float32 partial sums of squares of this shard
//   cookbook::tp_qk_norm_apply    v1 step 3: normalize the shard from the all-reduced sums
//   cookbook::tp_qk_norm_fused    v2 on: the whole op in one kernel, peers' buffers by address
//   cookbook::tp_qk_norm_absent   the fused protocol's launch of a rank that rejected its arguments
// Built twice (cookbook/cuda.py, `load_tp`): as the ladder's extension, every version in this one
// unit; and as the tuned extension (COOKBOOK_TP_TUNED: v1 and kTunedVersion only, its kernels in
// units of their own), whose ops are named cookbook::tp_qk_norm_tuned_*.
// The all-reduce of v1 (NCCL) and the symmetric-memory workspace of v2 are set up in Python
// (cookbook/cuda.py, cookbook/tp_workspace.py); the fake (meta) kernels are registered there too.
#include <torch/library.h>

#include <limits>

#include "bindings/torch_glue.h"
#include "tp_qk_norm.cuh"

#ifdef COOKBOOK_TP_TUNED
#define COOKBOOK_TP_OP(name) "tp_qk_norm_tuned_" name
#else
#define COOKBOOK_TP_OP(name) "tp_qk_norm_" name
#endif

namespace {

using namespace cookbook;

cross_head_norm::Params shard_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor* q_weight,
                                     const at::Tensor* k_weight, double eps, double weight_offset) {
  glue::check_activation("q_shard", q, 2);
  glue::check_activation("k_shard", k, 2);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && k.device() == q.device(), "k_shard: expected q_shard's dtype and device");
  TORCH_CHECK(k.size(0) == q.size(0), "k_shard: expected [", q.size(0), ", k_shard_width], got ", k.sizes());
  TORCH_CHECK(q.size(0) <= std::numeric_limits<int32_t>::max(), "q_shard: at most 2^31 - 1 tokens, got ", q.size(0));
  cross_head_norm::Params p{};
  if (q_weight != nullptr) {
    glue::check_weight("q_weight_shard", *q_weight, q, q.size(1));
    glue::check_weight("k_weight_shard", *k_weight, k, k.size(1));
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

void check_sum_sq(const at::Tensor& sum_sq, const at::Tensor& q) {
  TORCH_CHECK(sum_sq.device() == q.device() && sum_sq.scalar_type() == at::kFloat && sum_sq.dim() == 2 &&
                  sum_sq.size(0) == q.size(0) && sum_sq.size(1) == tp_qk_norm::kNumTensors && sum_sq.is_contiguous(),
              "sum_sq: expected a contiguous float32 [", q.size(0), ", 2] on ", q.device(), ", got ", sum_sq.sizes(),
              " ", sum_sq.scalar_type());
}

void sum_sq_cuda(const at::Tensor& q, const at::Tensor& k, at::Tensor sum_sq) {
  const auto p = shard_params(q, k, nullptr, nullptr, 0.0, 0.0);
  check_sum_sq(sum_sq, q);
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device());
  glue::check_launch(tp_qk_norm::sum_sq(p, glue::dtype_of(q), sum_sq.data_ptr<float>(), stream));
}

void apply_cuda(at::Tensor q, at::Tensor k, const at::Tensor& q_weight, const at::Tensor& k_weight,
                const at::Tensor& sum_sq, double eps, double weight_offset, int64_t q_full_width, int64_t k_full_width,
                bool hf_rounding) {
  tp_qk_norm::ApplyParams a{};
  a.shard = shard_params(q, k, &q_weight, &k_weight, eps, weight_offset);
  check_sum_sq(sum_sq, q);
  a.sum_sq = sum_sq.data_ptr<float>();
  a.q_full_width = static_cast<float>(q_full_width);
  a.k_full_width = static_cast<float>(k_full_width);
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device());
  glue::check_launch(tp_qk_norm::apply(a, glue::dtype_of(q), hf_rounding, stream));
}

// The workspace's part of the fused kernel's parameters: the peers' buffers, this rank, the
// counters and the status words (cookbook/tp_workspace.py).
tp_qk_norm::FusedParams workspace_params(const at::Tensor& counters, c10::IntArrayRef buffers, int64_t status,
                                         int64_t rank, int64_t capacity) {
  tp_qk_norm::FusedParams p{};
  const auto world = static_cast<int64_t>(buffers.size());
  TORCH_CHECK(world >= 1 && world <= tp_qk_norm::kMaxRanks, "buffers: expected 1..", tp_qk_norm::kMaxRanks,
              " peer buffers, got ", world);
  TORCH_CHECK(rank >= 0 && rank < world, "rank: expected 0..", world - 1, ", got ", rank);
  TORCH_CHECK(capacity >= 1, "capacity: expected >= 1 token, got ", capacity);
  TORCH_CHECK(counters.is_cuda() && counters.scalar_type() == at::kInt &&
                  counters.numel() == tp_qk_norm::kNumCounters && counters.is_contiguous(),
              "counters: expected a contiguous CUDA int32 [", tp_qk_norm::kNumCounters, "]");
  for (int64_t r = 0; r < world; ++r) p.buffers[r] = reinterpret_cast<uint64_t*>(buffers[r]);
  p.rank = static_cast<int>(rank);
  p.world = static_cast<int>(world);
  p.capacity = capacity;
  p.counters = reinterpret_cast<uint32_t*>(counters.data_ptr<int32_t>());
  p.status = reinterpret_cast<volatile int64_t*>(status);
  return p;
}

void fused_cuda(at::Tensor q, at::Tensor k, const at::Tensor& q_weight, const at::Tensor& k_weight, at::Tensor counters,
                c10::IntArrayRef buffers, int64_t status, int64_t rank, int64_t capacity, double eps,
                double weight_offset, bool hf_rounding, int64_t version) {
  tp_qk_norm::FusedParams p = workspace_params(counters, buffers, status, rank, capacity);
  p.shard = shard_params(q, k, &q_weight, &k_weight, eps, weight_offset);
  TORCH_CHECK(counters.device() == q.device(), "counters: expected them on ", q.device(), ", got ", counters.device());
#ifdef COOKBOOK_TP_TUNED
  TORCH_CHECK(version == tp_qk_norm::kTunedVersion, "version: the tuned extension runs v", tp_qk_norm::kTunedVersion,
              " only, got ", version);
#else
  TORCH_CHECK(version >= 2 && version <= tp_qk_norm::kNumVersions, "version: expected 2..", tp_qk_norm::kNumVersions,
              ", got ", version);
#endif
  p.q_full_width = static_cast<float>(p.shard.q_hidden * p.world);
  p.k_full_width = static_cast<float>(p.shard.k_hidden * p.world);
  tp_qk_norm::call_header(p, q.size(0), glue::dtype_of(q), hf_rounding, static_cast<int>(version),
                          p.status[tp_qk_norm::kStatusCallNumber]);
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device());
  glue::check_launch(tp_qk_norm::fused(p, glue::dtype_of(q), hf_rounding, static_cast<int>(version), stream));
}

void absent_cuda(at::Tensor counters, c10::IntArrayRef buffers, int64_t status, int64_t rank, int64_t capacity) {
  const tp_qk_norm::FusedParams p = workspace_params(counters, buffers, status, rank, capacity);
  const c10::cuda::CUDAGuard guard(counters.device());
  glue::check_launch(tp_qk_norm::absent(p, c10::cuda::getCurrentCUDAStream(counters.get_device())));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cookbook, m) {
  m.def(COOKBOOK_TP_OP("sum_sq") "(Tensor q, Tensor k, Tensor(a!) sum_sq) -> ()");
  m.def(COOKBOOK_TP_OP("apply")
        "(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, Tensor sum_sq, float eps, "
        "float weight_offset, int q_full_width, int k_full_width, bool hf_rounding) -> ()");
  m.def(COOKBOOK_TP_OP("fused")
        "(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, Tensor(c!) counters, "
        "int[] buffers, int status, int rank, int capacity, float eps, float weight_offset, bool hf_rounding, "
        "int version) -> ()");
  m.def(COOKBOOK_TP_OP("absent") "(Tensor(a!) counters, int[] buffers, int status, int rank, int capacity) -> ()");
}

TORCH_LIBRARY_IMPL(cookbook, CUDA, m) {
  m.impl(COOKBOOK_TP_OP("sum_sq"), &sum_sq_cuda);
  m.impl(COOKBOOK_TP_OP("apply"), &apply_cuda);
  m.impl(COOKBOOK_TP_OP("fused"), &fused_cuda);
  m.impl(COOKBOOK_TP_OP("absent"), &absent_cuda);
}
