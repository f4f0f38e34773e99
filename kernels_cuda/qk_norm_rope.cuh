// qk_norm_rope: per-head RMSNorm of q and k, then rotary embedding, in place, one pass.
//
//   per (token, head) row x of length head_dim, float32 accumulation:
//   n  = x * rsqrt(mean(x^2) + eps) * (w + weight_offset)              (qk_norm's math)
//   for pair i < rope_dim / 2, dims (a, b) = (i, i + rope_dim/2) NeoX, or (2i, 2i + 1) interleaved:
//   a' = a * cos_i - b * sin_i,   b' = b * cos_i + a * sin_i           (dims >= rope_dim pass through)
//   cos_i, sin_i: row p = positions[token] + position_offset of cos_sin_cache [max_position, rope_dim]
//   (cos | sin); an out-of-range p reads nothing and gives cos = sin = NaN (cookbook/ops/qk_norm_rope.py).
//
// Rows are numbered token-major as in qk_norm.cuh: row r is token r / (Hq + Hk), head r % (Hq + Hk).
//
// Versions (cookbook/registry.py is the list; tests/test_cuda_sources.py keeps these lines and
// the registry's leads identical):
// v1: the unfused pair engines started from: a warp-per-row norm kernel writes float32 rows, then a separate rope kernel rotates them (two launches, an extra round trip through memory)
// v2: fused, one warp per (token, head): norm and rope in one launch, each lane owns whole (a, b) pairs so no partner exchange is needed - removes v1's second launch and round trip
// v3: 16-byte vectors held in registers, lanes sized to the head, the NeoX partner fetched by a warp shuffle, cos/sin read once per token and reused across its heads, persistent grid - removes v2's second read, narrow loads and per-head cache reads
// v4: lanes own whole rotation pairs: a NeoX lane holds a 16-byte vector of the first half and its partner vector of the second half, so one run of cos/sin serves both and no shuffle fetches a partner; a lane keeps one row at a time - removes v3's partner shuffles, half its cos/sin loads and the registers it spends keeping a token's cos/sin and both weights across heads (79 -> 64: 4 blocks per SM instead of 3)
// v5: the layout and the tables' storage types fixed at compile time (the kernel picks its loop once), bf16 converted two elements per instruction, the norm scale one fma per element, x read and written by streaming global accesses - removes v4's per-element layout selects, its predicated loads for both table dtypes and its generic loads and stores (64 -> 57 registers NeoX, 48 interleaved)
// v6: v5 as a programmatic dependent launch (as tp_qk_norm v5): its CTAs become resident while the previous kernel finishes and wait in hardware (griddepcontrol) for its writes - removes the launch gap between back-to-back kernels from each call
// v7: v6 with no division on the device: where the call's rows fit in one trip of the grid (decode), one row per lane group, its token found by a multiply-high; otherwise v6's walk, its steps in tokens and heads computed by the launcher - removes the two calls into the 64-bit division routine every lane made before its first load (0.4 us of a decode call)
// v8: v7 with the decode kernel's tables warmed before the wait: while the previous kernel still runs, the weights and each token's position and cos/sin run (aimed by a speculative L2-only read of the position) are prefetched into L2, each by one lane group; after the wait a lane reads its row's tables into registers together with the row - removes the position -> cos/sin chain of DRAM round trips (and the weights' own) from a decode call's critical path
// v9: v8 with the walk's weights held: at prefill the grid is cut to whole tokens per step, so each lane group keeps one head for its whole walk and reads its columns of that head's weight once, before the walk, into registers - removes the two weight loads, and their wait, that v5-v8's walk issued for every row after its sum
//
// Torch-free: raw pointers and element strides (64-bit). bindings/qk_norm_rope.cu is the torch glue.
#pragma once

#include <cmath>
#include <numeric>

#include "include/common.cuh"

namespace cookbook::qk_norm_rope {

struct Params {
  void* q;                      // [T, Hq, D], element strides below, last dim contiguous
  void* k;                      // [T, Hk, D]
  const void* q_weight;         // [D], activation dtype or float32
  const void* k_weight;         // [D]
  bool weight_is_fp32;
  const void* cos_sin_cache;    // [max_position, rope_dim], contiguous, activation dtype or float32
  bool cache_is_fp32;
  int64_t max_position;
  const void* positions;        // [T], int32 or int64
  bool positions_are_int64;
  int64_t position_offset;
  float* scratch;               // v1 only: float32 [T, Hq + Hk, D] between its two kernels
  int64_t num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  int rope_dim;
  bool is_neox;
  int64_t q_token_stride, q_head_stride;  // in elements
  int64_t k_token_stride, k_head_stride;
  float eps;
  float weight_offset;
  FastDivisor heads_divisor;  // num_q_heads + num_kv_heads, for v7 (`launch` sets it)
  int64_t token_step;         // v7: the grid's rows per step as whole tokens and heads (the launcher sets them)
  int head_step;
};

inline int64_t total_rows(const Params& p) { return p.num_tokens * (p.num_q_heads + p.num_kv_heads); }

// Float32 elements of v1's scratch (0 for the fused versions).
inline int64_t scratch_elements(const Params& p, int version) {
  return version == 1 ? total_rows(p) * p.head_dim : 0;
}

template <typename T>
struct Row {
  T* x;
  const void* w;
};

template <typename T>
__device__ __forceinline__ Row<T> locate_row(const Params& p, int64_t token, int head) {
  if (head < p.num_q_heads) {
    return {static_cast<T*>(p.q) + token * p.q_token_stride + head * p.q_head_stride, p.q_weight};
  }
  const int kv_head = head - p.num_q_heads;
  return {static_cast<T*>(p.k) + token * p.k_token_stride + kv_head * p.k_head_stride, p.k_weight};
}

// ---- the rope arithmetic ---------------------------------------------------------------------
// The cache row of `token`, or -1 when positions[token] + position_offset is out of range.
__device__ __forceinline__ int64_t cache_row(const Params& p, int64_t token) {
  const int64_t position = p.positions_are_int64 ? static_cast<const int64_t*>(p.positions)[token]
                                                 : static_cast<const int32_t*>(p.positions)[token];
  const int64_t row = position + p.position_offset;
  return row >= 0 && row < p.max_position ? row : -1;
}

// cos_i and sin_i of cache row `row` (NaN for row -1: an out-of-range position reads nothing).
// In the Hugging Face order they are rounded to the activation dtype first.
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

// Where dim d < rope_dim sits in the rotation: its pair index, whether it is the pair's first
// member a (a' = a cos - b sin) or its second b (b' = b cos + a sin), and its partner's dim.
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

// ------------------------------------------------------------------------------------------
// v1: the unfused pair engines started from: a warp-per-row norm kernel writes float32 rows, then a separate rope kernel rotates them (two launches, an extra round trip through memory)
// Kernel 1 (norm): grid.x: ceil(rows / kV1WarpsPerBlock); warp -> row; writes n to scratch in
// float32 (a dtype-rounded intermediate would add a rounding the fused contract does not allow).
// Kernel 2 (rope): grid.x: ceil(rows * D / kV1RopeThreads); thread -> one output element.
// ------------------------------------------------------------------------------------------
constexpr int kV1WarpsPerBlock = 8;
constexpr int kV1NormThreads = kV1WarpsPerBlock * kWarpSize;
constexpr int kV1RopeThreads = 256;

template <typename T, bool kHfRounding>
__global__ void __launch_bounds__(kV1NormThreads) qk_norm_rope_v1_norm_kernel(Params p, int64_t rows) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kV1WarpsPerBlock) + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= rows) return;  // uniform per warp: the shuffles below always see a full warp
  const int heads = p.num_q_heads + p.num_kv_heads;
  const Row<T> r = locate_row<T>(p, row / heads, static_cast<int>(row % heads));
  float sum_sq = 0.f;
  for (int d = lane; d < p.head_dim; d += kWarpSize) {
    const float x = to_float<T>(r.x[d]);
    sum_sq += x * x;
  }
  const float rstd = rstd_from(warp_sum(sum_sq), static_cast<float>(p.head_dim), p.eps);
  float* n = p.scratch + row * p.head_dim;
  for (int d = lane; d < p.head_dim; d += kWarpSize) {
    const float w = effective_weight<T, kHfRounding>(load_weight<T>(r.w, p.weight_is_fp32, d), p.weight_offset);
    n[d] = normalized<T, kHfRounding>(to_float<T>(r.x[d]), rstd, w);
  }
}

template <typename T, bool kHfRounding>
__global__ void __launch_bounds__(kV1RopeThreads) qk_norm_rope_v1_rope_kernel(Params p, int64_t elements) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= elements) return;  // no barrier or shuffle below
  const int64_t row = e / p.head_dim;
  const int d = static_cast<int>(e - row * p.head_dim);
  const int heads = p.num_q_heads + p.num_kv_heads;
  const int64_t token = row / heads;
  const Row<T> r = locate_row<T>(p, token, static_cast<int>(row % heads));
  const float* n = p.scratch + row * p.head_dim;
  float y = n[d];
  if (d < p.rope_dim) {
    const PairSlot s = pair_slot(d, p.rope_dim, p.is_neox);
    float cos, sin;
    load_cos_sin<T, kHfRounding>(p, cache_row(p, token), s.pair, cos, sin);
    y = rotated<T, kHfRounding>(y, n[s.partner], s.is_first, cos, sin);
  }
  r.x[d] = from_float<T>(y);
}

