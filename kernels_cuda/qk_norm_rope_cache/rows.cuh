// What every qk_norm_rope_cache kernel shares on top of qk_norm_rope's rows.cuh (its lanes, the
// rotation, the tables' loads, used as they are): a token's slot, where a slot's row lives in a
// paged cache, what an FP8 cache stores, the norm and rotation of one two-vector unit, and the
// host's compile-time dispatch. The kernels live one per file (v1_*.cuh ... v3_*.cuh, tuned.cuh).
#pragma once

#include <cuda_fp8.h>

#include <cstring>
#include <type_traits>

#include "qk_norm_rope/rows.cuh"
#include "qk_norm_rope_cache/params.h"

namespace cookbook::qk_norm_rope_cache {

using qk_norm_rope::LaneUnits;
using qk_norm_rope::PairLanes;
using qk_norm_rope::lane_units;
using qk_norm_rope::load_table;
using qk_norm_rope::rotated;
using qk_norm_rope::unit_cos_sin;
using qk_norm_rope::zero_vec;

// ---- slots and cache rows --------------------------------------------------------------------
// The slot of `token`, or -1 where it writes nothing (slot -1, or a slot out of range: no kernel
// ever writes outside the cache).
__device__ __forceinline__ int64_t slot_of(const Params& p, int64_t token) {
  const int64_t slot = p.slots_are_int64 ? static_cast<const int64_t*>(p.slot_mapping)[token]
                                         : static_cast<const int32_t*>(p.slot_mapping)[token];
  return slot >= 0 && slot < p.num_slots ? slot : -1;
}

// A cache element: the activation dtype T, or the byte of an e4m3 value.
template <typename T, CacheDtype kCache>
using CacheElem = std::conditional_t<kCache == CacheDtype::kFp8E4m3, __nv_fp8_storage_t, T>;

// The first element of kv head `head`'s row at `slot` (>= 0) of cache `c`. Offsets are 64-bit.
template <typename C>
__device__ __forceinline__ C* cache_row(const Cache& c, int64_t slot, int64_t block_size, int head) {
  const int64_t block = slot / block_size;
  const int64_t at = slot - block * block_size;
  return static_cast<C*>(c.data) + block * c.block_stride + at * c.slot_stride + head * c.head_stride;
}

// The scale an FP8 cache divides by (1 for a cache in the activation dtype: never read).
template <CacheDtype kCache>
__device__ __forceinline__ float cache_scale(const Cache& c) {
  if constexpr (kCache == CacheDtype::kFp8E4m3) {
    return __ldg(c.scale);
  } else {
    return 1.f;
  }
}

// An FP8 cache's scale as the tuned kernel divides by it, with no division per element: with
// |scale| = m * 2^e, m in [0.5, 1) (frexpf), x / scale = (x * to_unit) / unit, where
// unit = |scale| * 2^(1 - e) = 2m lies in [1, 2) and to_unit = sign(scale) * 2^(1 - e) is a power of
// two (x * to_unit is exact, or so large or small that the e4m3 byte is the same); a quotient by
// a unit is x times its inverse, corrected by one fused multiply-add (Markstein's correction): the
// correctly rounded float32 quotient (tests: every bf16 and fp16 x against the division, at scales
// across float32's range).
struct InverseScale {
  float to_unit;  // sign(scale) * 2^(1 - e)
  float unit;     // |scale| * 2^(1 - e), in [1, 2) (under 1 for a subnormal scale, 0 for a zero one, 1 for an infinite one)
  float inverse;  // 1 / unit, correctly rounded
};
constexpr int kMinUnitExponent = -125;  // 2^(1 - e) at most 2^126, a normal float

// The scale an FP8 store divides by: with its inverse (InverseScale) where kByInverse, else the
// scale itself (a division). Both are 1 for a cache of the activation dtype (never read).
template <bool kByInverse, CacheDtype kCache>
__device__ __forceinline__ auto store_scale(const Cache& c) {
  const float scale = cache_scale<kCache>(c);
  if constexpr (kByInverse) {
    if (isinf(scale)) return InverseScale{copysignf(0.f, scale), 1.f, 1.f};  // x / inf: a signed zero (NaN for x infinite)
    int e = 0;
    frexpf(scale, &e);
    e = max(e, kMinUnitExponent);  // a subnormal scale: 2^(1 - e) stays finite, its unit under 1
    const float unit = ldexpf(fabsf(scale), 1 - e);
    return InverseScale{copysignf(ldexpf(1.f, 1 - e), scale), unit, 1.f / unit};
  } else {
    return scale;
  }
}
// A row with no slot's store_scale: never read, so not loaded.
template <bool kByInverse>
__device__ __forceinline__ auto no_store_scale() {
  if constexpr (kByInverse) {
    return InverseScale{1.f, 1.f, 1.f};
  } else {
    return 1.f;
  }
}

// x / scale: a division, or the corrected product.
__device__ __forceinline__ float divide(float x, float scale) { return x / scale; }
__device__ __forceinline__ float divide(float x, const InverseScale& s) {
  const float x_unit = __fmul_rn(x, s.to_unit);     // exact (or past e4m3's range either way)
  const float q = __fmul_rn(x_unit, s.inverse);     // within about an ulp of x / scale
  const float r = __fmaf_rn(q, s.unit, -x_unit);    // its residual, q * unit - x_unit
  const float q1 = __fmaf_rn(-r, s.inverse, q);     // x / scale, correctly rounded
  return isinf(q) ? q : q1;  // x infinite, or the quotient past float32: saturated as it is
}

// What the cache stores for x (already rounded to T: the value k or v holds): x itself, or
// float(x) / scale (correctly rounded: a division, or the corrected product of InverseScale)
// saturated to +-448 and rounded to the nearest e4m3 (ties to even), as torch's
// (x / scale).clamp(-448, 448).to(float8_e4m3fn).
template <typename T, CacheDtype kCache, typename Scale>
__device__ __forceinline__ CacheElem<T, kCache> cache_element(float x, const Scale& scale) {
  if constexpr (kCache == CacheDtype::kFp8E4m3) {
    return __nv_cvt_float_to_fp8(divide(x, scale), __NV_SATFINITE, __NV_E4M3);
  } else {
    return from_float<T>(x);
  }
}

// An unsigned word of kBytes bytes: one store of kBytes FP8 elements.
template <int kBytes>
struct WordOf;
template <>
struct WordOf<4> { using type = unsigned int; };
template <>
struct WordOf<8> { using type = uint2; };
template <>
struct WordOf<16> { using type = uint4; };

// kVecs contiguous vectors of the row (as packed for x: rounded to T) stored at `dst` in the
// cache's dtype: kVecs 16-byte stores, or, FP8, one store of kVecs * kElems bytes. The default
// cache policy (evict-first stores were slower at decode: the page's tried-and-dropped table).
template <typename T, CacheDtype kCache, int kVecs, typename Scale>
__device__ __forceinline__ void store_cache(CacheElem<T, kCache>* dst, const Vec<T> (&x)[kVecs], const Scale& scale) {
  if constexpr (kCache == CacheDtype::kActivation) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) store_vec<T>(dst + i * Vec<T>::kElems, x[i]);
  } else {
    constexpr int kBytes = kVecs * Vec<T>::kElems;
    using Word = typename WordOf<kBytes>::type;
    __nv_fp8_storage_t bytes[kBytes];
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      float f[Vec<T>::kElems];
      unpack<T>(x[i], f);
#pragma unroll
      for (int j = 0; j < Vec<T>::kElems; ++j) bytes[i * Vec<T>::kElems + j] = cache_element<T, kCache>(f[j], scale);
    }
    Word word;
    memcpy(&word, bytes, kBytes);  // register moves
    *reinterpret_cast<Word*>(dst) = word;
  }
}

// ---- one two-vector unit of a q or k row: normalize, then rotate or pass through ---------------
// xa, xb: the unit's vectors (PairLanes in qk_norm_rope/rows.cuh) as float32; wa, wb their
// weights; cos, sin the unit's kVecElems pairs (read only where it rotates). Out: ya, yb, float32.
template <typename T, bool kHf, bool kNeox, int kVecElems>
__device__ __forceinline__ void norm_rope_unit(const float (&xa)[kVecElems], const float (&xb)[kVecElems],
                                               const float (&wa)[kVecElems], const float (&wb)[kVecElems],
                                               const float (&cos)[kVecElems], const float (&sin)[kVecElems],
                                               bool rotates, float rstd, float weight_offset, float (&ya)[kVecElems],
                                               float (&yb)[kVecElems]) {
  float na[kVecElems], nb[kVecElems];
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) {
    na[j] = normalized<T, kHf>(xa[j], rstd, effective_weight<T, kHf>(wa[j], weight_offset));
    nb[j] = normalized<T, kHf>(xb[j], rstd, effective_weight<T, kHf>(wb[j], weight_offset));
  }
  if (!rotates) {
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) {
      ya[j] = na[j];
      yb[j] = nb[j];
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) {
    if constexpr (kNeox) {  // a = na[j], b = nb[j]: pair j
      ya[j] = rotated<T, kHf>(na[j], nb[j], true, cos[j], sin[j]);
      yb[j] = rotated<T, kHf>(nb[j], na[j], false, cos[j], sin[j]);
    } else {  // pairs (j, j ^ 1) inside each vector: pair j / 2 of a, kVecElems / 2 + j / 2 of b
      const bool is_first = j % 2 == 0;
      const int pair_a = j / 2, pair_b = kVecElems / 2 + j / 2;
      ya[j] = rotated<T, kHf>(na[j], na[j ^ 1], is_first, cos[pair_a], sin[pair_a]);
      yb[j] = rotated<T, kHf>(nb[j], nb[j ^ 1], is_first, cos[pair_b], sin[pair_b]);
    }
  }
}

// ---- host ------------------------------------------------------------------------------------
// Whether a cache's rows can take whole two-vector units: its start on a 16-byte boundary and
// every stride a whole number of units (the FP8 unit of a bf16 row: 16 elements, 16 bytes).
template <typename T>
inline bool cache_is_vectors(const Cache& c) {
  constexpr int64_t kUnitElems = 2 * Vec<T>::kElems;
  return is_aligned(c.data, kVecBytes) && c.block_stride % kUnitElems == 0 && c.slot_stride % kUnitElems == 0 &&
         c.head_stride % kUnitElems == 0;
}

// qk_norm_rope's vector path (q, k, the tables), and v and both caches in whole vectors.
template <typename T>
inline bool vector_path_ok(const Params& p) {
  constexpr int kVecElems = Vec<T>::kElems;
  const bool v_ok = is_aligned(p.v, kVecBytes) && p.v_token_stride % kVecElems == 0 && p.v_head_stride % kVecElems == 0;
  return qk_norm_rope::vector_path_ok<T>(p.rope) && v_ok && cache_is_vectors<T>(p.k_cache) &&
         cache_is_vectors<T>(p.v_cache);
}

// Calls launch.template operator()<kCache>() for the call's cache dtype: the FP8 path is its own
// kernel, so a cache in the activation dtype carries no conversion.
template <typename Launch>
inline void with_cache_dtype(const Params& p, Launch&& launch) {
  if (p.cache_dtype == CacheDtype::kFp8E4m3) return launch.template operator()<CacheDtype::kFp8E4m3>();
  launch.template operator()<CacheDtype::kActivation>();
}

// Calls launch.template operator()<kNeox, WeightT, CosSinT>() for the call's rope layout and the
// tables' storage (the weights', the cos/sin table's: T or float32).
template <typename T, typename Launch>
inline void with_tables(const Params& p, Launch&& launch) {
  const auto with_cos_sin = [&]<bool kNeox, typename WeightT>() {
    if (p.rope.cache_is_fp32) return launch.template operator()<kNeox, WeightT, float>();
    launch.template operator()<kNeox, WeightT, T>();
  };
  const auto with_weights = [&]<bool kNeox>() {
    if (p.rope.weight_is_fp32) return with_cos_sin.template operator()<kNeox, float>();
    with_cos_sin.template operator()<kNeox, T>();
  };
  if (p.rope.is_neox) return with_weights.template operator()<true>();
  with_weights.template operator()<false>();
}

}  // namespace cookbook::qk_norm_rope_cache
