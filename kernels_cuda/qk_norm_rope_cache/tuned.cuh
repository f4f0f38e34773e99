// tuned: v3's kernel, weights packed, no division: four blocks per SM; neighbours stored whole; bf16-cache calls walked by resident blocks; off the vector path the split
//
// What `backend="cuda"` and `"auto"` run. Rung 3's kernel (programmatic launch, the tables, slot
// and position warmed into L2 during the wait and read with the row, the default cache policy:
// at decode the rows the previous kernel just wrote are read from L2), with what the ladder
// leaves out because it teaches no new idea but every call gains from it:
//   * the weights held as loaded (a 16-byte vector of 8 bf16 values) and widened to float32 at
//     their use: 61 registers with a bf16 cache (64 with the walk's warming), 64 with FP8 (rung 3:
//     76, 80), so four blocks of 256 threads per SM instead of three: a third more rows in flight;
//   * a row's (token, head) and a slot's (block, offset) by multiply-high (FastDivisor) in 32 bits,
//     where rung 3 divides 64-bit integers (the policy keeps rows and slots under 2^31);
//   * an FP8 cache's x / scale with no division: x times the scale's inverse, corrected by one
//     fused multiply-add (rows.cuh: InverseScale), the division's float32 in a few instructions;
//   * a unit whose two vectors are neighbours in memory (a v row's, a k row's pass-through or
//     interleaved units) stored into the cache as one store, so an FP8 unit of a bf16 row is 16
//     elements in one 16-byte store, where rung 3 makes two 8-byte ones;
//   * with a cache of the activation dtype, a walk (policy.h: walks): the grid is at most the
//     resident blocks and each lane group takes a row every grid's rows, so no block starts after
//     the first wave; once its row's loads are issued, a lane group of 16-bit rows warms its next
//     row into L2 (warm_row: the row's lines, and a token's slot and position), so each trip after
//     the first reads from L2 what it would wait on DRAM for. 64 registers: still four blocks per SM. With
//     an FP8 cache the walk was slower (at three blocks per SM, and at four under a launch bound),
//     so there the grid keeps a block per rows_per_block rows.
// Calls off the vector path take the split path: qk_norm_rope's warp per row, then rung 1's copy
// kernel (cache_copy.cuh; policy.h says which runs when).
//
// grid.x: the plan's: ceil(rows / rows per block), at most the resident blocks where the kernel
// walks; lane group -> rows base + group, base + group + the grid's rows, ... (a two-vector unit
// per lane slot: PairLanes in qk_norm_rope/rows.cuh), rows numbered q's heads, k's, v's of each token.
#pragma once

#include <string>
#include <type_traits>

#include "qk_norm_rope/tuned.cuh"  // its table types, L2 warming and SM count (its kernels are not instantiated here)
#include "qk_norm_rope_cache/policy.h"
#include "qk_norm_rope_cache/rows.cuh"
#include "qk_norm_rope_cache/cache_copy.cuh"  // the split path

namespace cookbook::qk_norm_rope_cache::tuned {

static_assert(kWarpLanes == kWarpSize && kVectorBytes == kVecBytes, "the policy reasons in the kernels' sizes");
static_assert(copy::kWarpsPerBlock == kCopyWarpsPerBlock, "the policy describes the copy kernel as it is");
static_assert(sizeof(kVectorHeadDims) / sizeof(kVectorHeadDims[0]) == 3, "with_kernel lists every compiled head_dim");

using qk_norm_rope::tuned::kNumWeights;  // q's and k's: block 0 warms each with one lane group
using qk_norm_rope::tuned::TableType;    // a table's element type: the activation dtype T or float32

// The launcher's divisors: the rows of a token (q's, k's and v's heads) and the cache's block_size.
struct Divisors {
  FastDivisor heads;
  FastDivisor block_size;
};

// kN 16-byte vectors of a table stored as S from `offset`, kept as loaded (read-only loads).
template <typename S, int kN>
__device__ __forceinline__ void load_table_vecs(const void* table, int64_t offset, Vec<S> (&out)[kN]) {
  const S* src = static_cast<const S*>(table) + offset;
#pragma unroll
  for (int c = 0; c < kN; ++c) out[c] = load_vec_readonly<S>(src + c * Vec<S>::kElems);
}

// Those vectors as float32 (at their use: held widened, they would cost a block per SM).
template <typename S, int kN, int kElems>
__device__ __forceinline__ void widen(const Vec<S> (&v)[kN], float (&out)[kElems]) {
  static_assert(kN * Vec<S>::kElems == kElems, "whole vectors");
#pragma unroll
  for (int c = 0; c < kN; ++c) {
    float part[Vec<S>::kElems];
    unpack<S>(v[c], part);
#pragma unroll
    for (int j = 0; j < Vec<S>::kElems; ++j) out[c * Vec<S>::kElems + j] = part[j];
  }
}

// The first element of kv head `head`'s row at `slot` (0 <= slot < 2^31: the policy) of cache `c`:
// rows.cuh's cache_row with the block found by multiply-high. Offsets are 64-bit.
template <typename C>
__device__ __forceinline__ C* slot_row(const Cache& c, int64_t slot, const Params& p, const Divisors& div, int head) {
  const uint32_t block = div.block_size.divide(static_cast<uint32_t>(slot));
  const uint32_t at = static_cast<uint32_t>(slot) - block * static_cast<uint32_t>(p.block_size);
  return static_cast<C*>(c.data) + block * c.block_stride + at * c.slot_stride + head * c.head_stride;
}

// The walk's next row for this lane group (`row`, < rows), warmed into L2 while the current one is
// in flight: the lane's share of the row's lines and, for a token's first head, the token's slot and
// position. prefetch.global.L2 holds no register; the row's cos/sin is left to its own trip (warming
// it needs the position in a register: the page's tried-and-dropped table).
template <typename T, int kHeadDim>
__device__ __forceinline__ void warm_row(const Params& p, const Divisors& div, uint32_t row) {
  using Lanes = PairLanes<T, kHeadDim>;
  constexpr int kLaneElems = kHeadDim / Lanes::kLanes;  // the lane's share of a row
  static_assert(kLaneElems * static_cast<int>(sizeof(T)) <= kL2LineBytes, "the lanes' shares reach every line of the row");
  const qk_norm_rope::Params& r = p.rope;
  const uint32_t heads = r.num_q_heads + 2 * r.num_kv_heads;
  const uint32_t token = div.heads.divide(row);
  const int head = static_cast<int>(row - token * heads);
  const int v_head = head - r.num_q_heads - r.num_kv_heads;
  const T* x = v_head < 0 ? qk_norm_rope::row_at<T>(r, token, head).x
                          : static_cast<const T*>(p.v) + token * p.v_token_stride + v_head * p.v_head_stride;
  warm_l2(x + (threadIdx.x % Lanes::kLanes) * kLaneElems);
  if (head != 0) return;
  warm_l2(static_cast<const char*>(p.slot_mapping) + int64_t{token} * (p.slots_are_int64 ? 8 : 4));
  warm_l2(static_cast<const char*>(r.positions) + int64_t{token} * (r.positions_are_int64 ? 8 : 4));
}

// Whether a walking lane group warms its next row: with 16-bit activations (where it was measured).
// float32 rows walk without it: its address arithmetic made ptxas spill 8 bytes in the interleaved
// kernels, and float32 is not a serving dtype that prefill times.
template <typename T, CacheDtype kCache>
constexpr bool kWarmsNextRow = walks(kCache) && sizeof(T) == 2;

// Whether an FP8 store divides by the scale's inverse (rows.cuh: InverseScale) or by the scale: by
// the inverse but in the fp16 interleaved kernels, where it made ptxas spill 4 to 8 bytes.
template <typename T, Layout kLayout>
constexpr bool kStoresByInverse = !(std::is_same_v<T, __half> && kLayout == Layout::kInterleaved);

// One row of the call per lane group: `row` (past the last row the group still joins its shuffles,
// on zeros). On the block's first row (`first`) it warms and waits for the previous kernel.
template <typename T, Rounding kRounding, int kHeadDim, Layout kLayout, TableDtype kWeights, TableDtype kCosSin,
          CacheDtype kCache>
__device__ __forceinline__ void one_row(const Params& p, int64_t rows, const Divisors& div, uint32_t row, bool first,
                                        uint32_t next) {
  using Lanes = PairLanes<T, kHeadDim>;
  using C = CacheElem<T, kCache>;
  using WeightT = TableType<T, kWeights>;
  using CosSinT = TableType<T, kCosSin>;
  constexpr int kVecElems = Lanes::kVecElems;
  constexpr int kUnits = Lanes::kUnitsPerLane;
  constexpr bool kHf = kRounding == Rounding::kHf;
  constexpr bool kNeox = kLayout == Layout::kNeox;
  const qk_norm_rope::Params& r = p.rope;
  const int lane = threadIdx.x % Lanes::kLanes;
  const int group = threadIdx.x / Lanes::kLanes;
  const bool active = row < rows;  // row < 2^31 + a block's rows (the policy)
  const uint32_t heads = r.num_q_heads + 2 * r.num_kv_heads;  // q's, k's and v's
  const uint32_t row_token = div.heads.divide(row);
  const int64_t token = active ? row_token : 0;
  const int head = active ? static_cast<int>(row - row_token * heads) : 0;
  const int kv_head = head - r.num_q_heads;  // k's head (< Hk), then v's (>= Hk)
  const bool is_v = kv_head >= r.num_kv_heads;
  const bool is_k = kv_head >= 0 && !is_v;
  const LaneUnits<kUnits> u = lane_units<kUnits, kVecElems>(lane, Lanes::kLanes, is_v ? 0 : r.rope_dim, kNeox);

  // 0. the block's first rows, while the previous kernel still runs: the group of each token's
  // first head (a q row) warms the token's slot, first (as rung 3: the cos/sin warming behind it
  // waits for a position read), then qk_norm_rope's warming of the weights and each token's cos/sin
  if (first) {
    if (active && head == 0) warm_l2(static_cast<const char*>(p.slot_mapping) + token * (p.slots_are_int64 ? 8 : 4));
    qk_norm_rope::tuned::warm_call_tables<T, kHeadDim, WeightT, CosSinT>(r, active, static_cast<uint32_t>(token), head,
                                                                        group, u);
    after_prior_grids();  // nothing is read before the previous kernel's writes are visible
  }

  T* x = nullptr;  // 1. the row, and right behind it its tables and slot
  const void* w = nullptr;
  if (active && !is_v) {
    const qk_norm_rope::Row<T> at = qk_norm_rope::row_at<T>(r, token, head);
    x = at.x;
    w = at.w;
  } else if (active) {
    x = const_cast<T*>(static_cast<const T*>(p.v)) + token * p.v_token_stride + (kv_head - r.num_kv_heads) * p.v_head_stride;
  }
  Vec<T> a[kUnits], b[kUnits];
#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    a[s] = active ? load_vec<T>(x + u.col_a[s]) : zero_vec<T>();
    b[s] = active ? load_vec<T>(x + u.col_b[s]) : zero_vec<T>();
  }
  const int64_t slot = active && (is_k || is_v) ? slot_of(p, token) : -1;
  const int64_t cache = active && !is_v ? qk_norm_rope::cache_row(r, token) : -1;
  constexpr int kWeightVecs = kVecElems / Vec<WeightT>::kElems;  // the weights as loaded: widened at their use
  Vec<WeightT> wa[kUnits][kWeightVecs], wb[kUnits][kWeightVecs];
  float cos[kUnits][kVecElems] = {}, sin[kUnits][kVecElems] = {};
  if (active && !is_v) {
#pragma unroll
    for (int s = 0; s < kUnits; ++s) {
      load_table_vecs<WeightT>(w, u.col_a[s], wa[s]);
      load_table_vecs<WeightT>(w, u.col_b[s], wb[s]);
      if (u.rotates[s]) unit_cos_sin<T, kHf, CosSinT, kVecElems>(r, cache, u.unit[s], cos[s], sin[s]);
    }
  }
  if constexpr (kWarmsNextRow<T, kCache>) {  // the walk's next row, warmed while this one is in flight
    if (next < rows) warm_row<T, kHeadDim>(p, div, next);
  }

