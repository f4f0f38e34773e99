"""GPU probe (`python tools/row_probe.py`; results in docs/results/cross_head_norm_h200_history.md): what a row-reduce
kernel can reach when a CTA must read its whole row before it writes any of it (the shape of
cross_head_norm's v3 kernel: load the row into registers, block sum of squares, scale, store),
with contiguous rows, at the bytes of 2048 x 8192, 8192 x 8192 and 1024 x 4096 bf16 q and k.
Variants (threads x 16-byte vectors per thread = bytes per CTA):
  row T x V: one CTA reduces its own T*V*16 bytes (a real cross_head_norm row of 8192 bf16 is
             16 KB, so only the 16 KB variants do its work; the smaller ones show what a CTA's
             share of the bytes costs);
  cluster C: a 16 KB row split over the C CTAs of a thread-block cluster, the partial sums
             exchanged through distributed shared memory (two cluster barriers);
  + weights: a 16 KB row variant that also reads a 16 KB bf16 weight row (one for all CTAs, as
             cross_head_norm's q weight) and multiplies by it: the op's L2 -> SM weight traffic.
The variants without "+ weights" read no weights.
Timed with the bench's machinery (CUDA-graph replay, rotating sets), programmatic launches."""
import math, sys, torch
from torch.utils.cpp_extension import load_inline
from cookbook import bench

src = r'''
#include <torch/extension.h>
#include <cuda_bf16.h>
#include <cooperative_groups.h>
#include <c10/cuda/CUDAStream.h>
namespace cg = cooperative_groups;
__device__ __forceinline__ int4 ld_cs(const int4* p) {
  int4 v;
  asm volatile("ld.global.cs.v4.s32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void st_cs(int4* p, int4 v) {
  asm volatile("st.global.cs.v4.s32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ float sumsq(int4 v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  float s = 0.f;
  for (int j = 0; j < 4; ++j) { float2 f = __bfloat1622float2(h[j]); s += f.x * f.x + f.y * f.y; }
  return s;
}
__device__ __forceinline__ int4 scale(int4 v, float r) {
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
  for (int j = 0; j < 4; ++j) { float2 f = __bfloat1622float2(h[j]); h[j] = __floats2bfloat162_rn(f.x * r, f.y * r); }
  return v;
}
template <int kThreads>
__device__ __forceinline__ float block_sum(float s) {
  __shared__ float warp_sums[kThreads / 32];
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffff, s, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = s;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) t += warp_sums[w];
  return t;
}
__device__ __forceinline__ int4 scale_by(int4 v, float r, int4 w) {
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
  const __nv_bfloat162* g = reinterpret_cast<const __nv_bfloat162*>(&w);
  for (int j = 0; j < 4; ++j) {
    float2 f = __bfloat1622float2(h[j]), k = __bfloat1622float2(g[j]);
    h[j] = __floats2bfloat162_rn(f.x * r * k.x, f.y * r * k.y);
  }
  return v;
}
template <int kThreads, int kVecs, int kCluster, bool kWeights>
__global__ void __launch_bounds__(kThreads) row_kernel(int4* x, const int4* w, float inv_n) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  int4* base = x + static_cast<int64_t>(blockIdx.x) * kThreads * kVecs;
  int4 v[kVecs];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) v[i] = ld_cs(base + i * kThreads + threadIdx.x);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) s += sumsq(v[i]);
  float total = block_sum<kThreads>(s);
  if constexpr (kCluster > 1) {
    __shared__ float cta_sum;
    if (threadIdx.x == 0) cta_sum = total;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    total = 0.f;
    for (int r = 0; r < kCluster; ++r) total += *cluster.map_shared_rank(&cta_sum, r);
    cluster.sync();  // no CTA leaves while another still reads its cta_sum
  }
  const float r = rsqrtf(total * inv_n + 1e-6f);
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int4 y = kWeights ? scale_by(v[i], r, __ldg(w + i * kThreads + threadIdx.x)) : scale(v[i], r);
    st_cs(base + i * kThreads + threadIdx.x, y);
  }
}
template <int kThreads, int kVecs, int kCluster, bool kWeights = false>
void go(torch::Tensor x, torch::Tensor w) {
  auto stream = at::cuda::getCurrentCUDAStream().stream();
  const int64_t vecs = x.numel() * x.element_size() / 16;
  cudaLaunchAttribute a[2]{};
  a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a[0].val.programmaticStreamSerializationAllowed = 1;
  a[1].id = cudaLaunchAttributeClusterDimension;
  a[1].val.clusterDim.x = kCluster; a[1].val.clusterDim.y = 1; a[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t c{};
  c.gridDim = dim3(vecs / (kThreads * kVecs));
  c.blockDim = dim3(kThreads);
  c.stream = stream;
  c.attrs = a;
  c.numAttrs = kCluster > 1 ? 2 : 1;
  auto err = cudaLaunchKernelEx(&c, row_kernel<kThreads, kVecs, kCluster, kWeights>, reinterpret_cast<int4*>(x.data_ptr()),
                                reinterpret_cast<const int4*>(w.data_ptr()), 1.f / 8192);
  TORCH_CHECK(err == cudaSuccess, cudaGetErrorString(err));
}
void run(torch::Tensor x, torch::Tensor w, int64_t mode) {
  switch (mode) {
    case 0: return go<128, 8, 1>(x, w);
    case 1: return go<256, 4, 1>(x, w);
    case 2: return go<512, 2, 1>(x, w);
    case 3: return go<256, 2, 1>(x, w);
    case 4: return go<128, 4, 1>(x, w);
    case 5: return go<256, 1, 1>(x, w);
    case 6: return go<128, 2, 1>(x, w);
    case 7: return go<256, 2, 2>(x, w);
    case 8: return go<256, 1, 4>(x, w);
    case 9: return go<128, 2, 4>(x, w);
    case 10: return go<128, 1, 8>(x, w);
    case 11: return go<128, 8, 1, true>(x, w);
    case 12: return go<256, 4, 1, true>(x, w);
  }
}
'''
mod = load_inline("row_probe", cpp_sources="void run(torch::Tensor x, torch::Tensor w, int64_t mode);", cuda_sources=src, functions=["run"],
                  extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)
