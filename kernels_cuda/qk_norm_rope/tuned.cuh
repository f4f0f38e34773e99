// tuned: v6's kernel at decode, v7's walk at prefill (else a walk by the launcher's steps), streaming accesses, chosen per call by one named policy
//
// What `backend="cuda"` and `"auto"` run. One kernel template, compiled per dtype, rounding,
// head_dim, rope layout and the tables' storage, in three walks (policy.h says which runs when):
//   * Walk::kOneRow (rung 6's kernel): one row per lane group; before the programmatic wait the weights and
//     each token's position and cos/sin run are warmed into L2, each line by one lane group; after
//     it a lane reads its row's tables into registers together with the row;
//   * Walk::kWholeTokens (rung 7's walk): a persistent grid of whole tokens per step; each lane group
//     keeps one head and reads its weight once, before the walk;
//   * Walk::kSteps: the persistent grid of the resident blocks, (token, head) advanced by the
//     launcher's steps, the row's weight and cos/sin read after the sum.
// With what the ladder leaves out because it teaches no new idea but every call gains from it:
//   * x read and written with the evict-first policy (load/store_vec_streaming), the tables
//     through the read-only path: each byte of x is touched once;
//   * the first row's (token, head) by a multiply-high (FastDivisor), no division on the device;
//   * the fused order's scale as one fma per element: x * (w * rstd + weight_offset * rstd).
// Calls off the vector path run rung 2's warp per row.
//
// grid.x: the plan's; lane group -> row (a two-vector unit per lane slot: PairLanes in rows.cuh).
#pragma once

#include <string>
#include <type_traits>

#include "qk_norm_rope/policy.h"
#include "qk_norm_rope/rows.cuh"
#include "qk_norm_rope/v2_one_pass_warp_per_row.cuh"  // calls off the vector path

namespace cookbook::qk_norm_rope::tuned {

static_assert(kWarpLanes == kWarpSize && kVectorBytes == kVecBytes, "the policy reasons in the kernels' sizes");
static_assert(v2::kWarpsPerBlock == kWarpPerRowWarps, "the policy describes rung 2's block as it is");
static_assert(sizeof(kVectorHeadDims) / sizeof(kVectorHeadDims[0]) == 3, "with_kernel lists every compiled head_dim");

// A table's element type: the activation dtype T or float32.
template <typename T, TableDtype kDtype>
using TableType = std::conditional_t<kDtype == TableDtype::kFloat32, float, T>;

// A walk's steps, from the launcher: the heads of a token (for the first row's multiply-high) and
// the grid's rows in whole tokens and heads.
struct Steps {
  FastDivisor heads_divisor;
  int64_t token_step = 0;
  int head_step = 0;
};

template <typename T, int kHeadDim>
using Lanes = PairLanes<T, kHeadDim>;

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
    const Row<T> at = row_at<T>(p, token, head);
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

// Where finish_row takes a row's weights and cos/sin from, unit by unit. The steps walk reads them
// from memory once the row's sum is done (TablesFromMemory: nothing held across the sum, so the
// walk keeps its register count); the one-row kernel reads them with the row (TablesInRegisters),
// so they arrive while x is still in flight; the whole-token walk holds its weights
// (TablesHeldWeights) and reads cos/sin after the sum.
template <typename T, int kHeadDim, bool kHf, typename WeightT, typename CacheT>
struct TablesFromMemory {
  static constexpr int kUnits = Lanes<T, kHeadDim>::kUnitsPerLane;
  static constexpr int kVecElems = Lanes<T, kHeadDim>::kVecElems;
  const Params& p;
  const LoadedRow<T, kUnits>& r;
  const LaneUnits<kUnits>& u;

