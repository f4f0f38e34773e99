// Torch binding of kernels_cuda/qk_norm.cuh as the op cookbook::qk_norm (mutates q and k).
// Registered through TORCH_LIBRARY so torch.compile(fullgraph=True) and CUDA graphs see one op;
// the fake (meta) kernel is registered in Python (cookbook/cuda.py).
#include <torch/library.h>

#include "bindings/torch_glue.h"
#include "qk_norm.cuh"

namespace {

void qk_norm_cuda(at::Tensor q, at::Tensor k, const at::Tensor& q_weight, const at::Tensor& k_weight,
                  double eps, double weight_offset, bool hf_rounding, int64_t version) {
  using namespace cookbook;
  glue::check_activation("q", q, 3);
  glue::check_activation("k", k, 3);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && k.device() == q.device(), "k: expected q's dtype and device");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2), "k: expected [", q.size(0), ", Hk, ", q.size(2),
              "], got ", k.sizes());
  glue::check_weight("q_weight", q_weight, q, q.size(2));
  glue::check_weight("k_weight", k_weight, k, k.size(2));
  TORCH_CHECK(q_weight.scalar_type() == k_weight.scalar_type(), "q_weight and k_weight: expected one dtype");

  const c10::cuda::CUDAGuard guard(q.device());
  qk_norm::Params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.q_weight = q_weight.data_ptr();
  p.k_weight = k_weight.data_ptr();
  p.weight_is_fp32 = q_weight.scalar_type() == at::kFloat;
  p.num_tokens = q.size(0);
  p.num_q_heads = static_cast<int>(q.size(1));
  p.num_kv_heads = static_cast<int>(k.size(1));
  p.head_dim = static_cast<int>(q.size(2));
  p.q_token_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.k_token_stride = k.stride(0);
  p.k_head_stride = k.stride(1);
  p.eps = static_cast<float>(eps);
  p.weight_offset = static_cast<float>(weight_offset);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device());
  glue::check_launch(qk_norm::launch(p, glue::dtype_of(q), hf_rounding, static_cast<int>(version), stream));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cookbook, m) {
  m.def(
      "qk_norm(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, float eps, float weight_offset, "
      "bool hf_rounding, int version) -> ()");
}

TORCH_LIBRARY_IMPL(cookbook, CUDA, m) { m.impl("qk_norm", &qk_norm_cuda); }