// ------------------------------------------------------------------------------------------
// v2: fused, one warp per (token, head): norm and rope in one launch, each lane owns whole (a, b) pairs so no partner exchange is needed - removes v1's second launch and round trip
// grid.x: ceil(rows / kV2WarpsPerBlock); warp -> row. Pass 1: lane-strided sum of squares.
// Pass 2: lane -> pairs lane, lane + 32, ...: it reads both members (NeoX: both halves, each
// coalesced across the warp), normalizes, rotates and writes both; then the pass-through dims.
// Works for any even head_dim and rope_dim and any alignment: it is also v3's general path.
// ------------------------------------------------------------------------------------------
constexpr int kV2WarpsPerBlock = 8;
constexpr int kV2Threads = kV2WarpsPerBlock * kWarpSize;

template <typename T, bool kHfRounding>
__global__ void __launch_bounds__(kV2Threads) qk_norm_rope_v2_kernel(Params p, int64_t rows) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kV2WarpsPerBlock) + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= rows) return;  // uniform per warp
  const int heads = p.num_q_heads + p.num_kv_heads;
  const int64_t token = row / heads;
  const Row<T> r = locate_row<T>(p, token, static_cast<int>(row % heads));
  float sum_sq = 0.f;
  for (int d = lane; d < p.head_dim; d += kWarpSize) {
    const float x = to_float<T>(r.x[d]);
    sum_sq += x * x;
  }
  const float rstd = rstd_from(warp_sum(sum_sq), static_cast<float>(p.head_dim), p.eps);
  auto norm_at = [&](int d) {  // second read: served by L1/L2
    const float w = effective_weight<T, kHfRounding>(load_weight<T>(r.w, p.weight_is_fp32, d), p.weight_offset);
    return normalized<T, kHfRounding>(to_float<T>(r.x[d]), rstd, w);
  };
  const int64_t cache = cache_row(p, token);
  for (int pair = lane; pair < p.rope_dim / 2; pair += kWarpSize) {
    const int a_dim = p.is_neox ? pair : 2 * pair;
    const int b_dim = pair_slot(a_dim, p.rope_dim, p.is_neox).partner;
    const float a = norm_at(a_dim), b = norm_at(b_dim);
    float cos, sin;
    load_cos_sin<T, kHfRounding>(p, cache, pair, cos, sin);
    r.x[a_dim] = from_float<T>(rotated<T, kHfRounding>(a, b, true, cos, sin));
    r.x[b_dim] = from_float<T>(rotated<T, kHfRounding>(b, a, false, cos, sin));
  }
  for (int d = p.rope_dim + lane; d < p.head_dim; d += kWarpSize) r.x[d] = from_float<T>(norm_at(d));
}

// v3's geometry, as qk_norm v3: a head is kVecsPerHead 16-byte vectors spread over
// kThreadsPerHead lanes (at most a warp), each holding kVecsPerThread of them in registers.
template <typename T, int kHeadDim>
struct V3Traits {
  static constexpr int kVecElems = Vec<T>::kElems;                    // 4 fp32, 8 fp16/bf16
  static constexpr int kVecsPerHead = kHeadDim / kVecElems;
  static constexpr int kThreadsPerHead = kVecsPerHead < kWarpSize ? kVecsPerHead : kWarpSize;
  static constexpr int kVecsPerThread = kVecsPerHead / kThreadsPerHead;
  static constexpr int kElemsPerThread = kVecsPerThread * kVecElems;
  static constexpr int kThreadsPerBlock = 256;
  static constexpr int kGroupsPerBlock = kThreadsPerBlock / kThreadsPerHead;

  static_assert(kHeadDim % kVecElems == 0, "a head is a whole number of 16-byte vectors");
  static_assert(kVecsPerHead % kThreadsPerHead == 0, "every lane of a head holds as many vectors");
  static_assert(kWarpSize % kThreadsPerHead == 0, "heads tile a warp, so a shuffle group never spans two warps");
  static_assert(kThreadsPerBlock % kWarpSize == 0, "whole warps per block");
  static_assert(kVecElems % 2 == 0, "an interleaved pair never straddles two vectors");
};

// ------------------------------------------------------------------------------------------
// v3: 16-byte vectors held in registers, lanes sized to the head, the NeoX partner fetched by a warp shuffle, cos/sin read once per token and reused across its heads, persistent grid - removes v2's second read, narrow loads and per-head cache reads
// A group of kThreadsPerHead lanes owns one row at a time (qk_norm v3's geometry); a work item
// is one token and a run of `heads_per_item` of its heads, so the group reads the token's
// cos/sin once and reuses them for every head of the run. grid.x: min(item groups, resident
// blocks); blocks stride over items. Needs rope_dim a multiple of two vectors: a vector is then
// wholly rotated or wholly passed through, an interleaved pair sits inside one vector, and a
// NeoX partner vector lies a whole number of vectors away: in another lane (a shuffle) or in
// another vector slot of the same lane.
// ------------------------------------------------------------------------------------------
template <typename T, int kHeadDim, bool kHfRounding>
__global__ void __launch_bounds__(V3Traits<T, kHeadDim>::kThreadsPerBlock)
    qk_norm_rope_v3_kernel(Params p, int64_t items, int heads_per_item, int items_per_token) {
  using Tr = V3Traits<T, kHeadDim>;
  constexpr int kVecElems = Tr::kVecElems;
  constexpr int kElems = Tr::kElemsPerThread;
  const int lane = threadIdx.x % Tr::kThreadsPerHead;  // lane within its head group
  const int group = threadIdx.x / Tr::kThreadsPerHead;
  const int heads = p.num_q_heads + p.num_kv_heads;

  // Vector slot i of this lane is vector i * kThreadsPerHead + lane of the row (as in qk_norm v3).
  auto vector_of = [&](int i) { return i * Tr::kThreadsPerHead + lane; };

  float w_q[kElems], w_k[kElems];
#pragma unroll
  for (int i = 0; i < Tr::kVecsPerThread; ++i) {
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) {
      const int d = vector_of(i) * kVecElems + j;
      w_q[i * kVecElems + j] = effective_weight<T, kHfRounding>(load_weight<T>(p.q_weight, p.weight_is_fp32, d), p.weight_offset);
      w_k[i * kVecElems + j] = effective_weight<T, kHfRounding>(load_weight<T>(p.k_weight, p.weight_is_fp32, d), p.weight_offset);
    }
  }
  // Each vector slot's place in the rotation; a NeoX partner vector is `half_vecs` vectors away,
  // held by lane `partner_lane` in its slot `partner_slot` (the same element index j).
  const int half_vecs = p.rope_dim / 2 / kVecElems;
  bool is_rotated[Tr::kVecsPerThread], is_first[Tr::kVecsPerThread];
  int partner_lane[Tr::kVecsPerThread], partner_slot[Tr::kVecsPerThread];
