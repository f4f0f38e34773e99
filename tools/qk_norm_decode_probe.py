"""GPU probe: the per-call floor of a one-token qk_norm-like kernel under the bench's CUDA-graph replay
(`python tools/qk_norm_decode_probe.py` on a GPU; docs/qk_norm.md has what it measured on the H200).

72 rows x 128 bf16 (qk_norm at one token, 64 + 8 heads), 16 lanes per row, 5 CTAs of 256, 64 rotating
input sets as the bench uses. Modes (all but *_plain launched programmatically: griddepcontrol.wait +
launch_dependents first):
  0 empty; 1 touch: one 16-byte ld.cs + st.cs per lane; 2 reduce: touch + 16-lane shuffle sum + rsqrt scale;
  3 w_scalar_before_row: v6's order: 16 scalar bf16 weight loads, converted (+offset) into floats, then the row;
  4 w_vec_raw: two raw 16-byte weight vectors, then the row, weights unpacked at use;
  5 w_scalar_after_row: the row load first, then v6's scalar weight loads and conversions.
"""
import torch
from torch.utils.cpp_extension import load_inline
from cookbook import bench, registry

src = r'''
#include <torch/extension.h>
#include <cuda_bf16.h>
#include <c10/cuda/CUDAStream.h>

__device__ __forceinline__ int4 ld_cs(const int4* p) {
  int4 v;
  asm volatile("ld.global.cs.v4.s32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

template <bool kPdl, int kMode>
__global__ void __launch_bounds__(256) probe_kernel(__nv_bfloat16* x, const __nv_bfloat16* w, int rows, float offset) {
  if constexpr (kPdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  if constexpr (kMode == 0) return;
  const int row = blockIdx.x * 16 + threadIdx.x / 16;
  const int lane = threadIdx.x % 16;
  const bool active = row < rows;
  const bool is_q = (row % 72) < 64;
  float wq[8], wk[8];
  int4 wq4{}, wk4{};
  if constexpr (kMode == 3) {
    for (int e = 0; e < 8; ++e) { wq[e] = __bfloat162float(w[lane * 8 + e]) + offset; wk[e] = __bfloat162float(w[128 + lane * 8 + e]) + offset; }
  }
  if constexpr (kMode == 4) {
    wq4 = reinterpret_cast<const int4*>(w)[lane];
    wk4 = reinterpret_cast<const int4*>(w + 128)[lane];
  }
  int4* p = reinterpret_cast<int4*>(x + row * 128) + lane;
  int4 v{};
  if (active) v = ld_cs(p);
  if constexpr (kMode == 5) {
    for (int e = 0; e < 8; ++e) { wq[e] = __bfloat162float(w[lane * 8 + e]) + offset; wk[e] = __bfloat162float(w[128 + lane * 8 + e]) + offset; }
  }
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
  if constexpr (kMode >= 2) {
    float s = 0.f;
    for (int j = 0; j < 4; ++j) { float2 f = __bfloat1622float2(h[j]); s += f.x * f.x + f.y * f.y; }
    for (int o = 8; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffff, s, o);
    const float r = rsqrtf(s / 128.f + 1e-6f);
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(h[j]);
      float2 g = make_float2(1.f, 1.f);
      if constexpr (kMode == 4) {
        const int4 wv = is_q ? wq4 : wk4;
        g = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(&wv)[j]);
        g.x += offset; g.y += offset;
      } else if constexpr (kMode == 3 || kMode == 5) {
        g = make_float2(is_q ? wq[2 * j] : wk[2 * j], is_q ? wq[2 * j + 1] : wk[2 * j + 1]);
      }
      h[j] = __floats2bfloat162_rn(f.x * r * g.x, f.y * r * g.y);
    }
  }
  if (active) asm volatile("st.global.cs.v4.s32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

template <bool kPdl, int kMode>
void go(torch::Tensor x, torch::Tensor wt, int64_t blocks) {
  auto stream = at::cuda::getCurrentCUDAStream().stream();
  auto* ptr = reinterpret_cast<__nv_bfloat16*>(x.data_ptr());
  auto* w = reinterpret_cast<const __nv_bfloat16*>(wt.data_ptr());
  const int rows = x.size(0);
  const float offset = 0.f;
  if (!kPdl) { probe_kernel<kPdl, kMode><<<blocks, 256, 0, stream>>>(ptr, w, rows, offset); return; }
  cudaLaunchAttribute a{}; a.id = cudaLaunchAttributeProgrammaticStreamSerialization; a.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c{}; c.gridDim = dim3(blocks); c.blockDim = dim3(256); c.stream = stream; c.attrs = &a; c.numAttrs = 1;
  cudaLaunchKernelEx(&c, probe_kernel<kPdl, kMode>, ptr, w, rows, offset);
}

void probe(torch::Tensor x, torch::Tensor w, int64_t mode, bool pdl, int64_t blocks) {
  if (pdl) {
    switch (mode) {
      case 0: return go<true, 0>(x, w, blocks);
      case 1: return go<true, 1>(x, w, blocks);
      case 2: return go<true, 2>(x, w, blocks);
      case 3: return go<true, 3>(x, w, blocks);
      case 4: return go<true, 4>(x, w, blocks);
      default: return go<true, 5>(x, w, blocks);
    }
  }
  switch (mode) {
    case 0: return go<false, 0>(x, w, blocks);
    case 1: return go<false, 1>(x, w, blocks);
    default: return go<false, 2>(x, w, blocks);
  }
}
'''
ext = load_inline("floor_probe2", cpp_sources="void probe(torch::Tensor x, torch::Tensor w, int64_t mode, bool pdl, int64_t blocks);",
                  cuda_sources=src, functions=["probe"], extra_cuda_cflags=["-O3", "-arch=sm_90"], verbose=False)
rows = 72
sets = [(torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16), torch.rand(256, device="cuda", dtype=torch.bfloat16))
        for _ in range(64)]
for name, mode, pdl, blocks in [("empty_plain 1 CTA", 0, False, 1), ("empty_pdl 1 CTA", 0, True, 1),
                                ("empty_pdl 5 CTAs", 0, True, 5), ("touch_pdl", 1, True, 5),
                                ("reduce_plain", 2, False, 5), ("reduce_pdl", 2, True, 5),
                                ("w_scalar_before_row", 3, True, 5), ("w_vec_raw", 4, True, 5),
                                ("w_scalar_after_row", 5, True, 5)]:
    fn = lambda x, w, mode=mode, pdl=pdl, blocks=blocks: ext.probe(x, w, mode, pdl, blocks)
    t = bench.measure(fn, sets)
    print(f"{name:22s} {bench.summarize(t.per_call_us)['median_us']:6.2f} us  ({t.method}, {t.calls_per_replay} calls/replay)", flush=True)
op = "qk_norm"
contract = registry.contract(op)
impls = [registry.get(op, n) for n in ("cuda_v6",)]
copy = bench.copy_bandwidth_gb_per_s()
for r in bench.bench_shape(op, contract, contract.BENCH_SHAPES[0], torch.bfloat16, impls, copy, bench.Progress(1)):
    print(f"{r['label']:30s} {r['impl']:10s} {r['median_us']:6.2f} us")
