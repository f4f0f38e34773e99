// What every cross_head_norm kernel shares: where a token's q row or k row lives, a thread's share
// of a row as 16-byte vectors held in registers (loaded and summed, then normalized and stored),
// the weights' loads, and the host's checks of a call. The kernels themselves live one per file
// (v1_*.cuh ... v7_*.cuh, tuned.cuh), each readable alone.
#pragma once

#include "cross_head_norm/params.h"
#include "cross_head_norm/vectors.h"
#include "include/common.cuh"

namespace cookbook::cross_head_norm {

// Which of a token's rows a CTA normalizes: an index into rung 1's two sums, blockIdx.y from rung 2 on.
constexpr int kQ = 0;
constexpr int kK = 1;
constexpr int kNumTensors = 2;

// One token's row of q or k: where it lives, its length and its weight.
template <typename T>
struct Row {
  T* x;
  int hidden;
  const void* w;
  bool w_is_fp32;
};

template <typename T>
__device__ __forceinline__ Row<T> locate_row(const Params& p, int64_t token, int tensor) {
  if (tensor == kQ) return {static_cast<T*>(p.q) + token * p.q_token_stride, p.q_hidden, p.q_weight, p.q_weight_is_fp32};
  return {static_cast<T*>(p.k) + token * p.k_token_stride, p.k_hidden, p.k_weight, p.k_weight_is_fp32};
}

// The block sums (block_sum in include/common.cuh) require whole warps and at most 1024 threads.
template <int kThreads>
constexpr bool valid_block_size = kThreads % kWarpSize == 0 && kThreads <= kMaxWarpsPerBlock * kWarpSize;
static_assert(valid_block_size<kMaxThreads>, "a row's largest block is whole warps, at most 1024 threads");

// kVecElems consecutive effective weights (w + weight_offset, float32) from column `col`: 16-byte
// loads, so the weight must be 16-byte aligned (the host checks it).
template <typename T, bool kHfRounding>
__device__ __forceinline__ void load_weight_vec(const void* w, bool w_is_fp32, int col, float weight_offset,
                                                float (&w_eff)[Vec<T>::kElems]) {
  constexpr int kVecElems = Vec<T>::kElems;
  constexpr int kFloatVecsPerVec = kVecElems / Vec<float>::kElems;  // a float32 weight vector: 1 or 2 loads
  static_assert(kVecElems % Vec<float>::kElems == 0, "a float32 weight slice is whole 16-byte vectors");
  if (w_is_fp32) {
#pragma unroll
    for (int v = 0; v < kFloatVecsPerVec; ++v) {
      const Vec<float> f = load_vec<float>(static_cast<const float*>(w) + col + v * Vec<float>::kElems);
#pragma unroll
      for (int j = 0; j < Vec<float>::kElems; ++j) w_eff[v * Vec<float>::kElems + j] = f.v[j];
    }
  } else {
    unpack<T>(load_vec<T>(static_cast<const T*>(w) + col), w_eff);
  }
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) w_eff[j] = effective_weight<T, kHfRounding>(w_eff[j], weight_offset);
}

// One thread's share of a row held in registers: vectors first, first + stride, ... (kVecs slots;
// those past the row's end stay unused, so the narrower tensor leaves threads idle). A CTA's
// threads stride by the block, a warp's lanes (rung 7) by the warp. kStreaming: evict-first loads.
// Returns the thread's sum of squares.
template <typename T, int kVecs, bool kStreaming>
__device__ __forceinline__ float load_row_vectors(const Row<T>& r, int first, int stride, Vec<T> (&x)[kVecs]) {
  constexpr int kVecElems = Vec<T>::kElems;
  const int num_vecs = r.hidden / kVecElems;
  float sum_sq = 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int vec = first + i * stride;
    if (vec < num_vecs) {
      x[i] = load_x<T, kStreaming>(r.x + vec * kVecElems);
      float xf[kVecElems];
      unpack<T>(x[i], xf);
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) sum_sq += xf[j] * xf[j];
    }
  }
  return sum_sq;
}

// The same vectors normalized with the row's rstd and weight (loaded here), written back in place.
template <typename T, int kVecs, bool kHfRounding, bool kStreaming>
__device__ __forceinline__ void store_row_vectors(const Row<T>& r, int first, int stride, const Vec<T> (&x)[kVecs],
                                                  float rstd, float weight_offset) {
  constexpr int kVecElems = Vec<T>::kElems;
  const int num_vecs = r.hidden / kVecElems;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int vec = first + i * stride;
    if (vec < num_vecs) {
      float xf[kVecElems], w[kVecElems], y[kVecElems];
      unpack<T>(x[i], xf);
      load_weight_vec<T, kHfRounding>(r.w, r.w_is_fp32, vec * kVecElems, weight_offset, w);
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) y[j] = normalized<T, kHfRounding>(xf[j], rstd, w[j]);
      store_x<T, kStreaming>(r.x + vec * kVecElems, pack<T>(y));
    }
  }
}

// A 16-byte vector's weights as loaded, not yet converted, so that a batch of loads can be issued
// before the first conversion waits on one (rung 6 and the tuned kernel; tp_qk_norm's kernels).
// float32 weights fill every word; activation-type weights only words[0].
template <typename T>
struct RawWeights {
  static constexpr int kFloatVecs = Vec<T>::kElems / Vec<float>::kElems;
  uint4 words[kFloatVecs];
};

template <typename T>
__device__ __forceinline__ RawWeights<T> load_raw_weights(const Row<T>& r, int col) {
  RawWeights<T> raw;
  if (r.w_is_fp32) {
#pragma unroll
    for (int v = 0; v < RawWeights<T>::kFloatVecs; ++v) {
      raw.words[v] = *reinterpret_cast<const uint4*>(static_cast<const float*>(r.w) + col + v * Vec<float>::kElems);
    }
  } else {
    raw.words[0] = *reinterpret_cast<const uint4*>(static_cast<const T*>(r.w) + col);
  }
  return raw;
}

template <typename T, bool kHfRounding>
__device__ __forceinline__ void effective_weights(const RawWeights<T>& raw, bool w_is_fp32, float weight_offset,
                                                  float (&w)[Vec<T>::kElems]) {
  if (w_is_fp32) {
#pragma unroll
    for (int v = 0; v < RawWeights<T>::kFloatVecs; ++v) {
      const Vec<float>& f = *reinterpret_cast<const Vec<float>*>(&raw.words[v]);
#pragma unroll
      for (int j = 0; j < Vec<float>::kElems; ++j) w[v * Vec<float>::kElems + j] = f.v[j];
    }
  } else {
    unpack<T>(*reinterpret_cast<const Vec<T>*>(&raw.words[0]), w);
  }
#pragma unroll
  for (int j = 0; j < Vec<T>::kElems; ++j) w[j] = effective_weight<T, kHfRounding>(w[j], weight_offset);
}

// A thread's weight vectors for the same slots as load_row_vectors, each load issued before any is used.
template <typename T, int kVecs>
__device__ __forceinline__ void load_row_weights(const Row<T>& r, int first, int stride, RawWeights<T> (&w)[kVecs]) {
  const int num_vecs = r.hidden / Vec<T>::kElems;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int vec = first + i * stride;
    if (vec < num_vecs) w[i] = load_raw_weights<T>(r, vec * Vec<T>::kElems);
  }
}

// store_row_vectors with the weights already in registers (load_row_weights).
template <typename T, int kVecs, bool kHfRounding, bool kStreaming>
__device__ __forceinline__ void store_row_vectors_held(const Row<T>& r, int first, int stride, const Vec<T> (&x)[kVecs],
                                                       const RawWeights<T> (&w_raw)[kVecs], float rstd,
                                                       float weight_offset) {
  constexpr int kVecElems = Vec<T>::kElems;
  const int num_vecs = r.hidden / kVecElems;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int vec = first + i * stride;
    if (vec < num_vecs) {
      float xf[kVecElems], w[kVecElems], y[kVecElems];
      unpack<T>(x[i], xf);
      effective_weights<T, kHfRounding>(w_raw[i], r.w_is_fp32, weight_offset, w);
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) y[j] = normalized<T, kHfRounding>(xf[j], rstd, w[j]);
      store_x<T, kStreaming>(r.x + vec * kVecElems, pack<T>(y));
    }
  }
}

// ---- host ------------------------------------------------------------------------------------
// The (tokens, 2) grid of rungs 2-6: blockIdx.x the token, blockIdx.y the tensor (kQ, kK).
inline dim3 token_tensor_grid(const Params& p) { return dim3(static_cast<unsigned>(p.num_tokens), kNumTensors); }

inline int widest_hidden(const Params& p) { return p.q_hidden > p.k_hidden ? p.q_hidden : p.k_hidden; }

// Whether every row starts on a 16-byte boundary and is whole vectors (rows_are_vectors), and both
// weights too (vector_aligned): what the 16-byte paths need.
template <typename T>
inline bool rows_are_vectors(const Params& p) {
  constexpr int kVecElems = Vec<T>::kElems;
  return is_aligned(p.q, kVecBytes) && is_aligned(p.k, kVecBytes) && p.q_token_stride % kVecElems == 0 &&
         p.k_token_stride % kVecElems == 0 && p.q_hidden % kVecElems == 0 && p.k_hidden % kVecElems == 0;
}

inline bool weights_are_vectors(const Params& p) {
  return is_aligned(p.q_weight, kVecBytes) && is_aligned(p.k_weight, kVecBytes);
}

template <typename T>
inline bool vector_aligned(const Params& p) {
  return rows_are_vectors<T>(p) && weights_are_vectors(p);
}

// Calls launch.template operator()<kVecs>() for `vecs` in 1, 2, 4, 8 (each a kernel compiled with
// that many vector slots per thread); returns whether it was one of them.
template <typename Launch>
inline bool with_vecs_per_thread(int vecs, Launch&& launch) {
  const auto one = [&]<int kVecs>() { return vecs == kVecs ? (launch.template operator()<kVecs>(), true) : false; };
  return one.template operator()<1>() || one.template operator()<2>() || one.template operator()<4>() ||
         one.template operator()<8>();
}
static_assert(kMaxVecsPerThread == 8, "with_vecs_per_thread compiles 1, 2, 4 and 8 vectors per thread");

}  // namespace cookbook::cross_head_norm