#pragma unroll
  for (int i = 0; i < Tr::kVecsPerThread; ++i) {
    const int v = vector_of(i);
    is_rotated[i] = v * kVecElems < p.rope_dim;
    is_first[i] = v < half_vecs;
    const int partner = is_rotated[i] ? (is_first[i] ? v + half_vecs : v - half_vecs) : v;
    partner_lane[i] = partner % Tr::kThreadsPerHead;
    partner_slot[i] = partner / Tr::kThreadsPerHead;
  }

  // `first` is uniform across the block, so every lane runs the same iterations and the group
  // shuffles never miss a lane; items past the end compute on zeros and store nothing.
  const int64_t item_stride = static_cast<int64_t>(gridDim.x) * Tr::kGroupsPerBlock;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * Tr::kGroupsPerBlock; first < items; first += item_stride) {
    const int64_t item = first + group;
    const bool item_active = item < items;
    const int64_t token = item_active ? item / items_per_token : 0;
    const int head_begin = static_cast<int>(item - token * items_per_token) * heads_per_item;

    // cos/sin of every rotated element of this lane, once per token.
    float cos[kElems], sin[kElems];
    const int64_t cache = item_active ? cache_row(p, token) : -1;
#pragma unroll
    for (int i = 0; i < Tr::kVecsPerThread; ++i) {
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) {
        const int e = i * kVecElems + j;
        cos[e] = sin[e] = 0.f;
        if (item_active && is_rotated[i]) {
          const int d = vector_of(i) * kVecElems + j;
          load_cos_sin<T, kHfRounding>(p, cache, pair_slot(d, p.rope_dim, p.is_neox).pair, cos[e], sin[e]);
        }
      }
    }

    for (int h = 0; h < heads_per_item; ++h) {  // uniform trip count: shuffles stay convergent
      const int head = head_begin + h;
      const bool active = item_active && head < heads;
      const Row<T> r = active ? locate_row<T>(p, token, head) : Row<T>{nullptr, nullptr};
      const bool is_q = head < p.num_q_heads;

      Vec<T> x[Tr::kVecsPerThread];
#pragma unroll
      for (int i = 0; i < Tr::kVecsPerThread; ++i) {
        if (active) {
          x[i] = load_vec<T>(r.x + vector_of(i) * kVecElems);
        } else {
#pragma unroll
          for (int j = 0; j < kVecElems; ++j) x[i].v[j] = from_float<T>(0.f);
        }
      }
      float sum_sq = 0.f;
#pragma unroll
      for (int i = 0; i < Tr::kVecsPerThread; ++i) {
#pragma unroll
        for (int j = 0; j < kVecElems; ++j) {
          const float xf = to_float<T>(x[i].v[j]);
          sum_sq += xf * xf;
        }
      }
      const float rstd = rstd_from(warp_sum<Tr::kThreadsPerHead>(sum_sq), static_cast<float>(kHeadDim), p.eps);
      float n[kElems];
#pragma unroll
      for (int e = 0; e < kElems; ++e) {
        n[e] = normalized<T, kHfRounding>(to_float<T>(x[e / kVecElems].v[e % kVecElems]), rstd, is_q ? w_q[e] : w_k[e]);
      }

      // The partner of every element: interleaved, the neighbour in the same vector; NeoX, the
      // same element of the partner vector: each source slot s is shuffled from the partner lane
      // and kept where it is the partner's slot (the shuffle sends one register for all lanes).
      float partner[kElems];
      if (p.is_neox) {
#pragma unroll
        for (int i = 0; i < Tr::kVecsPerThread; ++i) {
#pragma unroll
          for (int s = 0; s < Tr::kVecsPerThread; ++s) {
#pragma unroll
            for (int j = 0; j < kVecElems; ++j) {
              const float got = __shfl_sync(kFullMask, n[s * kVecElems + j], partner_lane[i], Tr::kThreadsPerHead);
              if (s == partner_slot[i]) partner[i * kVecElems + j] = got;
            }
          }
        }
      } else {
#pragma unroll
        for (int e = 0; e < kElems; ++e) partner[e] = n[e ^ 1];
      }

      if (active) {
#pragma unroll
        for (int i = 0; i < Tr::kVecsPerThread; ++i) {
          Vec<T> y;
#pragma unroll
          for (int j = 0; j < kVecElems; ++j) {
            const int e = i * kVecElems + j;
            const bool first_member = p.is_neox ? is_first[i] : j % 2 == 0;
            const float out = is_rotated[i] ? rotated<T, kHfRounding>(n[e], partner[e], first_member, cos[e], sin[e]) : n[e];
            y.v[j] = from_float<T>(out);
          }
          store_vec<T>(r.x + vector_of(i) * kVecElems, y);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// v4: lanes own whole rotation pairs: a NeoX lane holds a 16-byte vector of the first half and its partner vector of the second half, so one run of cos/sin serves both and no shuffle fetches a partner; a lane keeps one row at a time - removes v3's partner shuffles, half its cos/sin loads and the registers it spends keeping a token's cos/sin and both weights across heads (79 -> 64: 4 blocks per SM instead of 3)
// A row's 16-byte vectors are grouped in units of two: unit u < h (h = rope_dim / 2 / vector,
// the rotated units) is NeoX vectors (u, u + h), which hold the a and b members of the same
// kVecElems pairs, or interleaved vectors (2u, 2u + 1), whose pairs sit inside each vector; either
// way the unit's pairs are u * kVecElems ... + kVecElems - 1, one contiguous run of cos and one of
// sin. Units u >= h are two neighbouring pass-through vectors (2u, 2u + 1). A group of
// kThreadsPerHead lanes owns a row, lane `lane` its units lane, lane + kThreadsPerHead, ...; the
// block strides over rows. Where v3 gives a lane one vector of the row (head_dim 128 in bf16), a
// v4 lane has two in flight and a row takes half as many lanes, so a warp works on twice as many
// rows at once. The weights and cos/sin are
// re-read for every row: a token's heads are neighbouring rows, handled by neighbouring groups
// at the same moment, so these hit L1 (v3 kept them in registers across a token's heads). The
// (token, head) of a row is advanced by the grid's stride instead of divided out per row.
// ------------------------------------------------------------------------------------------
template <typename T, int kHeadDim>
struct V4Traits {
  static constexpr int kVecElems = Vec<T>::kElems;  // 4 fp32, 8 fp16/bf16
  static constexpr int kVecsPerHead = kHeadDim / kVecElems;
  static constexpr int kUnitsPerHead = kVecsPerHead / 2;
  static constexpr int kThreadsPerHead = kUnitsPerHead < kWarpSize ? kUnitsPerHead : kWarpSize;
  static constexpr int kUnitsPerThread = kUnitsPerHead / kThreadsPerHead;
  static constexpr int kThreadsPerBlock = 256;
  static constexpr int kGroupsPerBlock = kThreadsPerBlock / kThreadsPerHead;

  static_assert(kHeadDim % (2 * kVecElems) == 0, "a head is a whole number of two-vector units");
  static_assert(kUnitsPerHead % kThreadsPerHead == 0, "every lane of a head holds as many units");
  static_assert(kWarpSize % kThreadsPerHead == 0, "heads tile a warp, so a shuffle group never spans two warps");
  static_assert(kThreadsPerBlock % kWarpSize == 0, "whole warps per block");
  static_assert(kVecElems % 2 == 0, "an interleaved pair never straddles two vectors");
};

// N contiguous elements of storage type S as float32, read in aligned loads of up to 16 bytes.
// `src` must be aligned to the load size, min(N * sizeof(S), 16) bytes.
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

// The same from a buffer stored in the activation dtype T or in float32 (a uniform branch).
template <typename T, int N>
__device__ __forceinline__ void load_floats(const void* base, bool is_fp32, int64_t offset, float (&out)[N]) {
  if (is_fp32) {
    load_floats<float, N>(static_cast<const float*>(base) + offset, out);
  } else {
    load_floats<T, N>(static_cast<const T*>(base) + offset, out);
  }
}

// cos and sin of the kPairs pairs from `first_pair` on, in cache row `row`, read as vectors; row -1
// (out of range) gives NaN. HF order rounds them to T.
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

template <typename T, int kHeadDim, bool kHfRounding>
__global__ void __launch_bounds__(V4Traits<T, kHeadDim>::kThreadsPerBlock)
    qk_norm_rope_v4_kernel(Params p, int64_t rows) {
  using Tr = V4Traits<T, kHeadDim>;
  constexpr int kVecElems = Tr::kVecElems;
  const int lane = threadIdx.x % Tr::kThreadsPerHead;  // lane within its head group
  const int group = threadIdx.x / Tr::kThreadsPerHead;
  const int heads = p.num_q_heads + p.num_kv_heads;

  // This lane's units: their index, whether they rotate, and the columns of their two vectors.
  const int rotated_units = p.rope_dim / 2 / kVecElems;
  int unit[Tr::kUnitsPerThread], col_a[Tr::kUnitsPerThread], col_b[Tr::kUnitsPerThread];
  bool rotates[Tr::kUnitsPerThread];
#pragma unroll
  for (int s = 0; s < Tr::kUnitsPerThread; ++s) {
    const int u = s * Tr::kThreadsPerHead + lane;
    unit[s] = u;
    rotates[s] = u < rotated_units;
    const bool halves = p.is_neox && rotates[s];  // NeoX pair: (u, u + h); otherwise neighbours
    col_a[s] = (halves ? u : 2 * u) * kVecElems;
    col_b[s] = (halves ? u + rotated_units : 2 * u + 1) * kVecElems;
  }

  // The walk: row = token * heads + head, advanced by the grid's row stride each step.
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * Tr::kGroupsPerBlock;
  const int64_t token_step = row_stride / heads;
  const int head_step = static_cast<int>(row_stride % heads);
  auto advance = [&](int64_t& token, int& head) {
    token += token_step;
    head += head_step;
    if (head >= heads) {
      head -= heads;
      ++token;
    }
  };
  const int64_t my_first_row = static_cast<int64_t>(blockIdx.x) * Tr::kGroupsPerBlock + group;
  int64_t token = my_first_row / heads;
  int head = static_cast<int>(my_first_row % heads);

  // `first` is uniform across the block, so every lane runs the same iterations and the group
  // shuffles never miss a lane; rows past the end compute on zeros and store nothing.
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * Tr::kGroupsPerBlock; first < rows; first += row_stride) {
    const bool active = first + group < rows;
    const bool is_q = head < p.num_q_heads;
    const Row<T> r = active ? locate_row<T>(p, token, head) : Row<T>{nullptr, nullptr};
    const int64_t cache = active ? cache_row(p, token) : -1;  // first: the cos/sin loads wait on it

    Vec<T> xa[Tr::kUnitsPerThread], xb[Tr::kUnitsPerThread];
#pragma unroll
    for (int s = 0; s < Tr::kUnitsPerThread; ++s) {
      if (active) {
        xa[s] = load_vec<T>(r.x + col_a[s]);
        xb[s] = load_vec<T>(r.x + col_b[s]);
      } else {
#pragma unroll
        for (int j = 0; j < kVecElems; ++j) xa[s].v[j] = xb[s].v[j] = from_float<T>(0.f);
      }
    }
    float sum_sq = 0.f;
#pragma unroll
    for (int s = 0; s < Tr::kUnitsPerThread; ++s) {
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) {
        const float a = to_float<T>(xa[s].v[j]), b = to_float<T>(xb[s].v[j]);
        sum_sq += a * a + b * b;
      }
    }
    const float rstd = rstd_from(warp_sum<Tr::kThreadsPerHead>(sum_sq), static_cast<float>(kHeadDim), p.eps);

    if (active) {
      const void* w = is_q ? p.q_weight : p.k_weight;
#pragma unroll
      for (int s = 0; s < Tr::kUnitsPerThread; ++s) {
        float wa[kVecElems], wb[kVecElems], na[kVecElems], nb[kVecElems];
        load_floats<T, kVecElems>(w, p.weight_is_fp32, col_a[s], wa);
        load_floats<T, kVecElems>(w, p.weight_is_fp32, col_b[s], wb);
#pragma unroll
        for (int j = 0; j < kVecElems; ++j) {
          na[j] = normalized<T, kHfRounding>(to_float<T>(xa[s].v[j]), rstd, effective_weight<T, kHfRounding>(wa[j], p.weight_offset));
          nb[j] = normalized<T, kHfRounding>(to_float<T>(xb[s].v[j]), rstd, effective_weight<T, kHfRounding>(wb[j], p.weight_offset));
        }
        Vec<T> ya, yb;
        if (rotates[s]) {
          float cos[kVecElems], sin[kVecElems];  // the unit's kVecElems pairs
          load_cos_sin_run<T, kVecElems, kHfRounding>(p, cache, unit[s] * kVecElems, cos, sin);
#pragma unroll
          for (int j = 0; j < kVecElems; ++j) {
            if (p.is_neox) {  // a = na[j], b = nb[j]: pair j
              ya.v[j] = from_float<T>(rotated<T, kHfRounding>(na[j], nb[j], true, cos[j], sin[j]));
              yb.v[j] = from_float<T>(rotated<T, kHfRounding>(nb[j], na[j], false, cos[j], sin[j]));
            } else {  // pairs (j, j ^ 1) inside each vector: pair j / 2 of a, kVecElems / 2 + j / 2 of b
              const bool first_member = j % 2 == 0;
              const int pair_a = j / 2, pair_b = kVecElems / 2 + j / 2;
              ya.v[j] = from_float<T>(rotated<T, kHfRounding>(na[j], na[j ^ 1], first_member, cos[pair_a], sin[pair_a]));
              yb.v[j] = from_float<T>(rotated<T, kHfRounding>(nb[j], nb[j ^ 1], first_member, cos[pair_b], sin[pair_b]));
            }
          }
        } else {
#pragma unroll
          for (int j = 0; j < kVecElems; ++j) {
            ya.v[j] = from_float<T>(na[j]);
            yb.v[j] = from_float<T>(nb[j]);
          }
        }
        store_vec<T>(r.x + col_a[s], ya);
        store_vec<T>(r.x + col_b[s], yb);
      }
    }

    advance(token, head);
  }
}


// ------------------------------------------------------------------------------------------
// v5: the layout and the tables' storage types fixed at compile time (the kernel picks its loop once), bf16 converted two elements per instruction, the norm scale one fma per element, x read and written by streaming global accesses - removes v4's per-element layout selects, its predicated loads for both table dtypes and its generic loads and stores (64 -> 57 registers NeoX, 48 interleaved)
// The geometry and row walk of v4, with what v4 decided per element decided before the loop.
// v4's SASS showed, per row and lane: the NeoX/interleaved choice as selects inside the
// rotation; loads for BOTH storage types of the weights and of the cos/sin cache, predicated (a
// runtime flag the compiler turned into predication, so both paths issue); each bf16 moved into
// its own register before the shift that widens it; and x read by generic LD (the row pointer
// is picked at run time between q and k). Here:
//   - NeoX or interleaved is a template parameter (the launcher picks the kernel);
//   - the weight and cache storage types are template parameters of the row walk, and the kernel
//     branches once, uniformly, into one of the four walks;
//   - x is unpacked and packed two bf16 per instruction (unpack / pack in common.cuh);
//   - the fused-order scale is x * fma(w, rstd, rstd * weight_offset): one fma per element, the
//     offset's product once per row;
//   - x is read and written with streaming (evict-first) global accesses and the tables through
//     the read-only path.
// On the H200 at flux_1024 this is 39.1 -> 29.1 us (docs/qk_norm_rope.md has each step).
// ------------------------------------------------------------------------------------------
// The units a lane owns, fixed for the whole walk: index, whether they rotate, their columns.
template <int kUnits>
struct LaneUnits {
  int unit[kUnits], col_a[kUnits], col_b[kUnits];
  bool rotates[kUnits];
};

template <int kUnits, bool kNeox, int kVecElems>
__device__ __forceinline__ LaneUnits<kUnits> lane_units(int lane, int threads_per_head, int rope_dim) {
  const int rotated_units = rope_dim / 2 / kVecElems;
  LaneUnits<kUnits> u;
#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    const int unit = s * threads_per_head + lane;
    u.unit[s] = unit;
    u.rotates[s] = unit < rotated_units;
    const bool halves = kNeox && u.rotates[s];  // NeoX pair: (u, u + h); otherwise neighbours
    u.col_a[s] = (halves ? unit : 2 * unit) * kVecElems;
    u.col_b[s] = (halves ? unit + rotated_units : 2 * unit + 1) * kVecElems;
  }
  return u;
}