ref = bench.copy_bandwidth_gb_per_s()
print(f"reference copy {ref/1000:.3f} TB/s")
labels = ["row 128x8 (16 KB)", "row 256x4 (16 KB)", "row 512x2 (16 KB)", "row 256x2 (8 KB)", "row 128x4 (8 KB)",
          "row 256x1 (4 KB)", "row 128x2 (4 KB)", "cluster 2 x (256x2)", "cluster 4 x (256x1)", "cluster 4 x (128x2)",
          "cluster 8 x (128x1)", "row 128x8 + weights", "row 256x4 + weights"]
w = torch.randn(8192, device="cuda").to(torch.bfloat16)
for shape, rows in (("2048x8192", 2 * 2048), ("8192x8192", 2 * 8192), ("1024x4096 (as 512 rows of 8192)", 1024)):
    nbytes = rows * 8192 * 2
    count = min(bench.MAX_INPUT_SETS, max(2, math.ceil(bench.L2_FLUSH_FACTOR * bench.l2_bytes() / (2 * nbytes))))
    sets = [(torch.randn(rows, 8192, device="cuda").to(torch.bfloat16),) for _ in range(count)]
    for mode, label in enumerate(labels):
        us = bench.summarize(bench.measure(lambda x, m=mode: mod.run(x, w, m), sets).per_call_us)["median_us"]
        pct = 100 * (2 * nbytes / (us * 1e-6) / bench.BYTES_PER_GB) / ref
        print(f"{shape:32s} {label:24s} {us:8.2f} us {pct:5.1f} % of ref copy", flush=True)
    del sets
    torch.cuda.empty_cache()
