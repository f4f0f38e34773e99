// qk_norm: per-head RMSNorm of q and k, in place, both tensors in one launch.
//
//   per (token, head) row x of length head_dim, float32 accumulation:
//   y = x * rsqrt(mean(x^2) + eps) * (w + weight_offset)
//
// Rows are numbered token-major: row r is token r / (Hq + Hk), head r % (Hq + Hk); heads below Hq
// are q, the rest k. Neighbouring rows are neighbouring memory in a fused qkv tensor.
//
// Versions (cookbook/registry.py is the list; tests/test_cuda_sources.py keeps these lines and
// the registry's leads identical):
// v1: one thread per (token, head) row, the naive port: a warp's loads are head_dim elements apart (uncoalesced)
// v2: one warp per (token, head) with a shuffle reduction: lanes read neighbouring elements (coalesced) - removes v1's scattered loads
// v3: 16-byte vectors held in registers, lanes sized to the head, q and k on a persistent grid with the weights loaded once per thread - removes v2's second read and narrow loads
// v4: at least two 16-byte loads in flight per lane: small heads take two rows per iteration, loaded before either is reduced - removes v3's one-load-at-a-time latency
//
// Torch-free: raw pointers and element strides (64-bit). bindings/qk_norm.cu is the torch glue.
#pragma once

#include "include/common.cuh"

namespace cookbook::qk_norm {

struct Params {
  void* q;                 // [T, Hq, D], element strides below, last dim contiguous
  void* k;                 // [T, Hk, D]
  const void* q_weight;    // [D], activation dtype or float32
  const void* k_weight;    // [D]
  bool weight_is_fp32;
  int64_t num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  int64_t q_token_stride, q_head_stride;  // in elements
  int64_t k_token_stride, k_head_stride;
  float eps;
  float weight_offset;
};

// One (token, head) row: where it lives and which weight it uses.
template <typename T>
struct Row {
  T* x;
  const void* w;
  bool is_q;
};

template <typename T>
__device__ __forceinline__ Row<T> locate_row(const Params& p, int64_t row) {
  const int heads = p.num_q_heads + p.num_kv_heads;
  const int64_t token = row / heads;
  const int head = static_cast<int>(row - token * heads);
  if (head < p.num_q_heads) {
    return {static_cast<T*>(p.q) + token * p.q_token_stride + head * p.q_head_stride, p.q_weight, true};
  }
  const int kv_head = head - p.num_q_heads;
  return {static_cast<T*>(p.k) + token * p.k_token_stride + kv_head * p.k_head_stride, p.k_weight, false};
}

inline int64_t total_rows(const Params& p) {
  return p.num_tokens * (p.num_q_heads + p.num_kv_heads);
}

// ------------------------------------------------------------------------------------------
// v1: one thread per (token, head) row, the naive port: a warp's loads are head_dim elements apart (uncoalesced)
// grid.x: ceil(rows / kV1Threads); thread -> row. Two passes over the row (sum, then write).
// ------------------------------------------------------------------------------------------
constexpr int kV1Threads = 256;

template <typename T, bool kHfRounding>
__global__ void __launch_bounds__(kV1Threads) qk_norm_v1_kernel(Params p, int64_t rows) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (row >= rows) return;  // no barrier or shuffle below: an early exit is safe
  const Row<T> r = locate_row<T>(p, row);
  float sum_sq = 0.f;
  for (int d = 0; d < p.head_dim; ++d) {
    const float x = to_float<T>(r.x[d]);
    sum_sq += x * x;
  }
  const float rstd = rstd_from(sum_sq, static_cast<float>(p.head_dim), p.eps);
  for (int d = 0; d < p.head_dim; ++d) {
    const float w = effective_weight<T, kHfRounding>(load_weight<T>(r.w, p.weight_is_fp32, d), p.weight_offset);
    r.x[d] = normalize<T, kHfRounding>(to_float<T>(r.x[d]), rstd, w);
  }
}

// ------------------------------------------------------------------------------------------
// v2: one warp per (token, head) with a shuffle reduction: lanes read neighbouring elements (coalesced) - removes v1's scattered loads
// grid.x: ceil(rows / kV2WarpsPerBlock); warp -> row, lane -> elements lane, lane + 32, ...
// Works for any head_dim and alignment: it is also v3's general path.
// ------------------------------------------------------------------------------------------
constexpr int kV2WarpsPerBlock = 8;
constexpr int kV2Threads = kV2WarpsPerBlock * kWarpSize;