// One row as loaded: where it lives (x == nullptr: past the end), its weight, its cache row (-1:
// out of range) and the lane's vectors of x (zeros past the end, so the group's sum still runs).
template <typename T, int kUnits>
struct LoadedRow {
  T* x;
  const void* w;
  int64_t cache;
  Vec<T> a[kUnits], b[kUnits];
};

template <typename T, int kUnits>
__device__ __forceinline__ LoadedRow<T, kUnits> load_row(const Params& p, bool active, int64_t token, int head,
                                                         const LaneUnits<kUnits>& u) {
  LoadedRow<T, kUnits> r{nullptr, nullptr, -1, {}, {}};
  if (active) {
    const Row<T> at = locate_row<T>(p, token, head);
    r.x = at.x;
    r.w = at.w;
    r.cache = cache_row(p, token);
#pragma unroll
    for (int s = 0; s < kUnits; ++s) {
      r.a[s] = load_vec_streaming<T>(r.x + u.col_a[s]);
      r.b[s] = load_vec_streaming<T>(r.x + u.col_b[s]);
    }
  } else {
#pragma unroll
    for (int s = 0; s < kUnits; ++s) {
#pragma unroll
      for (int j = 0; j < Vec<T>::kElems; ++j) r.a[s].v[j] = r.b[s].v[j] = from_float<T>(0.f);
    }
  }
  return r;
}

// N consecutive elements of a table stored as S (float32 or the activation dtype) from `offset`,
// as float32: whole 16-byte read-only loads (the host checks the alignment).
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

// The cos_i and sin_i of unit `unit`'s kVecElems pairs in cache row `cache`, as float32: NaN
// for an out-of-range position (-1, nothing read), rounded to T first in the Hugging Face order.
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

// Where finish_row takes a row's weights and cos/sin from, unit by unit. v5 to v7 read them
// from memory once the row's sum is done (TablesFromMemory: nothing held across the sum, so the
// walk keeps its register count); v8's one-row kernel reads them with the row
// (TablesInRegisters), so they arrive while x is still in flight.
template <typename T, int kHeadDim, bool kHfRounding, typename WeightT, typename CacheT>
struct TablesFromMemory {
  static constexpr int kUnits = V4Traits<T, kHeadDim>::kUnitsPerThread;
  static constexpr int kVecElems = V4Traits<T, kHeadDim>::kVecElems;
  const Params& p;
  const LoadedRow<T, kUnits>& r;
  const LaneUnits<kUnits>& u;

  __device__ __forceinline__ void weights(int s, float (&wa)[kVecElems], float (&wb)[kVecElems]) const {
    load_table<WeightT, kVecElems>(r.w, u.col_a[s], wa);
    load_table<WeightT, kVecElems>(r.w, u.col_b[s], wb);
  }
  __device__ __forceinline__ void cos_sin(int s, float (&cos)[kVecElems], float (&sin)[kVecElems]) const {
    unit_cos_sin<T, kHfRounding, CacheT, kVecElems>(p, r.cache, u.unit[s], cos, sin);
  }
};

// Unit s's run of a table held in registers, as the array finish_row takes (register renaming,
// no instructions).
template <int kUnits, int kVecElems>
__device__ __forceinline__ void held_unit(const float (&held)[kUnits][kVecElems], int s, float (&out)[kVecElems]) {
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) out[j] = held[s][j];
}

template <typename T, int kHeadDim>
struct TablesInRegisters {
  static constexpr int kUnits = V4Traits<T, kHeadDim>::kUnitsPerThread;
  static constexpr int kVecElems = V4Traits<T, kHeadDim>::kVecElems;
  float wa[kUnits][kVecElems], wb[kUnits][kVecElems];
  float cos[kUnits][kVecElems], sin[kUnits][kVecElems];  // rotated units only

