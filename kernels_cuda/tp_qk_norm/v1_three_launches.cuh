// v1: three launches: a sum-of-squares kernel writes [T, 2] floats, NCCL all-reduces them, an apply kernel re-reads the shard and writes it
#pragma once

#include "cross_head_norm/rows.cuh"
#include "include/common.cuh"
#include "tp_qk_norm/params.h"

namespace cookbook::tp_qk_norm::v1 {

using cross_head_norm::kNumTensors;
using cross_head_norm::kQ;
using cross_head_norm::locate_row;
using cross_head_norm::Row;

// The NCCL all-reduce between the kernels is issued by the host (cookbook/cuda.py). This is
// the path backend="auto" takes where the ranks cannot reach each other's memory, so its kernels
// move bytes as cross_head_norm v3 does: a CTA per (token, tensor) row walks it in 16-byte
// vectors, kVecsPerStep per thread per step, every load of a step issued before any is used.
// Rows or weights that are not 16-byte aligned (odd offsets into a fused tensor, widths that
// are not whole vectors) take the element-wise kernels below, grid (tokens, 2).
constexpr int kThreads = 256;  // element-wise kernels
static_assert(kThreads % kWarpSize == 0 && kThreads <= kMaxWarpsPerBlock * kWarpSize,
              "whole warps, at most 1024 threads");

template <typename T>
__global__ void __launch_bounds__(kThreads) sum_sq_kernel(Params p, float* sum_sq) {
  const int tensor = static_cast<int>(blockIdx.y);
  const Row<T> r = locate_row<T>(p, blockIdx.x, tensor);
  float partial = 0.f;
  for (int d = threadIdx.x; d < r.hidden; d += kThreads) {
    const float x = to_float<T>(r.x[d]);
    partial += x * x;
  }
  partial = block_sum(partial);
  if (threadIdx.x == 0) sum_sq[static_cast<int64_t>(blockIdx.x) * kNumTensors + tensor] = partial;
}

template <typename T, bool kHfRounding>
__global__ void __launch_bounds__(kThreads) apply_kernel(ApplyParams a) {
  const int tensor = static_cast<int>(blockIdx.y);
  const Row<T> r = locate_row<T>(a.shard, blockIdx.x, tensor);
  const float full_width = tensor == kQ ? a.q_full_width : a.k_full_width;
  const float rstd = rstd_from(a.sum_sq[static_cast<int64_t>(blockIdx.x) * kNumTensors + tensor], full_width,
                               a.shard.eps);
  for (int d = threadIdx.x; d < r.hidden; d += kThreads) {  // the second read of the shard
    const float w = effective_weight<T, kHfRounding>(load_weight<T>(r.w, r.w_is_fp32, d), a.shard.weight_offset);
    r.x[d] = normalize<T, kHfRounding>(to_float<T>(r.x[d]), rstd, w);
  }
}

// The vector kernels. A step of a thread covers vectors first, first + kVecThreads, ... of
// its row (cross_head_norm's load_row_vectors); a CTA's step covers kVecsPerRowStep vectors:
// the MiniMax-M2 TP=2 shard's q row (3072 bf16, 384 vectors) in one step, its k row (64) in a
// quarter of one. kTokenMajor: grid.x walks (token, tensor) pairs, CTA 2t + tensor on token t's
// row, for q and k that are views of one tensor of token rows (cross_head_norm v9's grid: the
// rows in flight lie side by side); else grid (tokens, 2).
constexpr int kVecWarps = 4;
constexpr int kVecThreads = kVecWarps * kWarpSize;
constexpr int kVecsPerStep = 4;  // per thread: 4 x 16 bytes in flight, as v7's CTAs of cross_head_norm
constexpr int kVecsPerRowStep = kVecThreads * kVecsPerStep;
static_assert(cross_head_norm::valid_block_size<kVecThreads>, "vector kernels: whole warps, at most 1024 threads");

template <typename T, bool kTokenMajor>
__device__ __forceinline__ Row<T> locate_grid_row(const Params& p) {
  if constexpr (kTokenMajor) return locate_row<T>(p, blockIdx.x / kNumTensors, static_cast<int>(blockIdx.x % kNumTensors));
  return locate_row<T>(p, blockIdx.x, static_cast<int>(blockIdx.y));
}

template <bool kTokenMajor>
__device__ __forceinline__ int64_t grid_row_slot() {  // the CTA's row's slot in sum_sq [T][kNumTensors]
  if constexpr (kTokenMajor) return blockIdx.x;
  return static_cast<int64_t>(blockIdx.x) * kNumTensors + blockIdx.y;
}

// Default caching: at batches whose shard fits in L2 the apply kernel re-reads it from there.
template <typename T, bool kTokenMajor>
__global__ void __launch_bounds__(kVecThreads) sum_sq_vec_kernel(Params p, float* sum_sq) {
  const Row<T> r = locate_grid_row<T, kTokenMajor>(p);
  const int num_vecs = r.hidden / Vec<T>::kElems;
  float partial = 0.f;
  for (int first = threadIdx.x; first < num_vecs; first += kVecsPerRowStep) {
    Vec<T> x[kVecsPerStep];
    partial += cross_head_norm::load_row_vectors<T, kVecsPerStep, false>(r, first, kVecThreads, x);
  }
  partial = block_sum(partial);
  if (threadIdx.x == 0) sum_sq[grid_row_slot<kTokenMajor>()] = partial;
}

// Streaming accesses: the apply kernel is the shard's last touch.
template <typename T, bool kHfRounding, bool kTokenMajor>
__global__ void __launch_bounds__(kVecThreads) apply_vec_kernel(ApplyParams a) {
  const Row<T> r = locate_grid_row<T, kTokenMajor>(a.shard);
  const int tensor = kTokenMajor ? static_cast<int>(blockIdx.x % kNumTensors) : static_cast<int>(blockIdx.y);
  const float full_width = tensor == kQ ? a.q_full_width : a.k_full_width;
  const float rstd = rstd_from(a.sum_sq[grid_row_slot<kTokenMajor>()], full_width, a.shard.eps);
  const int num_vecs = r.hidden / Vec<T>::kElems;
  for (int first = threadIdx.x; first < num_vecs; first += kVecsPerRowStep) {
    Vec<T> x[kVecsPerStep];
    cross_head_norm::load_row_vectors<T, kVecsPerStep, true>(r, first, kVecThreads, x);  // the sum is not needed here
    cross_head_norm::store_row_vectors<T, kVecsPerStep, kHfRounding, true>(r, first, kVecThreads, x, rstd, a.shard.weight_offset);
  }
}

// Both kernels of a call take the vector path or neither (the same rows; the sum kernel's Params
// carry no weights, which count as aligned), on the same grid.
template <typename T>
inline bool vector_path(const Params& p) {
  return cross_head_norm::vector_aligned<T>(p);
}

// The (token, tensor) grid where q and k share a token stride wider than either row (views of one
// tensor of token rows) and grid.x has room for every row.
inline bool token_major_grid(const Params& p) {
  constexpr int64_t kMaxGridX = 2147483647;  // 2^31 - 1 CTAs along grid.x
  const bool share_token_stride =
      p.q_token_stride == p.k_token_stride && (p.q_token_stride > p.q_hidden || p.k_token_stride > p.k_hidden);
  return share_token_stride && p.num_tokens * kNumTensors <= kMaxGridX;
}

inline dim3 vec_grid(const Params& p, bool token_major) {
  if (token_major) return dim3(static_cast<unsigned>(p.num_tokens * kNumTensors));
  return dim3(static_cast<unsigned>(p.num_tokens), kNumTensors);
}

template <typename T>
inline void launch_sum_sq_kernel(const Params& p, float* sum_sq, cudaStream_t stream) {
  if (vector_path<T>(p)) {
    const bool token_major = token_major_grid(p);
    const auto kernel = token_major ? sum_sq_vec_kernel<T, true> : sum_sq_vec_kernel<T, false>;
    kernel<<<vec_grid(p, token_major), kVecThreads, 0, stream>>>(p, sum_sq);
    return;
  }
  sum_sq_kernel<T><<<dim3(static_cast<unsigned>(p.num_tokens), kNumTensors), kThreads, 0, stream>>>(p, sum_sq);
}

template <typename T, bool kHfRounding>
inline void launch_apply_kernel(const ApplyParams& a, cudaStream_t stream) {
  if (vector_path<T>(a.shard)) {
    const bool token_major = token_major_grid(a.shard);
    const auto kernel = token_major ? apply_vec_kernel<T, kHfRounding, true> : apply_vec_kernel<T, kHfRounding, false>;
    kernel<<<vec_grid(a.shard, token_major), kVecThreads, 0, stream>>>(a);
    return;
  }
  apply_kernel<T, kHfRounding><<<dim3(static_cast<unsigned>(a.shard.num_tokens), kNumTensors), kThreads, 0, stream>>>(a);
}

template <DType kDType>
cudaError_t launch_sum_sq(const Params& p, float* sum_sq, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  launch_sum_sq_kernel<Storage<kDType>>(p, sum_sq, stream);
  return cudaGetLastError();
}

template <DType kDType, Rounding kRounding>
cudaError_t launch_apply(const ApplyParams& a, cudaStream_t stream) {
  if (a.shard.num_tokens == 0) return cudaSuccess;
  launch_apply_kernel<Storage<kDType>, kRounding == Rounding::kHf>(a, stream);
  return cudaGetLastError();
}

}  // namespace cookbook::tp_qk_norm::v1