  if (is_v && slot >= 0) {  // 2v. the v row into its slot, before the sum (which it only joins)
    C* dst = slot_row<C>(p.v_cache, slot, p, div, kv_head - r.num_kv_heads);
    const auto scale = store_scale<kStoresByInverse<T, kLayout>, kCache>(p.v_cache);
#pragma unroll
    for (int s = 0; s < kUnits; ++s) {  // a v unit is two neighbouring vectors: one store
      store_cache<T, kCache, 2>(dst + u.col_a[s], {a[s], b[s]}, scale);
    }
  }
  float xa[kUnits][kVecElems], xb[kUnits][kVecElems];  // 3. the sum of squares (v rows add nothing)
  float sum_sq = 0.f;
#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    unpack<T>(a[s], xa[s]);
    unpack<T>(b[s], xb[s]);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) sum_sq += is_v ? 0.f : xa[s][j] * xa[s][j] + xb[s][j] * xb[s][j];
  }
  const float rstd = rstd_from(warp_sum<Lanes::kLanes>(sum_sq), static_cast<float>(kHeadDim), r.eps);
  if (!active || is_v) return;

  C* k_dst = slot >= 0 ? slot_row<C>(p.k_cache, slot, p, div, kv_head) : nullptr;  // 4. per unit
  const auto k_scale = k_dst != nullptr ? store_scale<kStoresByInverse<T, kLayout>, kCache>(p.k_cache)
                                        : no_store_scale<kStoresByInverse<T, kLayout>>();