  __device__ __forceinline__ void weights(int s, float (&a)[kVecElems], float (&b)[kVecElems]) const {
    held_unit(wa, s, a);
    held_unit(wb, s, b);
  }
  __device__ __forceinline__ void cos_sin(int s, float (&c)[kVecElems], float (&n)[kVecElems]) const {
    held_unit(cos, s, c);
    held_unit(sin, s, n);
  }
};

// Reads a loaded row's tables into registers (a row past the end reads nothing).
template <typename T, int kHeadDim, bool kHfRounding, typename WeightT, typename CacheT>
__device__ __forceinline__ TablesInRegisters<T, kHeadDim> load_row_tables(
    const Params& p, const LoadedRow<T, V4Traits<T, kHeadDim>::kUnitsPerThread>& r,
    const LaneUnits<V4Traits<T, kHeadDim>::kUnitsPerThread>& u) {
  const TablesFromMemory<T, kHeadDim, kHfRounding, WeightT, CacheT> memory{p, r, u};
  TablesInRegisters<T, kHeadDim> t;
  if (r.x != nullptr) {  // a row past the end reads nothing (it stops after the sum)
#pragma unroll
    for (int s = 0; s < TablesInRegisters<T, kHeadDim>::kUnits; ++s) {
      memory.weights(s, t.wa[s], t.wb[s]);
      if (u.rotates[s]) memory.cos_sin(s, t.cos[s], t.sin[s]);
    }
  }
  return t;
}

// v9's tables: TablesFromMemory's (cos/sin read after the sum), except the row's weights, which
// come from registers where the walk read them once (its lane group keeps one head, so one
// tensor, for the whole walk).
template <typename T, int kHeadDim, bool kHfRounding, typename WeightT, typename CacheT>
struct TablesHeldWeights : TablesFromMemory<T, kHeadDim, kHfRounding, WeightT, CacheT> {
  using Base = TablesFromMemory<T, kHeadDim, kHfRounding, WeightT, CacheT>;
  const float (&w_a)[Base::kUnits][Base::kVecElems];
  const float (&w_b)[Base::kUnits][Base::kVecElems];

  __device__ __forceinline__ void weights(int s, float (&a)[Base::kVecElems], float (&b)[Base::kVecElems]) const {
    held_unit(w_a, s, a);
    held_unit(w_b, s, b);
  }
};

// Normalizes, rotates and stores one loaded row, its tables taken from `tables`. Every lane of
// the group calls it (the sum is a group shuffle); lanes of a row past the end stop after the sum.
template <typename T, int kHeadDim, bool kHfRounding, bool kNeox, typename Tables>
__device__ __forceinline__ void finish_row(const Params& p, const LoadedRow<T, V4Traits<T, kHeadDim>::kUnitsPerThread>& r,
                                           const LaneUnits<V4Traits<T, kHeadDim>::kUnitsPerThread>& u,
                                           const Tables& tables) {
  using Tr = V4Traits<T, kHeadDim>;
  constexpr int kVecElems = Tr::kVecElems;
  constexpr int kUnits = Tr::kUnitsPerThread;
  float xa[kUnits][kVecElems], xb[kUnits][kVecElems];
  float sum_sq = 0.f;
#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    unpack<T>(r.a[s], xa[s]);
    unpack<T>(r.b[s], xb[s]);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) sum_sq += xa[s][j] * xa[s][j] + xb[s][j] * xb[s][j];
  }
  const float rstd = rstd_from(warp_sum<Tr::kThreadsPerHead>(sum_sq), static_cast<float>(kHeadDim), p.eps);
  if (r.x == nullptr) return;
  const float rstd_offset = rstd * p.weight_offset;

#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    float wa[kVecElems], wb[kVecElems], na[kVecElems], nb[kVecElems];
    tables.weights(s, wa, wb);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) {
      if constexpr (kHfRounding) {
        na[j] = normalized<T, true>(xa[s][j], rstd, effective_weight<T, true>(wa[j], p.weight_offset));
        nb[j] = normalized<T, true>(xb[s][j], rstd, effective_weight<T, true>(wb[j], p.weight_offset));
      } else {  // x * rstd * (w + offset) as x * (w * rstd + offset * rstd)
        na[j] = xa[s][j] * fmaf(wa[j], rstd, rstd_offset);
        nb[j] = xb[s][j] * fmaf(wb[j], rstd, rstd_offset);
      }
    }
    float ya[kVecElems], yb[kVecElems];
    if (u.rotates[s]) {
      float cos[kVecElems], sin[kVecElems];  // the unit's kVecElems pairs
      tables.cos_sin(s, cos, sin);
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) {
        if constexpr (kNeox) {  // a = na[j], b = nb[j]: pair j
          ya[j] = rotated<T, kHfRounding>(na[j], nb[j], true, cos[j], sin[j]);
          yb[j] = rotated<T, kHfRounding>(nb[j], na[j], false, cos[j], sin[j]);
        } else {  // pairs (j, j ^ 1) inside each vector: pair j / 2 of a, kVecElems / 2 + j / 2 of b
          const bool first_member = j % 2 == 0;
          const int pair_a = j / 2, pair_b = kVecElems / 2 + j / 2;
          ya[j] = rotated<T, kHfRounding>(na[j], na[j ^ 1], first_member, cos[pair_a], sin[pair_a]);
          yb[j] = rotated<T, kHfRounding>(nb[j], nb[j ^ 1], first_member, cos[pair_b], sin[pair_b]);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) {
        ya[j] = na[j];
        yb[j] = nb[j];
      }
    }
    store_vec_streaming<T>(r.x + u.col_a[s], pack<T>(ya));
    store_vec_streaming<T>(r.x + u.col_b[s], pack<T>(yb));
  }
}

// v4's walk: row = token * heads + head, advanced by the grid's row stride each step.
// kHeldWeights (v9): the launcher made the grid's row stride whole tokens (p.head_step == 0), so a
// lane group keeps its first row's head for the whole walk: its weight is read once, before it.
template <typename T, int kHeadDim, bool kHfRounding, bool kNeox, typename WeightT, typename CacheT,
          bool kHostSteps = false, bool kHeldWeights = false>
__device__ __forceinline__ void walk_rows(const Params& p, int64_t rows) {
  using Tr = V4Traits<T, kHeadDim>;
  constexpr int kUnits = Tr::kUnitsPerThread;
  const int lane = threadIdx.x % Tr::kThreadsPerHead;
  const int group = threadIdx.x / Tr::kThreadsPerHead;
  const int heads = p.num_q_heads + p.num_kv_heads;
  const LaneUnits<kUnits> u = lane_units<kUnits, kNeox, Tr::kVecElems>(lane, Tr::kThreadsPerHead, p.rope_dim);

  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * Tr::kGroupsPerBlock;
  int64_t token_step, token;
  int head_step, head;
  if constexpr (kHostSteps) {  // v7: the launcher's steps, and a multiply-high for the first row (< 2^32)
    token_step = p.token_step;
    head_step = p.head_step;
    const uint32_t my_first_row = blockIdx.x * Tr::kGroupsPerBlock + group;
    const uint32_t first_token = p.heads_divisor.divide(my_first_row);
    token = first_token;
    head = static_cast<int>(my_first_row - first_token * static_cast<uint32_t>(heads));
  } else {
    token_step = row_stride / heads;
    head_step = static_cast<int>(row_stride % heads);
    const int64_t my_first_row = static_cast<int64_t>(blockIdx.x) * Tr::kGroupsPerBlock + group;
    token = my_first_row / heads;
    head = static_cast<int>(my_first_row % heads);
  }

  float w_a[kUnits][Tr::kVecElems], w_b[kUnits][Tr::kVecElems];
  if constexpr (kHeldWeights) {
    const void* w = head < p.num_q_heads ? p.q_weight : p.k_weight;
#pragma unroll
    for (int s = 0; s < kUnits; ++s) {
      load_table<WeightT, Tr::kVecElems>(w, u.col_a[s], w_a[s]);
      load_table<WeightT, Tr::kVecElems>(w, u.col_b[s], w_b[s]);
    }
  }

  // `first` is uniform across the block, so every lane runs the same iterations.
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * Tr::kGroupsPerBlock; first < rows; first += row_stride) {
    const LoadedRow<T, kUnits> r = load_row<T, kUnits>(p, first + group < rows, token, head, u);
    token += token_step;
    head += head_step;
    if (head >= heads) {
      head -= heads;
      ++token;
    }
    if constexpr (kHeldWeights) {
      const TablesHeldWeights<T, kHeadDim, kHfRounding, WeightT, CacheT> tables{{p, r, u}, w_a, w_b};
      finish_row<T, kHeadDim, kHfRounding, kNeox>(p, r, u, tables);
    } else {
      const TablesFromMemory<T, kHeadDim, kHfRounding, WeightT, CacheT> tables{p, r, u};
      finish_row<T, kHeadDim, kHfRounding, kNeox>(p, r, u, tables);
    }
  }
}

constexpr int kNumWeights = 2;  // q's and k's

