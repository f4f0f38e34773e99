// The tuned kernel's path for rows wider than a CTA's registers hold (kMaxThreads threads of
// kMaxVecsPerThread vectors: 32768 bf16 elements, 16384 float32): the row staged in shared memory
// by one bulk asynchronous copy (Hopper's copy engine: one instruction, tracked by an mbarrier),
// then reduced and written from there.
//
// grid (tokens, 2), kStagedThreads threads. Thread 0 arms an mbarrier with the row's byte count and
// issues one cp.async.bulk of the whole row into dynamic shared memory; every thread waits on the
// mbarrier, sums its vectors' squares from shared memory (block_sum), then normalizes them and
// stores to global. The registers hold no row, so the block size does not follow the width, and
// the bytes in flight per SM are the rows of its resident CTAs. Needs sm_90 and the row within the
// per-CTA shared memory opt-in limit (staged_row_bytes); the policy runs rung 2's strided kernel
// otherwise. Narrower rows lose here: the copy and the barrier wait sit on each CTA's critical path
// before any arithmetic, where registers hold the row with every load in flight.
#pragma once

#include "cross_head_norm/policy.h"
#include "cross_head_norm/rows.cuh"

namespace cookbook::cross_head_norm::tuned {

static_assert(valid_block_size<kStagedThreads>, "block_sum: whole warps, at most 1024 threads");

template <typename T, Rounding kRounding>
__global__ void __launch_bounds__(kStagedThreads) cross_head_norm_staged_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // the host launches it on sm_90 and later only
#else
  constexpr bool kHf = kRounding == Rounding::kHf;
  constexpr int kVecElems = Vec<T>::kElems;
  after_prior_grids();  // read nothing before the previous kernel's writes are visible
  extern __shared__ __align__(kVecBytes) unsigned char staged_bytes[];  // the row, launch-sized
  __shared__ __align__(8) uint64_t row_arrived;                         // mbarrier
  const Vec<T>* staged = reinterpret_cast<const Vec<T>*>(staged_bytes);
  const Row<T> r = locate_row<T>(p, blockIdx.x, static_cast<int>(blockIdx.y));
  const int num_vecs = r.hidden / kVecElems;

  if (threadIdx.x == 0) mbarrier_init(&row_arrived, 1);
  __syncthreads();  // the barrier is initialized before anyone waits on it
  if (threadIdx.x == 0) {
    const unsigned row_bytes = static_cast<unsigned>(r.hidden) * sizeof(T);
    mbarrier_arrive_expect_bytes(&row_arrived, row_bytes);
    bulk_copy_to_shared(staged_bytes, r.x, row_bytes, &row_arrived);
  }
  mbarrier_wait(&row_arrived, 0);  // single use: phase 0

  float sum_sq = 0.f;
  for (int vec = threadIdx.x; vec < num_vecs; vec += kStagedThreads) {
    float x[kVecElems];
    unpack<T>(staged[vec], x);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) sum_sq += x[j] * x[j];
  }
  const float rstd = rstd_from(block_sum(sum_sq), static_cast<float>(r.hidden), p.eps);
  for (int vec = threadIdx.x; vec < num_vecs; vec += kStagedThreads) {
    float x[kVecElems], w[kVecElems], y[kVecElems];
    unpack<T>(staged[vec], x);
    load_weight_vec<T, kHf>(r.w, r.w_is_fp32, vec * kVecElems, p.weight_offset, w);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) y[j] = normalized<T, kHf>(x[j], rstd, w[j]);
    store_x<T, /*kStreaming=*/true>(r.x + vec * kVecElems, pack<T>(y));
  }
#endif
}

// The widest row, in bytes, the staged kernel's dynamic shared memory takes on the current GPU:
// its per-CTA opt-in limit (227 KiB on H100/H200) less the kernel's static shared memory, which
// the kernel is allowed once per device; 0 before sm_90 (no bulk copies) or where it is refused.
template <typename T, Rounding kRounding>
inline int64_t staged_row_bytes() {
  constexpr auto kernel = cross_head_norm_staged_kernel<T, kRounding>;
  static int64_t cached[kMaxDevices] = {};  // per device: 0 = not asked yet, -1 = none here
  int device = 0;
  cudaGetDevice(&device);
  if (device >= kMaxDevices) return 0;
  if (cached[device] == 0) {
    int major = 0, optin = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    cudaFuncAttributes attributes{};
    cudaFuncGetAttributes(&attributes, kernel);
    const int dynamic = optin - static_cast<int>(attributes.sharedSizeBytes);
    const bool usable = major >= 9 && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic) == cudaSuccess;
    cached[device] = usable ? dynamic : -1;
  }
  return cached[device] > 0 ? cached[device] : 0;
}

}  // namespace cookbook::cross_head_norm::tuned