  __device__ __forceinline__ void weights(int s, float (&wa)[kVecElems], float (&wb)[kVecElems]) const {
    load_table<WeightT, kVecElems>(r.w, u.col_a[s], wa);
    load_table<WeightT, kVecElems>(r.w, u.col_b[s], wb);
  }
  __device__ __forceinline__ void cos_sin(int s, float (&cos)[kVecElems], float (&sin)[kVecElems]) const {
    unit_cos_sin<T, kHf, CacheT, kVecElems>(p, r.cache, u.unit[s], cos, sin);
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
  static constexpr int kUnits = Lanes<T, kHeadDim>::kUnitsPerLane;
  static constexpr int kVecElems = Lanes<T, kHeadDim>::kVecElems;
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
template <typename T, int kHeadDim, bool kHf, typename WeightT, typename CacheT>
__device__ __forceinline__ TablesInRegisters<T, kHeadDim> load_row_tables(
    const Params& p, const LoadedRow<T, Lanes<T, kHeadDim>::kUnitsPerLane>& r,
    const LaneUnits<Lanes<T, kHeadDim>::kUnitsPerLane>& u) {
  const TablesFromMemory<T, kHeadDim, kHf, WeightT, CacheT> memory{p, r, u};
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

// The whole-token walk's tables: TablesFromMemory's cos/sin, the weights from registers where the
// walk read them once (its lane group keeps one head, so one tensor, for the whole walk).
template <typename T, int kHeadDim, bool kHf, typename WeightT, typename CacheT>
struct TablesHeldWeights : TablesFromMemory<T, kHeadDim, kHf, WeightT, CacheT> {
  using Base = TablesFromMemory<T, kHeadDim, kHf, WeightT, CacheT>;
  const float (&w_a)[Base::kUnits][Base::kVecElems];
  const float (&w_b)[Base::kUnits][Base::kVecElems];

  __device__ __forceinline__ void weights(int s, float (&a)[Base::kVecElems], float (&b)[Base::kVecElems]) const {
    held_unit(w_a, s, a);
    held_unit(w_b, s, b);
  }
};

// Normalizes, rotates and stores one loaded row, its tables taken from `tables`. Every lane of
// the group calls it (the sum is a group shuffle); lanes of a row past the end stop after the sum.
template <typename T, int kHeadDim, bool kHf, Layout kLayout, typename Tables>
__device__ __forceinline__ void finish_row(const Params& p, const LoadedRow<T, Lanes<T, kHeadDim>::kUnitsPerLane>& r,
                                           const LaneUnits<Lanes<T, kHeadDim>::kUnitsPerLane>& u,
                                           const Tables& tables) {
  using L = Lanes<T, kHeadDim>;
  constexpr int kVecElems = L::kVecElems;
  constexpr int kUnits = L::kUnitsPerLane;
  float xa[kUnits][kVecElems], xb[kUnits][kVecElems];
  float sum_sq = 0.f;
#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    unpack<T>(r.a[s], xa[s]);
    unpack<T>(r.b[s], xb[s]);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) sum_sq += xa[s][j] * xa[s][j] + xb[s][j] * xb[s][j];
  }
  const float rstd = rstd_from(warp_sum<L::kLanes>(sum_sq), static_cast<float>(kHeadDim), p.eps);
  if (r.x == nullptr) return;
  const float rstd_offset = rstd * p.weight_offset;

#pragma unroll
  for (int s = 0; s < kUnits; ++s) {
    float wa[kVecElems], wb[kVecElems], na[kVecElems], nb[kVecElems];
    tables.weights(s, wa, wb);
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) {
      if constexpr (kHf) {
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
        if constexpr (kLayout == Layout::kNeox) {  // a = na[j], b = nb[j]: pair j
          ya[j] = rotated<T, kHf>(na[j], nb[j], true, cos[j], sin[j]);
          yb[j] = rotated<T, kHf>(nb[j], na[j], false, cos[j], sin[j]);
        } else {  // pairs (j, j ^ 1) inside each vector: pair j / 2 of a, kVecElems / 2 + j / 2 of b
          const bool first_member = j % 2 == 0;
          const int pair_a = j / 2, pair_b = kVecElems / 2 + j / 2;
          ya[j] = rotated<T, kHf>(na[j], na[j ^ 1], first_member, cos[pair_a], sin[pair_a]);
          yb[j] = rotated<T, kHf>(nb[j], nb[j ^ 1], first_member, cos[pair_b], sin[pair_b]);
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

// The persistent walks: a lane group's first row is block * groups + group (< 2^32: the grid is
// at most the resident blocks), split into (token, head) by the launcher's multiply-high; each
// step then adds the launcher's steps. kHeldWeights (Walk::kWholeTokens): the steps are whole
// tokens (steps.head_step == 0), so the group keeps its first row's head and reads its weight once.
template <typename T, int kHeadDim, bool kHf, Layout kLayout, typename WeightT, typename CacheT, bool kHeldWeights>
__device__ __forceinline__ void walk_rows(const Params& p, int64_t rows, const Steps& steps) {
  using L = Lanes<T, kHeadDim>;
  constexpr int kUnits = L::kUnitsPerLane;
  constexpr int kRowsPerBlock = kThreadsPerBlock / L::kLanes;
  const int lane = threadIdx.x % L::kLanes;
  const int group = threadIdx.x / L::kLanes;
  const int heads = p.num_q_heads + p.num_kv_heads;
  const LaneUnits<kUnits> u = lane_units<kUnits, L::kVecElems>(lane, L::kLanes, p.rope_dim, kLayout == Layout::kNeox);

  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  const int64_t token_step = steps.token_step;
  const int head_step = steps.head_step;
  const uint32_t my_first_row = blockIdx.x * kRowsPerBlock + group;
  const uint32_t first_token = steps.heads_divisor.divide(my_first_row);
  int64_t token = first_token;
  int head = static_cast<int>(my_first_row - first_token * static_cast<uint32_t>(heads));

  float w_a[kUnits][L::kVecElems], w_b[kUnits][L::kVecElems];
  if constexpr (kHeldWeights) {
    const void* w = head < p.num_q_heads ? p.q_weight : p.k_weight;
#pragma unroll
    for (int s = 0; s < kUnits; ++s) {
      load_table<WeightT, L::kVecElems>(w, u.col_a[s], w_a[s]);
      load_table<WeightT, L::kVecElems>(w, u.col_b[s], w_b[s]);
    }
  }

  // `first` is uniform across the block, so every lane runs the same iterations.
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; first < rows; first += row_stride) {
    const LoadedRow<T, kUnits> r = load_row<T, kUnits>(p, first + group < rows, token, head, u);
    token += token_step;
    head += head_step;
    if (head >= heads) {
      head -= heads;
      ++token;
    }
    if constexpr (kHeldWeights) {
      const TablesHeldWeights<T, kHeadDim, kHf, WeightT, CacheT> tables{{p, r, u}, w_a, w_b};
      finish_row<T, kHeadDim, kHf, kLayout>(p, r, u, tables);
    } else {
      const TablesFromMemory<T, kHeadDim, kHf, WeightT, CacheT> tables{p, r, u};
      finish_row<T, kHeadDim, kHf, kLayout>(p, r, u, tables);
    }
  }
}

// Before the wait (Walk::kOneRow): the call's tables brought into L2 (warm_l2 in
// include/common.cuh says why this cannot make a later read stale), each line by one lane group
// of the call: the weights by block 0's first two groups, a token's position and cos/sin run by
// the group of its first head. The cos/sin run is aimed by a speculative read of the position:
// from L2 only (__ldcg leaves no L1 line that a read after the wait could hit), possibly stale,
// used for nothing but the prefetch addresses and kept inside the cache; load_row reads the
// position again after the wait.
template <typename T, int kHeadDim, typename WeightT, typename CacheT>
__device__ __forceinline__ void warm_call_tables(const Params& p, bool active, uint32_t token, int head, int group,
                                                 const LaneUnits<Lanes<T, kHeadDim>::kUnitsPerLane>& u) {
  using L = Lanes<T, kHeadDim>;
  static_assert(kThreadsPerBlock / L::kLanes >= kNumWeights, "block 0 has a lane group per weight");
  if (blockIdx.x == 0 && group < kNumWeights) {
    const WeightT* w = static_cast<const WeightT*>(group == 0 ? p.q_weight : p.k_weight);
#pragma unroll
    for (int s = 0; s < L::kUnitsPerLane; ++s) {
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
  for (int s = 0; s < L::kUnitsPerLane; ++s) {
    if (!u.rotates[s]) continue;
    warm_l2(cos_row + u.unit[s] * L::kVecElems);
    warm_l2(cos_row + p.rope_dim / 2 + u.unit[s] * L::kVecElems);
  }
}

// One row per lane group, where the call's rows fit in one trip of the grid: row = block * groups
// + group (< 2^32), its token found by the launcher's multiply-high. The call's tables are warmed
// before the wait, and the row's read into registers right after the row's loads.
template <typename T, int kHeadDim, bool kHf, Layout kLayout, typename WeightT, typename CacheT>
__device__ __forceinline__ void one_row(const Params& p, int64_t rows, const Steps& steps) {
  using L = Lanes<T, kHeadDim>;
  constexpr int kUnits = L::kUnitsPerLane;
  constexpr int kRowsPerBlock = kThreadsPerBlock / L::kLanes;
  const int lane = threadIdx.x % L::kLanes;
  const LaneUnits<kUnits> u = lane_units<kUnits, L::kVecElems>(lane, L::kLanes, p.rope_dim, kLayout == Layout::kNeox);
  const int group = threadIdx.x / L::kLanes;
  const uint32_t row = blockIdx.x * kRowsPerBlock + group;
  const uint32_t token = steps.heads_divisor.divide(row);
  const int head = static_cast<int>(row - token * static_cast<uint32_t>(p.num_q_heads + p.num_kv_heads));
  warm_call_tables<T, kHeadDim, WeightT, CacheT>(p, row < rows, token, head, group, u);  // while the previous kernel still runs
  after_prior_grids();
  const LoadedRow<T, kUnits> r = load_row<T, kUnits>(p, row < rows, token, head, u);
  const TablesInRegisters<T, kHeadDim> tables = load_row_tables<T, kHeadDim, kHf, WeightT, CacheT>(p, r, u);
  finish_row<T, kHeadDim, kHf, kLayout>(p, r, u, tables);  // idle groups too: whole shuffles
}

template <typename T, Rounding kRounding, int kHeadDim, Layout kLayout, TableDtype kWeights, TableDtype kCache, Walk kWalk>
__global__ void __launch_bounds__(kThreadsPerBlock) qk_norm_rope_tuned_kernel(Params p, int64_t rows, Steps steps) {
  constexpr bool kHf = kRounding == Rounding::kHf;
  using WeightT = TableType<T, kWeights>;
  using CacheT = TableType<T, kCache>;
  if constexpr (kWalk == Walk::kOneRow) {
    one_row<T, kHeadDim, kHf, kLayout, WeightT, CacheT>(p, rows, steps);  // warms, then waits
  } else {
    after_prior_grids();  // nothing is read before the previous kernel's writes are visible
    walk_rows<T, kHeadDim, kHf, kLayout, WeightT, CacheT, kWalk == Walk::kWholeTokens>(p, rows, steps);
  }
}

// ---- the launcher (host) ---------------------------------------------------------------------
// What the policy reads of a call: Params and the pointers' alignment.
template <typename T>
inline Call call_of(const Params& p, DType dtype, Rounding rounding) {
  constexpr int kVecElems = Vec<T>::kElems;
  const bool rows_are_vectors = is_aligned(p.q, kVecBytes) && is_aligned(p.k, kVecBytes) &&
                                p.q_token_stride % kVecElems == 0 && p.q_head_stride % kVecElems == 0 &&
                                p.k_token_stride % kVecElems == 0 && p.k_head_stride % kVecElems == 0;
  const bool tables_are_vectors = is_aligned(p.q_weight, kVecBytes) && is_aligned(p.k_weight, kVecBytes) &&
                                  is_aligned(p.cos_sin_cache, kVecBytes);
  return {dtype,
          rounding,
          p.num_tokens,
          p.num_q_heads,
          p.num_kv_heads,
          p.head_dim,
          p.rope_dim,
          p.is_neox ? Layout::kNeox : Layout::kInterleaved,
          p.weight_is_fp32 ? TableDtype::kFloat32 : TableDtype::kActivation,
          p.cache_is_fp32 ? TableDtype::kFloat32 : TableDtype::kActivation,
          rows_are_vectors,
          tables_are_vectors};
}

// Calls visit.template operator()<kKernel>() with the tuned kernel `kernel` names (its head_dim
// one of kVectorHeadDims); returns whether it was one.
template <typename T, Rounding kRounding, typename Visit>
inline bool with_kernel(const Kernel& kernel, Visit&& visit) {
  return with_head_dim<kVectorHeadDims[0], kVectorHeadDims[1], kVectorHeadDims[2]>(kernel.head_dim, [&]<int kHeadDim>() {
    const auto with_walk = [&]<Layout kLayout, TableDtype kWeights, TableDtype kCache>() {
      switch (kernel.walk) {
        case Walk::kOneRow:
          return visit.template operator()<qk_norm_rope_tuned_kernel<T, kRounding, kHeadDim, kLayout, kWeights, kCache, Walk::kOneRow>>();
        case Walk::kSteps:
          return visit.template operator()<qk_norm_rope_tuned_kernel<T, kRounding, kHeadDim, kLayout, kWeights, kCache, Walk::kSteps>>();
        case Walk::kWholeTokens:
          return visit.template operator()<qk_norm_rope_tuned_kernel<T, kRounding, kHeadDim, kLayout, kWeights, kCache, Walk::kWholeTokens>>();
      }
    };
    const auto with_cache = [&]<Layout kLayout, TableDtype kWeights>() {
      if (kernel.cache == TableDtype::kFloat32) return with_walk.template operator()<kLayout, kWeights, TableDtype::kFloat32>();
      with_walk.template operator()<kLayout, kWeights, TableDtype::kActivation>();
    };
    const auto with_weights = [&]<Layout kLayout>() {
      if (kernel.weights == TableDtype::kFloat32) return with_cache.template operator()<kLayout, TableDtype::kFloat32>();
      with_cache.template operator()<kLayout, TableDtype::kActivation>();
    };
    if (kernel.layout == Layout::kNeox) return with_weights.template operator()<Layout::kNeox>();
    with_weights.template operator()<Layout::kInterleaved>();
  });
}

// The current GPU's SMs, cached per device (the attribute query is not free on a hot path).
inline int multiprocessors() {
  static int cached[kMaxDevices] = {};
  int device = 0;
  cudaGetDevice(&device);
  if (device < kMaxDevices && cached[device] > 0) return cached[device];
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (device < kMaxDevices) cached[device] = sms;
  return sms;
}

// Resident blocks per SM of the tuned kernel `kernel` names, on the current GPU (cached per kernel
// and device by persistent_grid_limit).
template <typename T, Rounding kRounding>
inline int blocks_per_sm(const Kernel& kernel) {
  int limit = 0;
  with_kernel<T, kRounding>(kernel, [&]<auto kKernel>() { limit = persistent_grid_limit<kKernel>(kernel.block); });
  const int sms = multiprocessors();
  return sms > 0 ? limit / sms : 0;
}

template <DType kDType, Rounding kRounding>
inline Plan plan_of(const Params& p) {
  using T = cookbook::Storage<kDType>;
  return plan(call_of<T>(p, kDType, kRounding), multiprocessors(),
              [](const Kernel& kernel) { return blocks_per_sm<T, kRounding>(kernel); });
}

// Launches what `plan` says for the rows of `p`.
template <typename T, Rounding kRounding>
inline void launch_plan(const Plan& plan, const Params& p, cudaStream_t stream) {
  if (plan.kernel.name == KernelName::kWarpPerRow) return v2::launch_rows<T, kRounding>(p, plan.rows, stream);
  Steps steps;
  steps.heads_divisor = FastDivisor(static_cast<uint32_t>(p.num_q_heads + p.num_kv_heads));
  steps.token_step = plan.token_step;
  steps.head_step = plan.head_step;
  with_kernel<T, kRounding>(plan.kernel, [&]<auto kKernel>() {
    launch_kernel(plan.programmatic, kKernel, dim3(static_cast<unsigned>(plan.grid)), dim3(plan.block),
                  static_cast<size_t>(plan.shared_bytes), stream, p, plan.rows, steps);
  });
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  using T = cookbook::Storage<kDType>;
  if (total_rows(p) == 0) return cudaSuccess;
  launch_plan<T, kRounding>(plan_of<kDType, kRounding>(p), p, stream);
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
  if (chosen.kernel.name == KernelName::kWarpPerRow) {
    found = cudaFuncGetAttributes(&attributes, v2::qk_norm_rope_v2_kernel<T, kRounding>) == cudaSuccess;
  } else {
    with_kernel<T, kRounding>(chosen.kernel, [&]<auto kKernel>() {
      found = cudaFuncGetAttributes(&attributes, kKernel) == cudaSuccess;
    });
  }
  if (found && chosen.rows > 0) text += Facts{}.add("registers", attributes.numRegs).text();
  return text;
}

}  // namespace cookbook::qk_norm_rope::tuned
