// Torch binding of kernels_cuda/cross_head_norm.cuh as the op cookbook::cross_head_norm (mutates
// q and k). Registered through TORCH_LIBRARY so torch.compile(fullgraph=True) and CUDA graphs see
// one op; the fake (meta) kernel is registered in Python (cookbook/cuda.py).
#include <torch/library.h>

#include <limits>

#include "bindings/torch_glue.h"
#include "cross_head_norm.cuh"

namespace {

void cross_head_norm_cuda(at::Tensor q, at::Tensor k, const at::Tensor& q_weight, const at::Tensor& k_weight,
                          double eps, double weight_offset, bool hf_rounding, int64_t version) {
  using namespace cookbook;
  glue::check_activation("q", q, 2);
  glue::check_activation("k", k, 2);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && k.device() == q.device(), "k: expected q's dtype and device");
  TORCH_CHECK(k.size(0) == q.size(0), "k: expected [", q.size(0), ", k_hidden], got ", k.sizes());
  TORCH_CHECK(q.size(0) <= std::numeric_limits<int32_t>::max(), "q: at most 2^31 - 1 tokens (grid.x), got ",
              q.size(0));
  glue::check_weight("q_weight", q_weight, q, q.size(1));
  glue::check_weight("k_weight", k_weight, k, k.size(1));

  const c10::cuda::CUDAGuard guard(q.device());
  cross_head_norm::Params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.q_weight = q_weight.data_ptr();
  p.k_weight = k_weight.data_ptr();
  p.q_weight_is_fp32 = q_weight.scalar_type() == at::kFloat;
  p.k_weight_is_fp32 = k_weight.scalar_type() == at::kFloat;
  p.num_tokens = q.size(0);
  p.q_hidden = static_cast<int>(q.size(1));
  p.k_hidden = static_cast<int>(k.size(1));
  p.q_token_stride = q.stride(0);
  p.k_token_stride = k.stride(0);
  p.eps = static_cast<float>(eps);
  p.weight_offset = static_cast<float>(weight_offset);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device());
  glue::check_launch(cross_head_norm::launch(p, glue::dtype_of(q), hf_rounding, static_cast<int>(version), stream));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cookbook, m) {
  m.def(
      "cross_head_norm(Tensor(a!) q, Tensor(b!) k, Tensor q_weight, Tensor k_weight, float eps, float weight_offset, "
      "bool hf_rounding, int version) -> ()");
}

TORCH_LIBRARY_IMPL(cookbook, CUDA, m) { m.impl("cross_head_norm", &cross_head_norm_cuda); }