#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    float w_a[kVecElems], w_b[kVecElems], ya[kVecElems], yb[kVecElems];
    widen(wa[s], w_a);
    widen(wb[s], w_b);
    norm_rope_unit<T, kHf, kNeox>(xa[s], xb[s], w_a, w_b, cos[s], sin[s], u.rotates[s], rstd, r.weight_offset, ya, yb);
    const Vec<T> ra = pack<T>(ya), rb = pack<T>(yb);
    store_vec<T>(x + u.col_a[s], ra);
    store_vec<T>(x + u.col_b[s], rb);
    if (k_dst == nullptr) continue;
    if (kNeox && u.rotates[s]) {  // a NeoX unit's vectors lie rope_dim / 2 apart
      store_cache<T, kCache, 1>(k_dst + u.col_a[s], {ra}, k_scale);
      store_cache<T, kCache, 1>(k_dst + u.col_b[s], {rb}, k_scale);
    } else {  // neighbours: one store
      store_cache<T, kCache, 2>(k_dst + u.col_a[s], {ra, rb}, k_scale);
    }
  }
}

template <typename T, Rounding kRounding, int kHeadDim, Layout kLayout, TableDtype kWeights, TableDtype kCosSin,
          CacheDtype kCache>
__global__ void __launch_bounds__(kThreadsPerBlock) qk_norm_rope_cache_tuned_kernel(Params p, int64_t rows, Divisors div) {
  constexpr int kRowsPerBlock = kThreadsPerBlock / PairLanes<T, kHeadDim>::kLanes;
  const uint32_t group = threadIdx.x / PairLanes<T, kHeadDim>::kLanes;
  const uint32_t first_base = blockIdx.x * kRowsPerBlock;
  if constexpr (!walks(kCache)) {
    one_row<T, kRounding, kHeadDim, kLayout, kWeights, kCosSin, kCache>(p, rows, div, first_base + group, true, static_cast<uint32_t>(rows));
  } else {
    // Every lane group of a block makes the same trips, so each joins its shuffles on every trip.
    const uint32_t grid_rows = gridDim.x * kRowsPerBlock;  // the resident blocks' rows: < 2^31
    for (uint32_t base = first_base; base < rows; base += grid_rows) {
      one_row<T, kRounding, kHeadDim, kLayout, kWeights, kCosSin, kCache>(p, rows, div, base + group, base == first_base,
                                                                           base + grid_rows + group);
    }
  }
}

// ---- the launcher (host) ---------------------------------------------------------------------
// What the policy reads of a call: Params and the pointers' alignment.
template <typename T>
inline Call call_of(const Params& p, DType dtype, Rounding rounding) {
  constexpr int kVecElems = Vec<T>::kElems;
  const qk_norm_rope::Params& r = p.rope;
  const bool rows_are_vectors = is_aligned(r.q, kVecBytes) && is_aligned(r.k, kVecBytes) && is_aligned(p.v, kVecBytes) &&
                                r.q_token_stride % kVecElems == 0 && r.q_head_stride % kVecElems == 0 &&
                                r.k_token_stride % kVecElems == 0 && r.k_head_stride % kVecElems == 0 &&
                                p.v_token_stride % kVecElems == 0 && p.v_head_stride % kVecElems == 0;
  const bool tables_are_vectors = is_aligned(r.q_weight, kVecBytes) && is_aligned(r.k_weight, kVecBytes) &&
                                  is_aligned(r.cos_sin_cache, kVecBytes);
  return {dtype,
          rounding,
          r.num_tokens,
          r.num_q_heads,
          r.num_kv_heads,
          r.head_dim,
          r.rope_dim,
          r.is_neox ? Layout::kNeox : Layout::kInterleaved,
          r.weight_is_fp32 ? TableDtype::kFloat32 : TableDtype::kActivation,
          r.cache_is_fp32 ? TableDtype::kFloat32 : TableDtype::kActivation,
          p.cache_dtype,
          rows_are_vectors,
          tables_are_vectors,
          cache_is_vectors<T>(p.k_cache) && cache_is_vectors<T>(p.v_cache),
          p.num_slots};
}

