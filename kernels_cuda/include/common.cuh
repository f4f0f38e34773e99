// Shared device helpers for every kernel of the cookbook: dtype conversions, warp reductions,
// 16-byte vector access and the RMSNorm arithmetic that all ops share. Torch-free, so nvcc
// compiles every kernel header on a machine without a GPU or PyTorch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "include/dtype.h"
#include "include/plan.h"  // kWarpSize, kVecBytes: shared with the host policies

namespace cookbook {

constexpr unsigned kFullMask = 0xffffffffu;


// The storage type of each activation dtype: Storage<DType::kBFloat16> is __nv_bfloat16.
template <DType kDType>
struct StorageOf;
template <>
struct StorageOf<DType::kFloat32> { using type = float; };
template <>
struct StorageOf<DType::kFloat16> { using type = __half; };
template <>
struct StorageOf<DType::kBFloat16> { using type = __nv_bfloat16; };
template <DType kDType>
using Storage = typename StorageOf<kDType>::type;

// ---- conversions: float32 is the arithmetic type, T the storage type ------------------------
template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// Round to nearest even into the storage type.
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// v rounded to T and back: the intermediate roundings of the Hugging Face order.
template <typename T>
__device__ __forceinline__ float round_to(float v) { return to_float<T>(from_float<T>(v)); }

// A weight element, stored in the activation dtype or in float32 (a runtime flag: weights are
// read once per thread, so the branch costs nothing on the hot path).
template <typename T>
__device__ __forceinline__ float load_weight(const void* w, bool weight_is_fp32, int64_t i) {
  return weight_is_fp32 ? static_cast<const float*>(w)[i] : to_float<T>(static_cast<const T*>(w)[i]);
}

// ---- reductions ------------------------------------------------------------------------------
// Sum over aligned groups of kWidth lanes (kWidth = 32: the whole warp); every lane of the group
// gets the result. All 32 lanes must execute the call.
template <int kWidth = kWarpSize>
__device__ __forceinline__ float warp_sum(float v) {
  static_assert(kWidth >= 1 && kWidth <= kWarpSize && (kWidth & (kWidth - 1)) == 0,
                "a shuffle group is a power of two no wider than a warp");
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Sums of kValues floats over the whole block, in place; every thread gets the results. Each warp
// reduces with shuffles, lane 0 parks the warp's partials in shared memory, then every warp adds
// the partials itself (no broadcast barrier). Contains barriers: EVERY thread of the block must
// make the call (never under a divergent branch); blockDim.x a multiple of 32, at most 1024.
constexpr int kMaxWarpsPerBlock = 1024 / kWarpSize;

template <int kValues>
__device__ __forceinline__ void block_sum(float (&v)[kValues]) {
  __shared__ float partials[kValues][kMaxWarpsPerBlock];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
#pragma unroll
  for (int i = 0; i < kValues; ++i) v[i] = warp_sum(v[i]);
  __syncthreads();  // an earlier call's readers are done with `partials`
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < kValues; ++i) partials[i][warp] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kValues; ++i) v[i] = warp_sum(lane < num_warps ? partials[i][lane] : 0.f);
}

__device__ __forceinline__ float block_sum(float v) {
  float values[1] = {v};
  block_sum<1>(values);
  return values[0];
}

// ---- 16-byte vectors -------------------------------------------------------------------------
template <typename T>
struct alignas(kVecBytes) Vec {
  static constexpr int kElems = kVecBytes / static_cast<int>(sizeof(T));
  T v[kElems];
};

template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const T* p) {
  Vec<T> out;
  *reinterpret_cast<uint4*>(&out) = *reinterpret_cast<const uint4*>(p);
  return out;
}

template <typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T>& in) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&in);
}