template <typename T, bool kHfRounding>
__global__ void __launch_bounds__(kV2Threads) qk_norm_v2_kernel(Params p, int64_t rows) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kV2WarpsPerBlock) + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= rows) return;  // uniform per warp: the shuffles below always see a full warp
  const Row<T> r = locate_row<T>(p, row);
  float sum_sq = 0.f;
  for (int d = lane; d < p.head_dim; d += kWarpSize) {
    const float x = to_float<T>(r.x[d]);
    sum_sq += x * x;
  }
  const float rstd = rstd_from(warp_sum(sum_sq), static_cast<float>(p.head_dim), p.eps);
  for (int d = lane; d < p.head_dim; d += kWarpSize) {  // second read: served by L1/L2
    const float w = effective_weight<T, kHfRounding>(load_weight<T>(r.w, p.weight_is_fp32, d), p.weight_offset);
    r.x[d] = normalize<T, kHfRounding>(to_float<T>(r.x[d]), rstd, w);
  }
}

// ------------------------------------------------------------------------------------------
// v3: 16-byte vectors held in registers, lanes sized to the head, q and k on a persistent grid with the weights loaded once per thread - removes v2's second read and narrow loads
// A group of kThreadsPerHead lanes owns one row; each lane holds kVecsPerThread 16-byte vectors
// of it in registers, so x is read once and written once. grid.x: min(row groups, resident
// blocks); blocks stride over rows, and since a lane always covers the same columns, its slice
// of both weights is loaded once, before the loop.
// ------------------------------------------------------------------------------------------
template <typename T, int kHeadDim>
struct V3Traits {
  static constexpr int kVecElems = Vec<T>::kElems;                    // 4 fp32, 8 fp16/bf16
  static constexpr int kVecsPerHead = kHeadDim / kVecElems;
  static constexpr int kThreadsPerHead = kVecsPerHead < kWarpSize ? kVecsPerHead : kWarpSize;
  static constexpr int kVecsPerThread = kVecsPerHead / kThreadsPerHead;
  static constexpr int kElemsPerThread = kVecsPerThread * kVecElems;
  static constexpr int kThreadsPerBlock = 256;
  static constexpr int kHeadsPerBlock = kThreadsPerBlock / kThreadsPerHead;

  static_assert(kHeadDim % kVecElems == 0, "a head is a whole number of 16-byte vectors");
  static_assert(kVecsPerHead % kThreadsPerHead == 0, "every lane of a head holds as many vectors");
  static_assert(kWarpSize % kThreadsPerHead == 0, "heads tile a warp, so a shuffle group never spans two warps");
  static_assert(kThreadsPerBlock % kWarpSize == 0, "whole warps per block");
};