// v8, before the wait: the call's tables brought into L2 (warm_l2 in include/common.cuh says why
// this cannot make a later read stale), each line by one lane group of the call: the weights by
// block 0's first two groups, a token's position and cos/sin run by the group of its first head.
// (Every group warming its own row's tables sent thousands of prefetches of the same lines, most
// likely queued at their L2 slices: docs/qk_norm_rope.md.) The cos/sin run is aimed by a
// speculative read of the position: from L2 only (__ldcg leaves no L1 line that a read after
// the wait could hit), possibly stale, used for nothing but the prefetch addresses and kept
// inside the cache; load_row reads the position again after the wait.
template <typename T, int kHeadDim, typename WeightT, typename CacheT>
__device__ __forceinline__ void warm_call_tables(const Params& p, bool active, uint32_t token, int head, int group,
                                                 const LaneUnits<V4Traits<T, kHeadDim>::kUnitsPerThread>& u) {
  using Tr = V4Traits<T, kHeadDim>;
  static_assert(Tr::kGroupsPerBlock >= kNumWeights, "block 0 has a lane group per weight");
  if (blockIdx.x == 0 && group < kNumWeights) {
    const WeightT* w = static_cast<const WeightT*>(group == 0 ? p.q_weight : p.k_weight);
#pragma unroll
    for (int s = 0; s < Tr::kUnitsPerThread; ++s) {
      warm_l2(w + u.col_a[s]);
      warm_l2(w + u.col_b[s]);
    }
  }
  if (!active || head != 0) return;
  const int64_t guess = (p.positions_are_int64 ? __ldcg(static_cast<const long long*>(p.positions) + token)
                                               : __ldcg(static_cast<const int*>(p.positions) + token)) +
                        p.position_offset;
  if (guess < 0 || guess >= p.max_position) return;
  const CacheT* cos_row = static_cast<const CacheT*>(p.cos_sin_cache) + guess * p.rope_dim;
#pragma unroll
  for (int s = 0; s < Tr::kUnitsPerThread; ++s) {
    if (!u.rotates[s]) continue;
    warm_l2(cos_row + u.unit[s] * Tr::kVecElems);
    warm_l2(cos_row + p.rope_dim / 2 + u.unit[s] * Tr::kVecElems);
  }
}

// v7's single row, where the call's rows fit in one trip of the grid: row = block * groups +
// group (rows < 2^31, so a 32-bit index and p.heads_divisor's multiply-high find the token).
// kWarm (v8): the call's tables warmed into L2 before the wait, and the row's read into
// registers right after the row's loads instead of after its sum.
template <typename T, int kHeadDim, bool kHfRounding, bool kNeox, typename WeightT, typename CacheT, bool kWarm>
__device__ __forceinline__ void one_row(const Params& p, int64_t rows) {
  using Tr = V4Traits<T, kHeadDim>;
  constexpr int kUnits = Tr::kUnitsPerThread;
  const int lane = threadIdx.x % Tr::kThreadsPerHead;
  const LaneUnits<kUnits> u = lane_units<kUnits, kNeox, Tr::kVecElems>(lane, Tr::kThreadsPerHead, p.rope_dim);
  const int group = threadIdx.x / Tr::kThreadsPerHead;
  const uint32_t row = blockIdx.x * Tr::kGroupsPerBlock + group;
  const uint32_t token = p.heads_divisor.divide(row);
  const int head = static_cast<int>(row - token * static_cast<uint32_t>(p.num_q_heads + p.num_kv_heads));
  if constexpr (kWarm) {  // v8: while the previous kernel still runs
    warm_call_tables<T, kHeadDim, WeightT, CacheT>(p, row < rows, token, head, group, u);
    after_prior_grids();
  }
  const LoadedRow<T, kUnits> r = load_row<T, kUnits>(p, row < rows, token, head, u);
  if constexpr (kWarm) {  // idle groups too: whole shuffles
    const TablesInRegisters<T, kHeadDim> tables = load_row_tables<T, kHeadDim, kHfRounding, WeightT, CacheT>(p, r, u);
    finish_row<T, kHeadDim, kHfRounding, kNeox>(p, r, u, tables);
  } else {
    const TablesFromMemory<T, kHeadDim, kHfRounding, WeightT, CacheT> tables{p, r, u};
    finish_row<T, kHeadDim, kHfRounding, kNeox>(p, r, u, tables);
  }
}

// How a lane group finds its rows: v4's walk (64-bit divisions on the device), v7's walk with the
// launcher's steps, or v7's single row where the call's rows fit in one trip of the grid, which
// v8 warms.
constexpr int kDeviceStepsWalk = 0;
constexpr int kHostStepsWalk = 1;
constexpr int kOneRow = 2;
constexpr int kOneRowWarmed = 3;

template <typename T, int kHeadDim, bool kHfRounding, bool kNeox, bool kProgrammatic = false,
          int kWalk = kDeviceStepsWalk>
__global__ void __launch_bounds__(V4Traits<T, kHeadDim>::kThreadsPerBlock)
    qk_norm_rope_v5_kernel(Params p, int64_t rows) {
  constexpr bool kWarm = kWalk == kOneRowWarmed;  // v8 waits after warming
  if constexpr (kProgrammatic && !kWarm) after_prior_grids();  // v6: read nothing before the previous kernel is done
  // The storage types are the same for the whole call: one uniform branch into the loop built
  // for them.
  if constexpr (kWalk >= kOneRow) {
    if (p.weight_is_fp32) {
      if (p.cache_is_fp32) return one_row<T, kHeadDim, kHfRounding, kNeox, float, float, kWarm>(p, rows);
      return one_row<T, kHeadDim, kHfRounding, kNeox, float, T, kWarm>(p, rows);
    }
    if (p.cache_is_fp32) return one_row<T, kHeadDim, kHfRounding, kNeox, T, float, kWarm>(p, rows);
    return one_row<T, kHeadDim, kHfRounding, kNeox, T, T, kWarm>(p, rows);
  } else {
    constexpr bool kHostSteps = kWalk == kHostStepsWalk;
    if (p.weight_is_fp32) {
      if (p.cache_is_fp32) return walk_rows<T, kHeadDim, kHfRounding, kNeox, float, float, kHostSteps>(p, rows);
      return walk_rows<T, kHeadDim, kHfRounding, kNeox, float, T, kHostSteps>(p, rows);
    }
    if (p.cache_is_fp32) return walk_rows<T, kHeadDim, kHfRounding, kNeox, T, float, kHostSteps>(p, rows);
    walk_rows<T, kHeadDim, kHfRounding, kNeox, T, T, kHostSteps>(p, rows);
  }
}