// The elements of a vector as float32, and float32 values rounded back into a vector. A bf16 is
// the top half of a float32, so a pair packed in one 32-bit word unpacks with one shift (the low
// element) and one mask (the high one), and a pair packs with one F2FP instruction: half the
// instructions of converting element by element (which moves each half into its own register
// first). fp16 pairs convert with the paired intrinsics.
template <typename T>
__device__ __forceinline__ void unpack(const Vec<T>& in, float (&out)[Vec<T>::kElems]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(in.v);
#pragma unroll
    for (int i = 0; i < Vec<T>::kElems / 2; ++i) {
      out[2 * i] = __uint_as_float(words[i] << 16);
      out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  } else if constexpr (std::is_same_v<T, __half>) {
    const __half2* pairs = reinterpret_cast<const __half2*>(in.v);
#pragma unroll
    for (int i = 0; i < Vec<T>::kElems / 2; ++i) {
      const float2 f = __half22float2(pairs[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < Vec<T>::kElems; ++i) out[i] = in.v[i];
  }
}

// Round to nearest even, two elements per instruction for the 16-bit types.
template <typename T>
__device__ __forceinline__ Vec<T> pack(const float (&in)[Vec<T>::kElems]) {
  Vec<T> out;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(out.v);
#pragma unroll
    for (int i = 0; i < Vec<T>::kElems / 2; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  } else if constexpr (std::is_same_v<T, __half>) {
    __half2* pairs = reinterpret_cast<__half2*>(out.v);
#pragma unroll
    for (int i = 0; i < Vec<T>::kElems / 2; ++i) pairs[i] = __floats2half2_rn(in[2 * i], in[2 * i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < Vec<T>::kElems; ++i) out.v[i] = in[i];
  }
  return out;
}

// Streaming access, for the rows of an in-place op: each byte is read once and written once, so
// the loads and stores carry the evict-first policy (ld/st.global.cs: LDG/STG.E.EF) and leave the
// caches to what is reused (weights, cos/sin, positions). Being explicit global accesses, they
// also never compile to generic LD/ST, which is what nvcc emits where it cannot prove a pointer
// global (a pointer chosen at run time between q and k, for one).
template <typename T>
__device__ __forceinline__ Vec<T> load_vec_streaming(const T* p) {
  Vec<T> out;
  *reinterpret_cast<uint4*>(&out) = __ldcs(reinterpret_cast<const uint4*>(p));
  return out;
}

template <typename T>
__device__ __forceinline__ void store_vec_streaming(T* p, const Vec<T>& in) {
  __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&in));
}

// A row that will be read again soon (tp_qk_norm v7 reads a token's rows, and re-reads them a few
// steps later): ld.global.cg caches it in L2 only, with the default (evict-normal) policy, so the
// second read finds it there and the SM's L1 keeps what it reuses (the weights).
template <typename T>
__device__ __forceinline__ Vec<T> load_vec_l2(const T* p) {
  Vec<T> out;
  *reinterpret_cast<uint4*>(&out) = __ldcg(reinterpret_cast<const uint4*>(p));
  return out;
}

// The row of an in-place op: streaming accesses in the kernels compiled with kStreaming (v5 on),
// the default cached ones otherwise. One place for the choice, so a kernel body reads the same.
template <typename T, bool kStreaming>
__device__ __forceinline__ Vec<T> load_x(const T* p) {
  if constexpr (kStreaming) return load_vec_streaming<T>(p);
  return load_vec<T>(p);
}

template <typename T, bool kStreaming>
__device__ __forceinline__ void store_x(T* p, const Vec<T>& in) {
  if constexpr (kStreaming) {
    store_vec_streaming<T>(p, in);
  } else {
    store_vec<T>(p, in);
  }
}

// Read-only tables (weights, the cos/sin cache): no kernel writes them while it reads them, so
// they may take the non-coherent read-only path (LDG.CONSTANT), an explicit global load too.
template <typename T>
__device__ __forceinline__ Vec<T> load_vec_readonly(const T* p) {
  Vec<T> out;
  *reinterpret_cast<uint4*>(&out) = __ldg(reinterpret_cast<const uint4*>(p));
  return out;
}

// ---- Hopper bulk copies (sm_90+): the TMA engine copies global -> shared, an mbarrier tracks it --
// One thread asks the copy engine for a whole contiguous block (any multiple of 16 bytes, both
// ends 16-byte aligned): one instruction, no registers, every byte in flight at once. The
// mbarrier in shared memory completes when its expected byte count has arrived. Only compiled for
// sm_90 and later; a kernel using them must not be launched on an older GPU (the host checks).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Initializes `bar` for `arrivals` arriving threads and makes that visible to the copy engine.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrives on `bar` and tells it to also wait for `bytes` bytes of asynchronous copies.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}

// Copies `bytes` from global `src` to shared `dst`; the bytes count towards `bar`.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   shared_address(dst)),
               "l"(src), "r"(bytes), "r"(shared_address(bar))
               : "memory");
}