// kRowsInFlight rows per lane group and loop iteration: all their vectors are loaded before any
// is reduced (v3: 1; v4: kV4RowsInFlight).
template <typename T, int kHeadDim, int kRowsInFlight, bool kHfRounding>
__global__ void __launch_bounds__(V3Traits<T, kHeadDim>::kThreadsPerBlock)
    qk_norm_vec_kernel(Params p, int64_t rows) {
  using Tr = V3Traits<T, kHeadDim>;
  static_assert(kRowsInFlight >= 1, "at least one row per iteration");
  const int lane = threadIdx.x % Tr::kThreadsPerHead;  // lane within its head group
  const int head_in_block = threadIdx.x / Tr::kThreadsPerHead;

  // Column of element j of vector i of this lane: vectors interleave across the group's lanes
  // so that one load instruction of the group covers contiguous memory.
  auto column = [&](int i, int j) { return (i * Tr::kThreadsPerHead + lane) * Tr::kVecElems + j; };

  float w_q[Tr::kElemsPerThread], w_k[Tr::kElemsPerThread];
#pragma unroll
  for (int i = 0; i < Tr::kVecsPerThread; ++i) {
#pragma unroll
    for (int j = 0; j < Tr::kVecElems; ++j) {
      const int e = i * Tr::kVecElems + j;
      w_q[e] = effective_weight<T, kHfRounding>(load_weight<T>(p.q_weight, p.weight_is_fp32, column(i, j)), p.weight_offset);
      w_k[e] = effective_weight<T, kHfRounding>(load_weight<T>(p.k_weight, p.weight_is_fp32, column(i, j)), p.weight_offset);
    }
  }

  // `first` is uniform across the block, so every lane runs the same iterations and the group
  // shuffles never miss a lane; rows past the end compute on zeros and store nothing.
  constexpr int kRowsPerBlockIter = kRowsInFlight * Tr::kHeadsPerBlock;
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * kRowsPerBlockIter;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kRowsPerBlockIter; first < rows; first += row_stride) {
    Row<T> r[kRowsInFlight];
    bool active[kRowsInFlight];
    Vec<T> x[kRowsInFlight][Tr::kVecsPerThread];
#pragma unroll
    for (int k = 0; k < kRowsInFlight; ++k) {
      const int64_t row = first + k * Tr::kHeadsPerBlock + head_in_block;
      active[k] = row < rows;
      r[k] = active[k] ? locate_row<T>(p, row) : Row<T>{nullptr, nullptr, false};
#pragma unroll
      for (int i = 0; i < Tr::kVecsPerThread; ++i) {
        if (active[k]) {
          x[k][i] = load_vec<T>(r[k].x + column(i, 0));
        } else {
#pragma unroll
          for (int j = 0; j < Tr::kVecElems; ++j) x[k][i].v[j] = from_float<T>(0.f);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kRowsInFlight; ++k) {
      float sum_sq = 0.f;
#pragma unroll
      for (int i = 0; i < Tr::kVecsPerThread; ++i) {
#pragma unroll
        for (int j = 0; j < Tr::kVecElems; ++j) {
          const float xf = to_float<T>(x[k][i].v[j]);
          sum_sq += xf * xf;
        }
      }
      const float rstd = rstd_from(warp_sum<Tr::kThreadsPerHead>(sum_sq), static_cast<float>(kHeadDim), p.eps);
      if (active[k]) {
#pragma unroll
        for (int i = 0; i < Tr::kVecsPerThread; ++i) {
          Vec<T> y;
#pragma unroll
          for (int j = 0; j < Tr::kVecElems; ++j) {
            const int e = i * Tr::kVecElems + j;
            y.v[j] = normalize<T, kHfRounding>(to_float<T>(x[k][i].v[j]), rstd, r[k].is_q ? w_q[e] : w_k[e]);
          }
          store_vec<T>(r[k].x + column(i, 0), y);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// v4: at least two 16-byte loads in flight per lane: small heads take two rows per iteration, loaded before either is reduced - removes v3's one-load-at-a-time latency
// Same kernel as v3. Keeping 4 TB/s busy takes bandwidth x DRAM latency in flight: tens of KiB
// per SM. With one 16-byte vector per lane (head_dim <= 256 in 16-bit types), v3 has one load
// per lane outstanding and its 38 registers allow 6 blocks of 256 threads: 24 KiB per SM. v4
// loads two rows first (48 registers, 5 blocks): 40 KiB per SM. Heads of 2+ vectors per lane
// already have two loads in flight and keep one row per iteration (and their registers).
// ------------------------------------------------------------------------------------------
constexpr int kV3LoadsInFlight = 1;
constexpr int kV4LoadsInFlight = 2;

template <typename T, int kHeadDim, int kLoadsInFlight>
constexpr int rows_in_flight() {
  constexpr int kVecs = V3Traits<T, kHeadDim>::kVecsPerThread;
  return kVecs >= kLoadsInFlight ? 1 : (kLoadsInFlight + kVecs - 1) / kVecs;
}

// ------------------------------------------------------------------------------------------
// Launchers (host). `launch` is what the binding calls.
// ------------------------------------------------------------------------------------------
template <typename T, bool kHfRounding>
inline void launch_v1(const Params& p, int64_t rows, cudaStream_t stream) {
  const int64_t blocks = (rows + kV1Threads - 1) / kV1Threads;
  qk_norm_v1_kernel<T, kHfRounding><<<static_cast<unsigned>(blocks), kV1Threads, 0, stream>>>(p, rows);
}

template <typename T, bool kHfRounding>
inline void launch_v2(const Params& p, int64_t rows, cudaStream_t stream) {
  const int64_t blocks = (rows + kV2WarpsPerBlock - 1) / kV2WarpsPerBlock;
  qk_norm_v2_kernel<T, kHfRounding><<<static_cast<unsigned>(blocks), kV2Threads, 0, stream>>>(p, rows);
}

template <typename T, int kHeadDim, int kLoadsInFlight, bool kHfRounding>
inline void launch_vec_fixed(const Params& p, int64_t rows, cudaStream_t stream) {
  using Tr = V3Traits<T, kHeadDim>;
  constexpr int kRowsInFlight = rows_in_flight<T, kHeadDim, kLoadsInFlight>();
  const auto kernel = qk_norm_vec_kernel<T, kHeadDim, kRowsInFlight, kHfRounding>;
  constexpr int64_t kRowsPerBlockIter = kRowsInFlight * Tr::kHeadsPerBlock;
  const int64_t needed = (rows + kRowsPerBlockIter - 1) / kRowsPerBlockIter;
  const int64_t resident = persistent_grid_limit(kernel, Tr::kThreadsPerBlock);
  const int64_t blocks = needed < resident ? needed : resident;
  kernel<<<static_cast<unsigned>(blocks), Tr::kThreadsPerBlock, 0, stream>>>(p, rows);
}

// The 16-byte path needs both tensors' rows to start on 16-byte boundaries.
template <typename T>
inline bool vector_aligned(const Params& p) {
  constexpr int kVecElems = Vec<T>::kElems;
  return is_aligned(p.q, kVecBytes) && is_aligned(p.k, kVecBytes) && p.q_token_stride % kVecElems == 0 &&
         p.q_head_stride % kVecElems == 0 && p.k_token_stride % kVecElems == 0 && p.k_head_stride % kVecElems == 0;
}

// v3 (one load in flight per lane) and v4 (two): fast head_dims on aligned rows, else the general path.
template <typename T, int kLoadsInFlight, bool kHfRounding>
inline void launch_vec(const Params& p, int64_t rows, cudaStream_t stream) {
  if (vector_aligned<T>(p)) {
    switch (p.head_dim) {
      case 64: return launch_vec_fixed<T, 64, kLoadsInFlight, kHfRounding>(p, rows, stream);
      case 128: return launch_vec_fixed<T, 128, kLoadsInFlight, kHfRounding>(p, rows, stream);
      case 256: return launch_vec_fixed<T, 256, kLoadsInFlight, kHfRounding>(p, rows, stream);
      case 512: return launch_vec_fixed<T, 512, kLoadsInFlight, kHfRounding>(p, rows, stream);
      case 1024: return launch_vec_fixed<T, 1024, kLoadsInFlight, kHfRounding>(p, rows, stream);
      default: break;
    }
  }
  launch_v2<T, kHfRounding>(p, rows, stream);  // general path: any even head_dim, any alignment
}

template <typename T, bool kHfRounding>
inline void launch_version(const Params& p, int version, cudaStream_t stream) {
  const int64_t rows = total_rows(p);
  switch (version) {
    case 1: return launch_v1<T, kHfRounding>(p, rows, stream);
    case 2: return launch_v2<T, kHfRounding>(p, rows, stream);
    case 3: return launch_vec<T, kV3LoadsInFlight, kHfRounding>(p, rows, stream);
    default: return launch_vec<T, kV4LoadsInFlight, kHfRounding>(p, rows, stream);
  }
}

template <typename T>
inline void launch_rounding(const Params& p, bool hf_rounding, int version, cudaStream_t stream) {
  if (hf_rounding) {
    launch_version<T, true>(p, version, stream);
  } else {
    launch_version<T, false>(p, version, stream);
  }
}

constexpr int kNumVersions = 4;

// Launches version `version` (1..kNumVersions) on `stream`; returns the launch error, if any.
inline cudaError_t launch(const Params& p, DType dtype, bool hf_rounding, int version, cudaStream_t stream) {
  if (version < 1 || version > kNumVersions) return cudaErrorInvalidValue;
  if (total_rows(p) == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: launch_rounding<float>(p, hf_rounding, version, stream); break;
    case DType::kFloat16: launch_rounding<__half>(p, hf_rounding, version, stream); break;
    case DType::kBFloat16: launch_rounding<__nv_bfloat16>(p, hf_rounding, version, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm
