// What every qk_norm_rope kernel shares: where a (token, head) row lives, its token's cache row,
// the rotation's arithmetic, how lanes split a row into 16-byte vectors (one per lane, or the two
// vectors of a rotation pair per lane), the tables' loads, and the host's compile-time dispatch.
// The kernels themselves live one per file (v1_*.cuh ... v7_*.cuh, tuned.cuh), each readable alone.
#pragma once

#include <cmath>

#include "include/common.cuh"
#include "qk_norm_rope/params.h"

namespace cookbook::qk_norm_rope {

// One (token, head) row: its first element and its weight (q's or k's).
template <typename T>
struct Row {
  T* x = nullptr;
  const void* w = nullptr;
};

// The row of `token`, `head` (heads below num_q_heads are q's, the rest k's). Offsets are 64-bit.
template <typename T>
__device__ __forceinline__ Row<T> row_at(const Params& p, int64_t token, int head) {
  if (head < p.num_q_heads) {
    return {static_cast<T*>(p.q) + token * p.q_token_stride + head * p.q_head_stride, p.q_weight};
  }
  const int kv_head = head - p.num_q_heads;
  return {static_cast<T*>(p.k) + token * p.k_token_stride + kv_head * p.k_head_stride, p.k_weight};
}

// ---- the rotation ----------------------------------------------------------------------------
// The cache row of `token`, or -1 when positions[token] + position_offset is out of range.
__device__ __forceinline__ int64_t cache_row(const Params& p, int64_t token) {
  const int64_t position = p.positions_are_int64 ? static_cast<const int64_t*>(p.positions)[token]
                                                 : static_cast<const int32_t*>(p.positions)[token];
  const int64_t row = position + p.position_offset;
  return row >= 0 && row < p.max_position ? row : -1;
}

// cos_i and sin_i of cache row `row`, one element each (NaN for row -1: an out-of-range position
// reads nothing). In the Hugging Face order they are rounded to the activation dtype first.
template <typename T, bool kHfRounding>
__device__ __forceinline__ void load_cos_sin(const Params& p, int64_t row, int pair, float& cos, float& sin) {
  if (row < 0) {
    cos = sin = NAN;
    return;
  }
  const int64_t base = row * p.rope_dim;
  cos = load_weight<T>(p.cos_sin_cache, p.cache_is_fp32, base + pair);  // same storage rule as a weight
  sin = load_weight<T>(p.cos_sin_cache, p.cache_is_fp32, base + p.rope_dim / 2 + pair);
  if constexpr (kHfRounding) {
    cos = round_to<T>(cos);
    sin = round_to<T>(sin);
  }
}

// Where dim d < rope_dim sits in the rotation: its pair, whether it is the pair's first member a
// (a' = a cos - b sin) or its second b (b' = b cos + a sin), and its partner's dim.
struct PairSlot {
  int pair;
  bool is_first;
  int partner;
};

__device__ __forceinline__ PairSlot pair_slot(int d, int rope_dim, bool is_neox) {
  const int half = rope_dim / 2;
  if (is_neox) return d < half ? PairSlot{d, true, d + half} : PairSlot{d - half, false, d - half};
  return PairSlot{d / 2, d % 2 == 0, d ^ 1};
}

// The rotated value of `n` given its partner; HF order: every product and the sum rounded to T.
template <typename T, bool kHfRounding>
__device__ __forceinline__ float rotated(float n, float partner, bool is_first, float cos, float sin) {
  const float signed_sin = is_first ? -sin : sin;
  if constexpr (kHfRounding) {
    return round_to<T>(round_to<T>(n * cos) + round_to<T>(partner * signed_sin));
  } else {
    return n * cos + partner * signed_sin;
  }
}

// ---- lanes and vectors -----------------------------------------------------------------------
// One 16-byte vector per lane slot (rung 3): a row of kHeadDim elements of T is kVecsPerRow
// vectors, spread over kLanes lanes (one per vector, at most a warp), each holding kVecsPerLane.
// Slot i of lane l is vector i * kLanes + l, so one load instruction of the group reads
// contiguous memory.
template <typename T, int kHeadDim>
struct VectorLanes {
  static constexpr int kVecElems = Vec<T>::kElems;  // 4 fp32, 8 fp16/bf16
  static constexpr int kVecsPerRow = kHeadDim / kVecElems;
  static constexpr int kLanes = kVecsPerRow < kWarpSize ? kVecsPerRow : kWarpSize;
  static constexpr int kVecsPerLane = kVecsPerRow / kLanes;

  static_assert(kHeadDim % kVecElems == 0, "a row is a whole number of 16-byte vectors");
  static_assert(kVecsPerRow % kLanes == 0, "every lane of a row holds as many vectors");
  static_assert(kWarpSize % kLanes == 0, "lane groups tile a warp, so a group's shuffles never span two warps");
  static_assert(kVecElems % 2 == 0, "an interleaved pair never straddles two vectors");

  __device__ static int vector(int lane, int i) { return i * kLanes + lane; }
};

// The two vectors of a rotation pair per lane (rung 4 on): a row's vectors grouped in units of
// two. With h = rope_dim / 2 / kVecElems, unit u < h is NeoX vectors (u, u + h), which hold the a
// and b members of the same kVecElems pairs, or interleaved vectors (2u, 2u + 1), whose pairs sit
// inside each vector; either way the unit's pairs are u * kVecElems ... + kVecElems - 1, one run of
// cos and one of sin. Units u >= h pass through: two neighbouring vectors (2u, 2u + 1). A row is
// kUnitsPerRow units over kLanes lanes (at most a warp), lane l holding units l, l + kLanes, ...
template <typename T, int kHeadDim>
struct PairLanes {
  static constexpr int kVecElems = Vec<T>::kElems;  // 4 fp32, 8 fp16/bf16
  static constexpr int kVecsPerRow = kHeadDim / kVecElems;
  static constexpr int kUnitsPerRow = kVecsPerRow / 2;
  static constexpr int kLanes = kUnitsPerRow < kWarpSize ? kUnitsPerRow : kWarpSize;
  static constexpr int kUnitsPerLane = kUnitsPerRow / kLanes;

  static_assert(kHeadDim % (2 * kVecElems) == 0, "a row is a whole number of two-vector units");
  static_assert(kUnitsPerRow % kLanes == 0, "every lane of a row holds as many units");
  static_assert(kWarpSize % kLanes == 0, "lane groups tile a warp, so a group's shuffles never span two warps");
  static_assert(kVecElems % 2 == 0, "an interleaved pair never straddles two vectors");
};

// The units a lane owns, fixed for a whole row walk: index, whether they rotate, their columns.
template <int kUnits>
struct LaneUnits {
  int unit[kUnits], col_a[kUnits], col_b[kUnits];
  bool rotates[kUnits];
};

template <int kUnits, int kVecElems>
__device__ __forceinline__ LaneUnits<kUnits> lane_units(int lane, int lanes, int rope_dim, bool is_neox) {
  const int rotated_units = rope_dim / 2 / kVecElems;
  LaneUnits<kUnits> u;
#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    const int unit = s * lanes + lane;
    u.unit[s] = unit;
    u.rotates[s] = unit < rotated_units;
    const bool halves = is_neox && u.rotates[s];  // NeoX pair: (u, u + h); otherwise neighbours
    u.col_a[s] = (halves ? unit : 2 * unit) * kVecElems;
    u.col_b[s] = (halves ? unit + rotated_units : 2 * unit + 1) * kVecElems;
  }
  return u;
}

// A vector of zeros: what an idle lane group sums (it still joins its group's shuffles).
template <typename T>
__device__ __forceinline__ Vec<T> zero_vec() {
  Vec<T> out;
#pragma unroll
  for (int j = 0; j < Vec<T>::kElems; ++j) out.v[j] = from_float<T>(0.f);
  return out;
}

// ---- the tables: weights and the cos/sin cache ------------------------------------------------
// N contiguous elements of storage type S as float32, in aligned loads of up to 16 bytes. `src`
// must be aligned to the load size, min(N * sizeof(S), 16) bytes.
template <typename S, int N>
__device__ __forceinline__ void load_floats(const S* src, float (&out)[N]) {
  constexpr int kMaxChunk = kVecBytes / static_cast<int>(sizeof(S));
  constexpr int kChunk = N < kMaxChunk ? N : kMaxChunk;
  static_assert(N % kChunk == 0, "N is a whole number of loads");
  struct alignas(kChunk * sizeof(S)) Chunk {
    S v[kChunk];
  };
  const Chunk* chunks = reinterpret_cast<const Chunk*>(src);
#pragma unroll
  for (int c = 0; c < N / kChunk; ++c) {
    const Chunk chunk = chunks[c];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) out[c * kChunk + j] = to_float<S>(chunk.v[j]);
  }
}

// The same from a table stored in the activation dtype T or in float32 (a flag of the call).
template <typename T, int N>
__device__ __forceinline__ void load_floats(const void* base, bool is_fp32, int64_t offset, float (&out)[N]) {
  if (is_fp32) {
    load_floats<float, N>(static_cast<const float*>(base) + offset, out);
  } else {
    load_floats<T, N>(static_cast<const T*>(base) + offset, out);
  }
}