// Blocks until phase `parity` of `bar` has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, unsigned parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred complete; mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2; selp.u32 %0, 1, 0, "
        "complete; }"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  }
}
#endif

__host__ __device__ __forceinline__ bool is_aligned(const void* p, int bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Starts bringing the line at `addr` into L1 and returns at once: a later load of it then costs an
// L1 hit instead of a round trip to L2. For read-only tables (weights) whose loads the compiler
// must keep behind earlier stores to x (it cannot prove they do not alias).
__device__ __forceinline__ void prefetch_l1(const void* addr) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(addr));
}

// ---- the RMSNorm arithmetic ------------------------------------------------------------------
// rstd = rsqrt(mean(x^2) + eps); 0 when that is 0 (eps = 0 and an all-zero row), so such a row
// normalizes to zeros rather than NaN; NaN when it is NaN or +Inf (a NaN or Inf in the row, or a
// sum of squares past float32's range), so the whole row comes out NaN rather than silently zero.
// rsqrtf already gives NaN for NaN; for +Inf it gives 0, and `denom - denom` (0 for every finite
// denom, NaN for +Inf) turns that into NaN: two additions, no extra branch or register.
__device__ __forceinline__ float rstd_from(float sum_sq, float width, float eps) {
  const float denom = sum_sq / width + eps;
  return denom == 0.f ? 0.f : rsqrtf(denom) + (denom - denom);
}

// The effective weight (w + weight_offset) in float32; in the Hugging Face order it is rounded to
// the activation dtype first.
template <typename T, bool kHfRounding>
__device__ __forceinline__ float effective_weight(float w, float weight_offset) {
  const float w_eff = w + weight_offset;
  return kHfRounding ? round_to<T>(w_eff) : w_eff;
}

// The normalized value as float32: x * rstd * w_eff unrounded (fused; the caller rounds once), or
// round(round(x * rstd) * w_eff) in the Hugging Face order.
template <typename T, bool kHfRounding>
__device__ __forceinline__ float normalized(float x, float rstd, float w_eff) {
  if constexpr (kHfRounding) {
    return round_to<T>(round_to<T>(x * rstd) * w_eff);
  } else {
    return x * rstd * w_eff;
  }
}

// The same rounded into the storage type (one rounding in the fused order).
template <typename T, bool kHfRounding>
__device__ __forceinline__ T normalize(float x, float rstd, float w_eff) {
  return from_float<T>(normalized<T, kHfRounding>(x, rstd, w_eff));
}

// Host: a kernel's resident blocks per SM times the SMs: the size of a persistent grid (and the
// most CTAs of a grid that run at once). Cached per device, per kernel and per block size in
// whole warps: the kernel is a template argument, so every kernel instantiation has its own
// cache (a cache per function-pointer *type* would be shared by every kernel of the same
// signature, whatever their occupancy). The occupancy query is not free on a hot path.
constexpr int kMaxDevices = 64;

template <auto kKernel>
inline int persistent_grid_limit(int threads_per_block) {
  static int cached[kMaxDevices][kMaxWarpsPerBlock + 1] = {};
  int device = 0;
  cudaGetDevice(&device);
  const int warps = (threads_per_block + kWarpSize - 1) / kWarpSize;
  const bool cacheable = device < kMaxDevices && warps <= kMaxWarpsPerBlock;
  if (cacheable && cached[device][warps] > 0) return cached[device][warps];
  int sms = 0, blocks_per_sm = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kKernel, threads_per_block, 0);
  const int limit = sms * (blocks_per_sm > 0 ? blocks_per_sm : 1);
  if (cacheable) cached[device][warps] = limit;
  return limit;
}

// ---- Division by a divisor fixed for the whole launch -----------------------------------------
// n / d for 32-bit n by one multiply-high, one add and one shift instead of the ~20 instructions
// of a 32-bit division (Granlund and Montgomery, "Division by invariant integers using
// multiplication", 1994). The host picks
//   shift = ceil(log2(d)),   magic = floor(2^32 * (2^shift - d) / d) + 1   (fits in 32 bits),
// so that (2^32 + magic) / 2^(32 + shift) is 1/d rounded up by less than 1/(d 2^32); then
//   n / d = (umulhi(n, magic) + n) >> shift   for every n < 2^32,
// with the add done in 64 bits so that it cannot wrap.
struct FastDivisor {
  uint32_t magic = 1;  // the default divides by 1
  uint32_t shift = 0;

  FastDivisor() = default;
  __host__ explicit FastDivisor(uint32_t divisor) {
    while ((uint64_t{1} << shift) < divisor) ++shift;
    magic = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << shift) - divisor) / divisor + 1);
  }
  __device__ __forceinline__ uint32_t divide(uint32_t n) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(__umulhi(n, magic)) + n) >> shift);
  }
};

// ---- Programmatic dependent launch (sm_90+) --------------------------------------------------
// A kernel launched with the programmatic-stream-serialization attribute may be launched while
// the previous kernel in the stream is still running: its CTAs become resident as SMs free up,
// so the launch gap between two kernels overlaps the first one's tail. Such a kernel starts with
// after_prior_grids(): griddepcontrol.wait holds each CTA, in hardware, until every grid it
// depends on has completed and its writes are visible (nothing may be read before it, since the
// previous kernel may be the one writing x); griddepcontrol.launch_dependents then lets the next
// programmatic launch in the stream start the same way. That launch's CTAs become resident only
// once every CTA of this grid has executed it or exited, so they never take an SM from this grid.
// Compiled for an older GPU both instructions vanish, and the host launches without the attribute.
__device__ __forceinline__ void after_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// warm_l2(address): what a kernel may do BEFORE after_prior_grids(). prefetch.global.L2 is only a
// hint: it brings the line holding `address` into L2 and returns nothing (no register, no L1
// line). L2 is the point every SM's loads and stores meet, so a store of the previous kernel
// that lands after the prefetch updates the line there, and a load issued after the wait still
// reads the latest value: warming cannot make a kernel read stale data, whichever kernel writes
// the line and whenever. What it buys is the DRAM round trip of data no kernel in flight writes
// (weights, rope tables), taken while the previous kernel still runs. `address` must lie inside
// an allocation the kernel may read.
__device__ __forceinline__ void warm_l2(const void* address) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(address));
#endif
}

// What one prefetch.global.L2 brings in: the cache line holding the address, 128 bytes in
// Hopper's L2, so a kernel warming a row asks once per line, not once per 16-byte vector
// (the tuned kernels that warm rows a wave of blocks ahead).
constexpr int kL2LineBytes = 128;
static_assert(kL2LineBytes % kVecBytes == 0, "a line is whole 16-byte vectors");

template <typename T>
constexpr int kL2LineElems = kL2LineBytes / static_cast<int>(sizeof(T));

// Host: whether the current GPU takes programmatic dependent launches (sm_90 and later).
inline bool programmatic_launch_supported() {
  static int cached[kMaxDevices] = {};  // 0: not queried yet, 1: no, 2: yes
  int device = 0;
  cudaGetDevice(&device);
  if (device >= kMaxDevices) return false;
  if (cached[device] == 0) {
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cached[device] = major >= 9 ? 2 : 1;
  }
  return cached[device] == 2;
}

// Host: launches `kernel` like <<<grid, block, shared_bytes, stream>>>, as a programmatic
// dependent launch when `programmatic` and the GPU takes one (the kernel must then begin with
// after_prior_grids). Under stream capture the attribute becomes a programmatic graph edge. A
// launch error is left for cudaGetLastError, as <<<>>> leaves it.
template <typename... KernelArgs, typename... Args>
inline void launch_kernel(bool programmatic, void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t shared_bytes,
                          cudaStream_t stream, Args... args) {
  if (!programmatic || !programmatic_launch_supported()) {
    kernel<<<grid, block, shared_bytes, stream>>>(args...);
    return;
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, kernel, args...);
}

}  // namespace cookbook
