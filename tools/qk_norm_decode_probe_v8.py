"""GPU probe (`python tools/qk_norm_decode_probe_v8.py`; results in docs/qk_norm.md, v9): where
qk_norm v8 spends its one-token call, kernel by kernel under the bench's
CUDA-graph replay (72 rows x 128 bf16, q = rows 0..63, k = rows 64..71 of one buffer, 5 CTAs of 256,
64 rotating sets). Every kernel is a programmatic launch through cookbook's launch_kernel:
  v8: cookbook::qk_norm::launch(version 8), the real thing;
  body_w_first: v8's body without the row loop: weights (load_weight, effective_weight), then
                locate_row (fast division), load_x, sum, rstd, normalized, store_x;
  body_row_first: the same with the row loaded before the weights;
  flat_w_first: body_w_first with the row at x + row * 128 (no locate_row);
  flat_no_select: flat_w_first scaling by w_q only (no q/k select);
  flat_no_w: flat_w_first without weights (x * rstd).
"""
import pathlib
import torch
from torch.utils.cpp_extension import load_inline
from cookbook import bench, registry

ROOT = pathlib.Path(__file__).resolve().parents[1]
src = r'''
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include "qk_norm.cuh"
using namespace cookbook;
using namespace cookbook::qk_norm;
using T = __nv_bfloat16;
using Tr = V3Traits<T, 128>;

// kMode: 0 body_w_first, 1 body_row_first, 2 flat_w_first, 3 flat_no_select, 4 flat_no_w
template <int kMode>
__global__ void __launch_bounds__(256) body_kernel(Params p, int64_t rows) {
  after_prior_grids();
  const int lane = threadIdx.x % Tr::kThreadsPerHead;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * Tr::kHeadsPerBlock + threadIdx.x / Tr::kThreadsPerHead;
  const bool active = row < rows;
  float w_q[8], w_k[8];
  auto load_weights = [&]() {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = lane * 8 + j;
      w_q[j] = effective_weight<T, false>(load_weight<T>(p.q_weight, p.weight_is_fp32, c), p.weight_offset);
      w_k[j] = effective_weight<T, false>(load_weight<T>(p.k_weight, p.weight_is_fp32, c), p.weight_offset);
    }
  };
  if constexpr (kMode != 1 && kMode != 4) load_weights();
  Row<T> r{nullptr, nullptr, false};
  if (active) {
    if constexpr (kMode <= 1) {
      r = locate_row<T, uint32_t, true>(p, static_cast<uint32_t>(row));
    } else {
      r = {static_cast<T*>(p.q) + row * 128, nullptr, row < p.num_q_heads};
    }
  }
  Vec<T> v;
#pragma unroll
  for (int j = 0; j < 8; ++j) v.v[j] = from_float<T>(0.f);
  if (active) v = load_x<T, true>(r.x + lane * 8);
  if constexpr (kMode == 1) load_weights();
  float x[8];
  unpack<T>(v, x);
  float sum_sq = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) sum_sq += x[j] * x[j];
  const float rstd = rstd_from(warp_sum<16>(sum_sq), 128.f, p.eps);
  if (active) {
    float y[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float w = 1.f;
      if constexpr (kMode <= 2) w = r.is_q ? w_q[j] : w_k[j];
      if constexpr (kMode == 3) w = w_q[j];
      y[j] = normalized<T, false>(x[j], rstd, w);
    }
    store_x<T, true>(r.x + lane * 8, pack<T>(y));
  }
}

Params make_params(torch::Tensor x, torch::Tensor w) {
  Params p{};
  p.q = x.data_ptr();
  p.k = static_cast<T*>(x.data_ptr()) + 64 * 128;
  p.q_weight = w.data_ptr();
  p.k_weight = static_cast<T*>(w.data_ptr()) + 128;
  p.weight_is_fp32 = false;
  p.num_tokens = 1; p.num_q_heads = 64; p.num_kv_heads = 8; p.head_dim = 128;
  p.q_token_stride = 72 * 128; p.q_head_stride = 128; p.k_token_stride = 72 * 128; p.k_head_stride = 128;
  p.eps = 1e-6f; p.weight_offset = 0.f;
  p.heads_divisor = FastDivisor(72);
  return p;
}

void run(torch::Tensor x, torch::Tensor w, int64_t mode) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  const Params p = make_params(x, w);
  const int64_t rows = 72;
  const dim3 grid(5), block(256);
  switch (mode) {
    case 0: launch_kernel(true, body_kernel<0>, grid, block, 0, stream, p, rows); break;
    case 1: launch_kernel(true, body_kernel<1>, grid, block, 0, stream, p, rows); break;
    case 2: launch_kernel(true, body_kernel<2>, grid, block, 0, stream, p, rows); break;
    case 3: launch_kernel(true, body_kernel<3>, grid, block, 0, stream, p, rows); break;
    case 4: launch_kernel(true, body_kernel<4>, grid, block, 0, stream, p, rows); break;
    default: launch(p, DType::kBFloat16, false, static_cast<int>(mode - 100), stream); break;
  }
}
'''
ext = load_inline("floor_probe3", cpp_sources="void run(torch::Tensor x, torch::Tensor w, int64_t mode);",
                  cuda_sources=src, functions=["run"], extra_cuda_cflags=["-O3", "-arch=sm_90", "-std=c++17"],
                  extra_include_paths=[str(ROOT / "kernels_cuda")], verbose=False)
sets = [(torch.randn(72, 128, device="cuda", dtype=torch.bfloat16), torch.rand(256, device="cuda", dtype=torch.bfloat16) + 0.5)
        for _ in range(64)]
# correctness of the real launch on these buffers against the reference
x, w = sets[0][0].clone(), sets[0][1]
ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * torch.cat([w[:128].float().expand(64, 128), w[128:].float().expand(8, 128)])
ext.run(x, w, 108); torch.cuda.synchronize()
print("v8 on probe buffers max abs err vs fp32 ref:", (x.float() - ref).abs().max().item())
for name, mode in [("v6 (launch)", 106), ("v8 (launch)", 108), ("body_w_first", 0), ("body_row_first", 1),
                   ("flat_w_first", 2), ("flat_no_select", 3), ("flat_no_w", 4), ("v8 (launch) again", 108)]:
    fn = lambda x, w, mode=mode: ext.run(x, w, mode)
    t = bench.measure(fn, sets)
    print(f"{name:20s} {bench.summarize(t.per_call_us)['median_us']:6.2f} us  ({t.method}, {t.calls_per_replay} calls/replay)", flush=True)