// cos and sin of the kPairs pairs from `first_pair` on, in cache row `row`, as float32: NaN for row
// -1 (out of range, nothing read); rounded to T first in the Hugging Face order.
template <typename T, int kPairs, bool kHfRounding>
__device__ __forceinline__ void load_cos_sin_run(const Params& p, int64_t row, int first_pair, float (&cos)[kPairs],
                                                 float (&sin)[kPairs]) {
  if (row < 0) {
#pragma unroll
    for (int j = 0; j < kPairs; ++j) cos[j] = sin[j] = NAN;
    return;
  }
  const int64_t cos_at = row * p.rope_dim + first_pair;
  load_floats<T, kPairs>(p.cos_sin_cache, p.cache_is_fp32, cos_at, cos);
  load_floats<T, kPairs>(p.cos_sin_cache, p.cache_is_fp32, cos_at + p.rope_dim / 2, sin);
  if constexpr (kHfRounding) {
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      cos[j] = round_to<T>(cos[j]);
      sin[j] = round_to<T>(sin[j]);
    }
  }
}

// N consecutive elements of a table stored as S (float32 or the activation dtype, known at
// compile time) from `offset`, as float32: whole 16-byte read-only loads.
template <typename S, int N>
__device__ __forceinline__ void load_table(const void* table, int64_t offset, float (&out)[N]) {
  constexpr int kElems = Vec<S>::kElems;
  static_assert(N % kElems == 0, "a run is whole 16-byte vectors");
  const S* src = static_cast<const S*>(table) + offset;
#pragma unroll
  for (int c = 0; c < N / kElems; ++c) {
    float part[kElems];
    unpack<S>(load_vec_readonly<S>(src + c * kElems), part);
#pragma unroll
    for (int j = 0; j < kElems; ++j) out[c * kElems + j] = part[j];
  }
}

// The cos_i and sin_i of unit `unit`'s kVecElems pairs in cache row `cache`, from a cache stored as
// CacheT: NaN for an out-of-range position (-1, nothing read), rounded to T first in the Hugging
// Face order.
template <typename T, bool kHfRounding, typename CacheT, int kVecElems>
__device__ __forceinline__ void unit_cos_sin(const Params& p, int64_t cache, int unit, float (&cos)[kVecElems],
                                             float (&sin)[kVecElems]) {
  if (cache < 0) {
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) cos[j] = sin[j] = NAN;
    return;
  }
  const int64_t cos_at = cache * p.rope_dim + unit * kVecElems;
  load_table<CacheT, kVecElems>(p.cos_sin_cache, cos_at, cos);
  load_table<CacheT, kVecElems>(p.cos_sin_cache, cos_at + p.rope_dim / 2, sin);
  if constexpr (kHfRounding) {
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) {
      cos[j] = round_to<T>(cos[j]);
      sin[j] = round_to<T>(sin[j]);
    }
  }
}

// ---- host ------------------------------------------------------------------------------------
// Whether the call can take the vector path: every row of q and k starts on a 16-byte boundary,
// rope_dim is a whole number of two-vector units (so a vector is wholly rotated or wholly passed
// through, and a NeoX partner vector lies a whole number of vectors away), and the tables (both
// weights and the cache) start on 16-byte boundaries, so that they are read in vectors too.
template <typename T>
inline bool vector_path_ok(const Params& p) {
  constexpr int kVecElems = Vec<T>::kElems;
  const bool rows_ok = is_aligned(p.q, kVecBytes) && is_aligned(p.k, kVecBytes) && p.q_token_stride % kVecElems == 0 &&
                       p.q_head_stride % kVecElems == 0 && p.k_token_stride % kVecElems == 0 &&
                       p.k_head_stride % kVecElems == 0 && p.rope_dim % (2 * kVecElems) == 0;
  const bool tables_ok = is_aligned(p.q_weight, kVecBytes) && is_aligned(p.k_weight, kVecBytes) &&
                         is_aligned(p.cos_sin_cache, kVecBytes);
  return rows_ok && tables_ok;
}

// Calls launch.template operator()<kHeadDim>() if `head_dim` is one of kHeadDims (each compiled
// as its own kernel, its row held in registers); returns whether it was.
template <int... kHeadDims, typename Launch>
inline bool with_head_dim(int head_dim, Launch&& launch) {
  return ((head_dim == kHeadDims ? (launch.template operator()<kHeadDims>(), true) : false) || ...);
}

// The rungs' vector kernels are compiled for the head_dims of the models that run this op (64,
// 128, 256); any other even head_dim runs rung 2's warp per row.
template <typename Launch>
inline bool with_vector_head_dim(int head_dim, Launch&& launch) {
  return with_head_dim<64, 128, 256>(head_dim, static_cast<Launch&&>(launch));
}

}  // namespace cookbook::qk_norm_rope