// Calls visit.template operator()<kKernel>() with the one-pass kernel `kernel` names (its head_dim
// one of kVectorHeadDims); returns whether it was one.
template <typename T, Rounding kRounding, typename Visit>
inline bool with_kernel(const Kernel& kernel, Visit&& visit) {
  return qk_norm_rope::with_head_dim<kVectorHeadDims[0], kVectorHeadDims[1], kVectorHeadDims[2]>(
      kernel.head_dim, [&]<int kHeadDim>() {
        const auto with_cache = [&]<Layout kLayout, TableDtype kWeights, TableDtype kCosSin>() {
          if (kernel.cache == CacheDtype::kFp8E4m3) {
            return visit.template operator()<
                qk_norm_rope_cache_tuned_kernel<T, kRounding, kHeadDim, kLayout, kWeights, kCosSin, CacheDtype::kFp8E4m3>>();
          }
          visit.template operator()<
              qk_norm_rope_cache_tuned_kernel<T, kRounding, kHeadDim, kLayout, kWeights, kCosSin, CacheDtype::kActivation>>();
        };
        const auto with_cos_sin = [&]<Layout kLayout, TableDtype kWeights>() {
          if (kernel.cos_sin == TableDtype::kFloat32) return with_cache.template operator()<kLayout, kWeights, TableDtype::kFloat32>();
          with_cache.template operator()<kLayout, kWeights, TableDtype::kActivation>();
        };
        const auto with_weights = [&]<Layout kLayout>() {
          if (kernel.weights == TableDtype::kFloat32) return with_cos_sin.template operator()<kLayout, TableDtype::kFloat32>();
          with_cos_sin.template operator()<kLayout, TableDtype::kActivation>();
        };
        if (kernel.layout == Layout::kNeox) return with_weights.template operator()<Layout::kNeox>();
        with_weights.template operator()<Layout::kInterleaved>();
      });
}

// Resident blocks per SM of the one-pass kernel `kernel` names, on the current GPU (cached per
// kernel and device by persistent_grid_limit).
template <typename T, Rounding kRounding>
inline int blocks_per_sm(const Kernel& kernel) {
  int limit = 0;
  with_kernel<T, kRounding>(kernel, [&]<auto kKernel>() { limit = persistent_grid_limit<kKernel>(kernel.block); });
  const int sms = qk_norm_rope::tuned::multiprocessors();
  return sms > 0 ? limit / sms : 0;
}

template <DType kDType, Rounding kRounding>
inline Plan plan_of(const Params& p) {
  using T = cookbook::Storage<kDType>;
  return plan(call_of<T>(p, kDType, kRounding), qk_norm_rope::tuned::multiprocessors(),
              [](const Kernel& kernel) { return blocks_per_sm<T, kRounding>(kernel); });
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  using T = cookbook::Storage<kDType>;
  if (total_rows(p) == 0) return cudaSuccess;
  const Plan chosen = plan_of<kDType, kRounding>(p);
  if (chosen.kernel.name == KernelName::kSplit) return copy::launch_split<kDType, kRounding>(p, stream);
  const Divisors div{FastDivisor(static_cast<uint32_t>(heads_per_token(p))), FastDivisor(static_cast<uint32_t>(p.block_size))};
  with_kernel<T, kRounding>(chosen.kernel, [&]<auto kKernel>() {
    launch_kernel(chosen.programmatic, kKernel, dim3(static_cast<unsigned>(chosen.grid)), dim3(chosen.block),
                  static_cast<size_t>(chosen.shared_bytes), stream, p, chosen.rows, div);
  });
  return cudaGetLastError();
}

// What `launch` would run for `p` on the current GPU, as key=value lines, with the kernel's
// registers as the driver reports them: `cookbook explain` on a GPU. Launches nothing.
template <DType kDType, Rounding kRounding>
std::string explain(const Params& p) {
  using T = cookbook::Storage<kDType>;
  const Plan chosen = plan_of<kDType, kRounding>(p);
  std::string text = describe(chosen);
  cudaFuncAttributes attributes{};
  bool found = false;
  if (chosen.kernel.name == KernelName::kSplit) {
    with_cache_dtype(p, [&]<CacheDtype kCache>() {
      found = cudaFuncGetAttributes(&attributes, copy::qk_norm_rope_cache_copy_kernel<T, kCache>) == cudaSuccess;
    });
  } else {
    with_kernel<T, kRounding>(chosen.kernel, [&]<auto kKernel>() {
      found = cudaFuncGetAttributes(&attributes, kKernel) == cudaSuccess;
    });
  }
  if (found && chosen.rows > 0) text += Facts{}.add("registers", attributes.numRegs).text();
  return text;
}

}  // namespace cookbook::qk_norm_rope_cache::tuned