// ------------------------------------------------------------------------------------------
// v6: v5 as a programmatic dependent launch (as tp_qk_norm v5): its CTAs become resident while the previous kernel finishes and wait in hardware (griddepcontrol) for its writes - removes the launch gap between back-to-back kernels from each call
// v5's kernel with kProgrammatic, launched with the programmatic-stream-serialization attribute
// (launch_kernel and after_prior_grids in include/common.cuh say how it stays correct). At
// decode sizes (64 tokens: 4096 rows of 128 elements, 2 MiB) the call is short enough that the
// kernel boundary is a visible part of it; this overlaps it with the previous kernel's tail when
// that kernel lets it (the bench's previous call does). Measured on the H200: docs/qk_norm_rope.md.
// ------------------------------------------------------------------------------------------
// v7: v6 with no division on the device: where the call's rows fit in one trip of the grid (decode), one row per lane group, its token found by a multiply-high; otherwise v6's walk, its steps in tokens and heads computed by the launcher - removes the two calls into the 64-bit division routine every lane made before its first load (0.4 us of a decode call)
// v4's walk starts with row / heads and row % heads in 64 bits, for the lane group's first row and
// for the grid's stride: two calls into the 64-bit division routine in v6's SASS, dependent
// instructions before the first load is issued, and at decode a call IS that first trip. v7's
// launcher computes the stride's tokens and heads once (Params::token_step, head_step) and the
// first row (< 2^32 here) is split by p.heads_divisor's multiply-high. Where the rows fit in one
// trip, a lane group's row is simply block * groups + group: no loop, no steps at all. Measured
// on the H200 (bench harness, v6 against v7, us): one token 1.97 -> 1.56, 64 tokens 2.47 -> 2.05,
// 2048 tokens x 20 heads of 256 14.23 -> 13.48; the diffusion shapes within 2 % (flux_1024
// 29.54 -> 29.26). Tried and dropped: one row per lane group at every size, on a grid
// of all rows as qk_norm v11 does (4096 x 64 heads 38.33 against 37.58, 8192 x 72 heads 83.37
// against 79.78), and the weight and cos/sin lines prefetched into L1 right after the row's loads
// at decode (2.20 against 2.03).
// ------------------------------------------------------------------------------------------
// v8: v7 with the decode kernel's tables warmed before the wait: while the previous kernel still runs, the weights and each token's position and cos/sin run (aimed by a speculative L2-only read of the position) are prefetched into L2, each by one lane group; after the wait a lane reads its row's tables into registers together with the row - removes the position -> cos/sin chain of DRAM round trips (and the weights' own) from a decode call's critical path
// At decode a call is one trip: x's load and the position's leave together, but cos/sin can only
// be requested once the position is back, so the row waited for two DRAM round trips one after
// the other, and its weights and cos/sin were read only after its sum. Here the programmatic
// launch's idle time at griddepcontrol.wait does the tables' DRAM round trips (warm_call_tables);
// after the wait the position and the tables are L2 hits, read with the row
// (load_row_tables), and the critical path is x's own round trip. Prefill shapes run v7's walk
// unchanged (most of their CTAs start after the previous kernel is done, with no time to
// win). Probed on the H200 (bench harness, v7 against variants in one run, us at one token / 64
// tokens): v7 1.50 / 2.05; tables read with the row, nothing warmed, 1.42 / 2.03; every lane
// group warming its own row's tables, read after the sum, 1.27 / 2.03, read with the row
// 1.22 / 2.00; each line warmed by one lane group of the call and the tables read with the row
// (v8) 1.25 / 1.78 against v7's 1.54 / 2.03 (qk_norm v12 lost 2-3x from 64 tokens up with a warm
// per lane group). docs/qk_norm_rope.md has the sweep.
// ------------------------------------------------------------------------------------------
// v9: v8 with the walk's weights held: at prefill the grid is cut to whole tokens per step, so each lane group keeps one head for its whole walk and reads its columns of that head's weight once, before the walk, into registers - removes the two weight loads, and their wait, that v5-v8's walk issued for every row after its sum
// A row's weight is q_weight or k_weight, the same for every head of its tensor. v5-v8's walk read
// the row's two weight vectors per lane once the sum was done (L1 hits after the first row): two
// loads and their latency on every row's path from the sum to the store. v9's launcher sizes the
// persistent grid to a whole number of tokens' rows (whole_token_blocks: at most 1/32 of the
// resident blocks left out and no lane group's walk made longer, else v8's walk), so the walk's
// row stride is whole tokens and each lane group's rows are one head of successive tokens: one
// tensor, one weight, read once after the wait and held as floats (walk_rows with kHeldWeights;
// 16 registers). The kernel is compiled per storage pair of the tables, so its registers are
// that pair's own.
// Decode calls keep v8's one-row kernel, which reads the weights with the row. Probed on the H200
// (bench harness, a probe not kept in the repository of v8's walk built for bf16 weights and a float32 cache, its
// weights held as floats, against v8, % of the copy, two runs): flux_1024 NeoX 85.2 / 85.0 against
// 84.0 / 84.1, interleaved 85.8 / 85.5 against 85.0 / 85.0, qwen_image_1024 87.4 / 87.3 against
// 86.6 / 86.6. (Holding both weights packed and picking the row's by a select, on the grid v8
// uses, took 64 registers and lost the interleaved kernel's fifth block: 84.4-84.5 % against v8's
// 84.4-84.7 there, with NeoX at 85.3-85.4 against 84.7.) docs/qk_norm_rope.md has the sweep.
template <typename T, int kHeadDim, bool kHfRounding, bool kNeox, typename WeightT, typename CacheT>
__global__ void __launch_bounds__(V4Traits<T, kHeadDim>::kThreadsPerBlock)
    qk_norm_rope_v9_kernel(Params p, int64_t rows) {
  after_prior_grids();  // launched programmatically, as v6 on
  walk_rows<T, kHeadDim, kHfRounding, kNeox, WeightT, CacheT, true, true>(p, rows);
}

// ------------------------------------------------------------------------------------------
// Launchers (host). `launch` is what the binding calls.
// ------------------------------------------------------------------------------------------
template <typename T, bool kHfRounding>
inline void launch_v1(const Params& p, int64_t rows, cudaStream_t stream) {
  const int64_t norm_blocks = (rows + kV1WarpsPerBlock - 1) / kV1WarpsPerBlock;
  qk_norm_rope_v1_norm_kernel<T, kHfRounding><<<static_cast<unsigned>(norm_blocks), kV1NormThreads, 0, stream>>>(p, rows);
  const int64_t elements = rows * p.head_dim;
  const int64_t rope_blocks = (elements + kV1RopeThreads - 1) / kV1RopeThreads;
  qk_norm_rope_v1_rope_kernel<T, kHfRounding><<<static_cast<unsigned>(rope_blocks), kV1RopeThreads, 0, stream>>>(p, elements);
}

template <typename T, bool kHfRounding>
inline void launch_v2(const Params& p, int64_t rows, cudaStream_t stream) {
  const int64_t blocks = (rows + kV2WarpsPerBlock - 1) / kV2WarpsPerBlock;
  qk_norm_rope_v2_kernel<T, kHfRounding><<<static_cast<unsigned>(blocks), kV2Threads, 0, stream>>>(p, rows);
}

// Heads per work item: whole tokens (cos/sin read once per token) when there are enough tokens
// to fill every resident group; otherwise a token's heads are split over groups so that small
// batches (decode) still fill the GPU.
template <typename T, int kHeadDim, bool kHfRounding>
inline void launch_v3_fixed(const Params& p, cudaStream_t stream) {
  using Tr = V3Traits<T, kHeadDim>;
  constexpr auto kernel = qk_norm_rope_v3_kernel<T, kHeadDim, kHfRounding>;
  const int heads = p.num_q_heads + p.num_kv_heads;
  const int64_t resident_blocks = persistent_grid_limit<kernel>(Tr::kThreadsPerBlock);
  const int64_t resident_groups = resident_blocks * Tr::kGroupsPerBlock;
  const int64_t rows = total_rows(p);
  int64_t heads_per_item = (rows + resident_groups - 1) / resident_groups;  // ceil(rows / groups)
  heads_per_item = heads_per_item < heads ? heads_per_item : heads;
  const int items_per_token = static_cast<int>((heads + heads_per_item - 1) / heads_per_item);
  const int64_t items = p.num_tokens * items_per_token;
  const int64_t needed = (items + Tr::kGroupsPerBlock - 1) / Tr::kGroupsPerBlock;
  const int64_t blocks = needed < resident_blocks ? needed : resident_blocks;
  kernel<<<static_cast<unsigned>(blocks), Tr::kThreadsPerBlock, 0, stream>>>(p, items, static_cast<int>(heads_per_item),
                                                                              items_per_token);
}

// v4, v5 and v6 (same geometry): a persistent grid of at most the resident blocks; v6 launched
// programmatically.
template <typename T, int kHeadDim, auto kKernel, bool kProgrammatic = false>
inline void launch_persistent_rows(const Params& p, int64_t rows, cudaStream_t stream) {
  using Tr = V4Traits<T, kHeadDim>;
  const int64_t needed = (rows + Tr::kGroupsPerBlock - 1) / Tr::kGroupsPerBlock;
  const int64_t resident = persistent_grid_limit<kKernel>(Tr::kThreadsPerBlock);
  const int64_t blocks = needed < resident ? needed : resident;
  launch_kernel(kProgrammatic, kKernel, dim3(static_cast<unsigned>(blocks)), dim3(Tr::kThreadsPerBlock), 0, stream, p,
                rows);
}

// The vector path needs 16-byte aligned rows and rope_dim a multiple of two vectors; v4 and v5
// also read the weights and the cache in vectors, so their base pointers must be 16-byte aligned.
template <typename T>
inline bool vector_path_ok(const Params& p, int version) {
  constexpr int kVecElems = Vec<T>::kElems;
  const bool rows_ok = is_aligned(p.q, kVecBytes) && is_aligned(p.k, kVecBytes) && p.q_token_stride % kVecElems == 0 &&
                       p.q_head_stride % kVecElems == 0 && p.k_token_stride % kVecElems == 0 &&
                       p.k_head_stride % kVecElems == 0 && p.rope_dim % (2 * kVecElems) == 0;
  const bool tables_ok = is_aligned(p.q_weight, kVecBytes) && is_aligned(p.k_weight, kVecBytes) &&
                         is_aligned(p.cos_sin_cache, kVecBytes);
  return rows_ok && (version < 4 || tables_ok);
}

// v5's kernel compiled for the call's layout; kProgrammatic (v6) launches it programmatically.
template <typename T, int kHeadDim, bool kHfRounding, bool kProgrammatic>
inline void launch_v5_layout(const Params& p, int64_t rows, cudaStream_t stream) {
  if (p.is_neox) {
    constexpr auto kKernel = qk_norm_rope_v5_kernel<T, kHeadDim, kHfRounding, true, kProgrammatic>;
    return launch_persistent_rows<T, kHeadDim, kKernel, kProgrammatic>(p, rows, stream);
  }
  constexpr auto kKernel = qk_norm_rope_v5_kernel<T, kHeadDim, kHfRounding, false, kProgrammatic>;
  launch_persistent_rows<T, kHeadDim, kKernel, kProgrammatic>(p, rows, stream);
}

