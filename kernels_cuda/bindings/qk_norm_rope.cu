// Torch binding of kernels_cuda/qk_norm_rope.cuh as the op cookbook::qk_norm_rope (mutates q and k).
// Registered through TORCH_LIBRARY so torch.compile(fullgraph=True) and CUDA graphs see one op;
// the fake (meta) kernel is registered in Python (cookbook/cuda.py).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "bindings/torch_glue.h"
#include "qk_norm_rope.cuh"

namespace {

void qk_norm_rope_cuda(at::Tensor q, at::Tensor k, const at::Tensor& q_weight, const at::Tensor& k_weight,
                       const at::Tensor& cos_sin_cache, const at::Tensor& positions, double eps, double weight_offset,
                       bool is_neox, int64_t rope_dim, int64_t position_offset, bool hf_rounding, int64_t version) {
  using namespace cookbook;
  glue::check_activation("q", q, 3);
  glue::check_activation("k", k, 3);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && k.device() == q.device(), "k: expected q's dtype and device");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2), "k: expected [", q.size(0), ", Hk, ", q.size(2),
              "], got ", k.sizes());
  glue::check_weight("q_weight", q_weight, q, q.size(2));
  glue::check_weight("k_weight", k_weight, k, k.size(2));
  TORCH_CHECK(q_weight.scalar_type() == k_weight.scalar_type(), "q_weight and k_weight: expected one dtype");
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
  TORCH_CHECK(version >= 1 && version <= qk_norm_rope::kNumVersions, "version: expected 1..",
              qk_norm_rope::kNumVersions, ", got ", version);

  const c10::cuda::CUDAGuard guard(q.device());
  qk_norm_rope::Params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.q_weight = q_weight.data_ptr();
  p.k_weight = k_weight.data_ptr();
  p.weight_is_fp32 = q_weight.scalar_type() == at::kFloat;
  p.cos_sin_cache = cos_sin_cache.data_ptr();
  p.cache_is_fp32 = cos_sin_cache.scalar_type() == at::kFloat;
  p.max_position = cos_sin_cache.size(0);
  p.positions = positions.data_ptr();
  p.positions_are_int64 = positions.scalar_type() == at::kLong;
  p.position_offset = position_offset;
  p.num_tokens = q.size(0);
  p.num_q_heads = static_cast<int>(q.size(1));
  p.num_kv_heads = static_cast<int>(k.size(1));
  p.head_dim = static_cast<int>(q.size(2));
  p.rope_dim = static_cast<int>(rope_dim);
  p.is_neox = is_neox;
  p.q_token_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.k_token_stride = k.stride(0);
  p.k_head_stride = k.stride(1);
  p.eps = static_cast<float>(eps);
  p.weight_offset = static_cast<float>(weight_offset);
  // v1's float32 intermediate, from torch's caching allocator (stream-ordered, graph-safe).
  at::Tensor scratch;
  const int64_t scratch_elements = qk_norm_rope::scratch_elements(p, static_cast<int>(version));
  if (scratch_elements > 0) {
    scratch = at::empty({scratch_elements}, q.options().dtype(at::kFloat));
    p.scratch = scratch.data_ptr<float>();
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device());
  glue::check_launch(qk_norm_rope::launch(p, glue::dtype_of(q), hf_rounding, static_cast<int>(version), stream));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cookbook, m) {
  m.def(
      "qk_norm_rope(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, "
      "Tensor positions, float eps, float weight_offset, bool is_neox, int rope_dim, int position_offset, "
      "bool hf_rounding, int version) -> ()");
}

TORCH_LIBRARY_IMPL(cookbook, CUDA, m) { m.impl("qk_norm_rope", &qk_norm_rope_cuda); }
