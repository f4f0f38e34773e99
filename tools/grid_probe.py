"""GPU probe (`python tools/grid_probe.py`; results in docs/qk_norm.md, v11): how fast can a kernel
that streams B bytes in place go, and does the shape of its grid matter?

For half the bytes of some bench shapes, timed with the bench's own machinery (CUDA-graph replay,
rotating sets moving >= 4x the L2): `torch.Tensor.copy_` (the bench's reference is this at 256
MiB), then a copy kernel and an in-place kernel (x *= 1 in bf16x2: a read, a trivial op, a write
to the same address), both
  - on a grid of all the 16-byte vectors, one per thread ("full grid"), or
  - on a persistent grid of 8 blocks of 256 threads per SM, each thread walking the buffer by the
    grid's stride with 4 vectors in flight ("persistent"),
with default or streaming (`.cs`) accesses, every kernel a programmatic launch (griddepcontrol)
as the cookbook's kernels are. What it showed on the H200: in place costs next to nothing over a
copy, and the persistent grid costs 7-9 % at every size."""
import math, sys, torch
from torch.utils.cpp_extension import load_inline
from cookbook import bench

src = r'''
#include <torch/extension.h>
#include <cuda_bf16.h>
#include <c10/cuda/CUDAStream.h>
template <bool kCs> __device__ __forceinline__ int4 ld(const int4* p) {
  int4 v;
  if constexpr (kCs) asm volatile("ld.global.cs.v4.s32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else v = *p;
  return v;
}
template <bool kCs> __device__ __forceinline__ void st(int4* p, int4 v) {
  if constexpr (kCs) asm volatile("st.global.cs.v4.s32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
  else *p = v;
}
__device__ __forceinline__ int4 scale(int4 v, __nv_bfloat162 s) {
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
  for (int j = 0; j < 4; ++j) h[j] = __hmul2(h[j], s);
  return v;
}
template <bool kCs, int kUnroll>
__global__ void __launch_bounds__(256) stream_kernel(const int4* src, int4* dst, int64_t n) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const __nv_bfloat162 s = __floats2bfloat162_rn(1.f, 1.f);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = ld<kCs>(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) st<kCs>(dst + i + u * stride, scale(v[u], s));
  }
  for (; i < n; i += stride) st<kCs>(dst + i, scale(ld<kCs>(src + i), s));
}
template <bool kCs, int kUnroll>
void go(torch::Tensor dst, torch::Tensor srct, int64_t blocks) {
  auto stream = at::cuda::getCurrentCUDAStream().stream();
  const int64_t n = srct.numel() / 16;
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c{};
  c.gridDim = dim3(blocks > 0 ? blocks : (n + 255) / 256);
  c.blockDim = dim3(256);
  c.stream = stream;
  c.attrs = &a;
  c.numAttrs = 1;
  cudaLaunchKernelEx(&c, stream_kernel<kCs, kUnroll>, reinterpret_cast<const int4*>(srct.data_ptr()),
                     reinterpret_cast<int4*>(dst.data_ptr()), n);
}
void run(torch::Tensor dst, torch::Tensor src, int64_t mode, int64_t blocks) {
  switch (mode) {
    case 0: return go<false, 1>(dst, src, blocks);
    case 1: return go<true, 1>(dst, src, blocks);
    case 2: return go<false, 4>(dst, src, blocks);
    case 3: return go<true, 4>(dst, src, blocks);
  }
}
'''
mod = load_inline("grid_probe", cpp_sources="void run(torch::Tensor dst, torch::Tensor src, int64_t mode, int64_t blocks);",
                  cuda_sources=src, functions=["run"], extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
                  verbose=False)
sms = torch.cuda.get_device_properties(0).multi_processor_count
ref = bench.copy_bandwidth_gb_per_s()
print(f"reference copy {ref/1000:.3f} TB/s")
# half the bytes of: qk_norm 8192x8/1, cross 1024x4096, rope flux, cross 2048x8192, qk_norm 8192x64/8
sizes = {"qk_norm 8192x8/1": 37748736, "cross 1024x4096": 33570816, "rope flux": 102790000, "cross 2048x8192": 134217728,
         "qk_norm 8192x64/8": 301989888}
def t(fn, sets):
    return bench.summarize(bench.measure(fn, sets).per_call_us)["median_us"]
for name, moved in sizes.items():
    nb = moved // 2 // 65536 * 65536
    count = min(bench.MAX_INPUT_SETS, max(2, math.ceil(bench.L2_FLUSH_FACTOR * bench.l2_bytes() / nb)))
    pairs = [(torch.empty(nb, dtype=torch.uint8, device="cuda"), torch.ones(nb, dtype=torch.uint8, device="cuda")) for _ in range(count)]
    res = {"copy_": t(bench.device_copy, pairs)}
    persistent = sms * 8
    for mode, label in ((0, "1vec"), (1, "1vec.cs"), (2, "4vec"), (3, "4vec.cs")):
        for blocks, glabel in ((0, "full grid"), (persistent, "persistent")):
            if mode < 2 and blocks: continue
            res[f"copy kernel {label} {glabel}"] = t(lambda d, s, m=mode, b=blocks: mod.run(d, s, m, b), pairs)
            res[f"in-place {label} {glabel}"] = t(lambda d, s, m=mode, b=blocks: mod.run(s, s, m, b), pairs)
    del pairs
    torch.cuda.empty_cache()
    for k, us in res.items():
        pct = 100 * (2 * nb / (us * 1e-6) / bench.BYTES_PER_GB) / ref
        print(f"{name:20s} {nb/1e6:7.2f} MB  {k:32s} {us:8.2f} us {pct:5.1f} % of ref copy", flush=True)