// v7 for one layout: one row per lane group where the rows fit in one trip of the resident grid,
// else the persistent walk with the steps computed here. v8 is the same with the warmed one-row
// kernel (kOneRowWalk = kOneRowWarmed).
template <typename T, int kHeadDim, bool kHfRounding, bool kNeox, int kOneRowWalk>
inline void launch_v7_layout(const Params& params, int64_t rows, cudaStream_t stream) {
  using Tr = V4Traits<T, kHeadDim>;
  constexpr auto walk_kernel = qk_norm_rope_v5_kernel<T, kHeadDim, kHfRounding, kNeox, true, kHostStepsWalk>;
  constexpr auto one_row_kernel = qk_norm_rope_v5_kernel<T, kHeadDim, kHfRounding, kNeox, true, kOneRowWalk>;
  const int64_t needed = (rows + Tr::kGroupsPerBlock - 1) / Tr::kGroupsPerBlock;
  const int64_t resident = persistent_grid_limit<walk_kernel>(Tr::kThreadsPerBlock);
  if (needed <= resident) {
    return launch_kernel(true, one_row_kernel, dim3(static_cast<unsigned>(needed)), dim3(Tr::kThreadsPerBlock), 0, stream,
                         params, rows);
  }
  Params p = params;
  const int64_t row_stride = resident * Tr::kGroupsPerBlock;
  const int heads = p.num_q_heads + p.num_kv_heads;
  p.token_step = row_stride / heads;
  p.head_step = static_cast<int>(row_stride % heads);
  launch_kernel(true, walk_kernel, dim3(static_cast<unsigned>(resident)), dim3(Tr::kThreadsPerBlock), 0, stream, p, rows);
}

template <typename T, int kHeadDim, bool kHfRounding, int kOneRowWalk>
inline void launch_v7_neox_or_not(const Params& p, int64_t rows, cudaStream_t stream) {
  if (p.is_neox) return launch_v7_layout<T, kHeadDim, kHfRounding, true, kOneRowWalk>(p, rows, stream);
  launch_v7_layout<T, kHeadDim, kHfRounding, false, kOneRowWalk>(p, rows, stream);
}

// v9's grid: the most blocks, at most `resident`, whose lane groups are a whole number of tokens'
// rows, so that a step of the walk leaves every lane group on its head (p.head_step == 0). 0, and
// v8's walk runs instead, where that grid would leave more than 1 / kMaxIdleShare of the resident
// blocks out (a head count with a large odd factor: 41 heads on 528 resident blocks keep 492), or
// would give some lane group one row more to walk than the resident grid does: the call lasts
// as long as its longest walk (8192 tokens x 72 heads on 522 blocks instead of 528: 36 rows
// instead of 35, and 2 % slower on the H200).
constexpr int64_t kMaxIdleShare = 32;

inline int64_t whole_token_blocks(int64_t rows, int64_t resident, int groups_per_block, int heads) {
  const int64_t blocks_per_token_cycle = heads / std::gcd(heads, groups_per_block);
  const int64_t blocks = resident / blocks_per_token_cycle * blocks_per_token_cycle;
  const auto longest_walk = [&](int64_t grid) {
    const int64_t groups = grid * groups_per_block;
    return (rows + groups - 1) / groups;
  };
  const bool few_left_out = blocks * kMaxIdleShare >= resident * (kMaxIdleShare - 1);
  return blocks > 0 && few_left_out && longest_walk(blocks) == longest_walk(resident) ? blocks : 0;
}

// v9 for one layout and storage pair: its walk on a grid of whole tokens per step where the rows
// need more than one trip of it, else v8 (its warmed one-row kernel, or its walk where no such
// grid is close to the resident one).
template <typename T, int kHeadDim, bool kHfRounding, bool kNeox, typename WeightT, typename CacheT>
inline void launch_v9_pair(const Params& params, int64_t rows, cudaStream_t stream) {
  using Tr = V4Traits<T, kHeadDim>;
  constexpr auto kernel = qk_norm_rope_v9_kernel<T, kHeadDim, kHfRounding, kNeox, WeightT, CacheT>;
  const int64_t needed = (rows + Tr::kGroupsPerBlock - 1) / Tr::kGroupsPerBlock;
  const int64_t resident = persistent_grid_limit<kernel>(Tr::kThreadsPerBlock);
  const int heads = params.num_q_heads + params.num_kv_heads;
  const int64_t blocks = needed > resident ? whole_token_blocks(rows, resident, Tr::kGroupsPerBlock, heads) : 0;
  if (blocks == 0) return launch_v7_layout<T, kHeadDim, kHfRounding, kNeox, kOneRowWarmed>(params, rows, stream);
  Params p = params;
  const int64_t row_stride = blocks * Tr::kGroupsPerBlock;
  p.token_step = row_stride / heads;
  p.head_step = 0;  // row_stride % heads, by whole_token_blocks
  launch_kernel(true, kernel, dim3(static_cast<unsigned>(blocks)), dim3(Tr::kThreadsPerBlock), 0, stream, p, rows);
}

// v9's kernel is compiled per storage pair of the tables (v5-v8 branch into one of four loops
// inside one kernel, whose registers are then the most any loop needs).
template <typename T, int kHeadDim, bool kHfRounding, bool kNeox>
inline void launch_v9_layout(const Params& p, int64_t rows, cudaStream_t stream) {
  if (p.weight_is_fp32) {
    if (p.cache_is_fp32) return launch_v9_pair<T, kHeadDim, kHfRounding, kNeox, float, float>(p, rows, stream);
    return launch_v9_pair<T, kHeadDim, kHfRounding, kNeox, float, T>(p, rows, stream);
  }
  if (p.cache_is_fp32) return launch_v9_pair<T, kHeadDim, kHfRounding, kNeox, T, float>(p, rows, stream);
  launch_v9_pair<T, kHeadDim, kHfRounding, kNeox, T, T>(p, rows, stream);
}

// v7, v8 and v9.
template <typename T, int kHeadDim, bool kHfRounding>
inline void launch_v7(const Params& p, int64_t rows, int version, cudaStream_t stream) {
  // 32-bit first rows: at most rows + a block's groups, below 2^32 (more rows run v6).
  if (rows > static_cast<int64_t>(INT32_MAX)) return launch_v5_layout<T, kHeadDim, kHfRounding, true>(p, rows, stream);
  if (version == 7) return launch_v7_neox_or_not<T, kHeadDim, kHfRounding, kOneRow>(p, rows, stream);
  if (version == 8) return launch_v7_neox_or_not<T, kHeadDim, kHfRounding, kOneRowWarmed>(p, rows, stream);
  if (p.is_neox) return launch_v9_layout<T, kHeadDim, kHfRounding, true>(p, rows, stream);
  launch_v9_layout<T, kHeadDim, kHfRounding, false>(p, rows, stream);
}

template <typename T, int kHeadDim, bool kHfRounding>
inline void launch_vector_path(const Params& p, int64_t rows, int version, cudaStream_t stream) {
  if (version == 3) return launch_v3_fixed<T, kHeadDim, kHfRounding>(p, stream);
  if (version == 4) return launch_persistent_rows<T, kHeadDim, qk_norm_rope_v4_kernel<T, kHeadDim, kHfRounding>>(p, rows, stream);
  if (version == 5) return launch_v5_layout<T, kHeadDim, kHfRounding, false>(p, rows, stream);
  if (version == 6) return launch_v5_layout<T, kHeadDim, kHfRounding, true>(p, rows, stream);  // the same kernel, programmatic
  launch_v7<T, kHeadDim, kHfRounding>(p, rows, version, stream);
}

// v3 to v9: the vector path where head_dim is specialized and the data aligned, else v2's
// general path (any even head_dim / rope_dim, any alignment).
template <typename T, bool kHfRounding>
inline void launch_vector_or_general(const Params& p, int64_t rows, int version, cudaStream_t stream) {
  if (vector_path_ok<T>(p, version)) {
    switch (p.head_dim) {
      case 64: return launch_vector_path<T, 64, kHfRounding>(p, rows, version, stream);
      case 128: return launch_vector_path<T, 128, kHfRounding>(p, rows, version, stream);
      case 256: return launch_vector_path<T, 256, kHfRounding>(p, rows, version, stream);
      case 512: return launch_vector_path<T, 512, kHfRounding>(p, rows, version, stream);
      default: break;
    }
  }
  launch_v2<T, kHfRounding>(p, rows, stream);
}

template <typename T, bool kHfRounding>
inline void launch_version(const Params& p, int version, cudaStream_t stream) {
  const int64_t rows = total_rows(p);
  switch (version) {
    case 1: return launch_v1<T, kHfRounding>(p, rows, stream);
    case 2: return launch_v2<T, kHfRounding>(p, rows, stream);
    default: return launch_vector_or_general<T, kHfRounding>(p, rows, version, stream);
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

constexpr int kNumVersions = 9;

// Launches version `version` (1..kNumVersions) on `stream`; returns the launch error, if any.
// Version 1 needs `p.scratch` with scratch_elements(p, 1) floats.
inline cudaError_t launch(const Params& params, DType dtype, bool hf_rounding, int version, cudaStream_t stream) {
  if (version < 1 || version > kNumVersions) return cudaErrorInvalidValue;
  if (total_rows(params) == 0) return cudaSuccess;
  if (version == 1 && params.scratch == nullptr) return cudaErrorInvalidValue;
  Params p = params;
  p.heads_divisor = FastDivisor(static_cast<uint32_t>(p.num_q_heads + p.num_kv_heads));
  switch (dtype) {
    case DType::kFloat32: launch_rounding<float>(p, hf_rounding, version, stream); break;
    case DType::kFloat16: launch_rounding<__half>(p, hf_rounding, version, stream); break;
    case DType::kBFloat16: launch_rounding<__nv_bfloat16>(p, hf_rounding, version, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm_rope
