// tuned: v6's kernel with streaming accesses, a multiply-high row division and the next wave's rows warmed, its shape chosen per call by one named policy
//
// What `backend="cuda"` and `"auto"` run. The kernel is rung 6's (a grid of all rows, a lane
// group per row, a programmatic launch whose first block warms the weights), with what the
// ladder leaves out because it teaches no new idea but every call gains from it:
//   * x read and written with the evict-first policy (load/store_vec_streaming): each byte of a
//     row is touched once, and L2 is better kept for the weights and the rows warmed ahead;
//   * the row -> (token, head) division as a multiply-high by a magic number (FastDivisor),
//     computed once per launch on the host: every lane of a row's group repeats that division;
//   * heads of a whole number of vectors that is not a power of two (80, 96, 160, 192) on the
//     vector path, in padded lane groups (LaneGroup::kPadded), instead of rung 2's warp per row.
// and two choices that depend on the call's size, made by `choose_policy` on the host:
//   * vectors per lane: 1 in calls smaller than one wave of one-vector blocks (the lanes' serial
//     work is the time there), 2 from a wave up (rung 6's trade);
//   * warm ahead: in calls of more than one and at most kMaxWarmWaves waves of blocks, each lane
//     group warms into L2 the row one wave ahead of its own once its own loads are issued, so the
//     block that takes that row finds it in L2; at many waves the blocks in flight alone keep
//     DRAM busy, and a second request per line costs more than it saves.
// docs/qk_norm.md gives the measurements behind each of these (docs/results/ has the pages).
//
// grid.x: ceil(rows / kRowsPerBlock); lane group -> row, as in rungs 4-6. Rows are 32-bit in the
// kernel: a call of more rows is launched in token ranges of fewer than 2^32 rows each.
#pragma once

#include "qk_norm/rows.cuh"
#include "qk_norm/v2_warp_per_row.cuh"  // rows off the vector path

namespace cookbook::qk_norm::tuned {

constexpr int kThreadsPerBlock = 256;
constexpr int kNumWeights = 2;  // q's and k's
static_assert(kThreadsPerBlock % kWarpSize == 0, "whole warps per block");

// The policy's choices, as the kernel's template arguments take them.
enum class Warm : int { kWeights, kWeightsAndNextWave };  // what the kernel warms into L2
enum class WeightLoad : int { kPerElement, kPerVector };   // kPerVector: both weights 16-byte aligned

template <typename T, Rounding kRounding, int kHeadDim, int kVecsPerLane, Warm kWarm, WeightLoad kWeightLoad>
__global__ void __launch_bounds__(kThreadsPerBlock)
    qk_norm_tuned_kernel(Params p, uint32_t rows, FastDivisor heads_divisor, uint32_t rows_ahead) {
  using Group = LaneGroup<T, kHeadDim, kVecsPerLane>;
  constexpr int kRowsPerBlock = kThreadsPerBlock / Group::kLanes;
  constexpr bool kHf = kRounding == Rounding::kHf;
  static_assert(kRowsPerBlock >= kNumWeights, "block 0 has a lane group per weight");
  const int lane = threadIdx.x % Group::kLanes;
  const int group = threadIdx.x / Group::kLanes;
  const uint32_t heads = static_cast<uint32_t>(p.num_q_heads + p.num_kv_heads);
  const uint32_t row = blockIdx.x * kRowsPerBlock + group;
  const bool active = row < rows;  // a group past the last row still joins its shuffles, on zeros
  Row<T> r;
  if (active) {
    const uint32_t token = heads_divisor.divide(row);
    r = row_at<T>(p, token, static_cast<int>(row - token * heads));
  }
  if (blockIdx.x == 0 && group < kNumWeights) {  // while the previous kernel still runs
    const void* w = group == 0 ? p.q_weight : p.k_weight;
    const int weight_bytes = p.weight_is_fp32 ? static_cast<int>(sizeof(float)) : static_cast<int>(sizeof(T));
#pragma unroll
    for (int i = 0; i < Group::kVecsPerLane; ++i) {
      if (Group::holds(lane, i)) warm_l2(static_cast<const char*>(w) + Group::column(lane, i) * weight_bytes);
    }
  }
  after_prior_grids();  // nothing is read before the previous kernel's writes are visible

  Vec<T> packed[Group::kVecsPerLane];  // 1. the row
#pragma unroll
  for (int i = 0; i < Group::kVecsPerLane; ++i) {
    packed[i] = active && Group::holds(lane, i) ? load_vec_streaming<T>(r.x + Group::column(lane, i)) : zero_vec<T>();
  }
  if constexpr (kWarm == Warm::kWeightsAndNextWave) {  // 2. the row a wave ahead, one request per L2 line
    if (active && rows_ahead < rows - row) {
      const uint32_t ahead = row + rows_ahead;
      const uint32_t token = heads_divisor.divide(ahead);
      const Row<T> next = row_at<T>(p, token, static_cast<int>(ahead - token * heads));
#pragma unroll
      for (int i = 0; i < Group::kVecsPerLane; ++i) {
        const int column = Group::column(lane, i);
        if (Group::holds(lane, i) && column % kL2LineElems<T> == 0) warm_l2(next.x + column);
      }
    }
  }
  float w[Group::kVecsPerLane][Group::kVecElems] = {};  // 3. its weight, while the row is in flight
  if (active) {
#pragma unroll
    for (int i = 0; i < Group::kVecsPerLane; ++i) {
      if (Group::holds(lane, i)) load_weight_vector<T, kRounding>(p, r.w, Group::column(lane, i), kWeightLoad == WeightLoad::kPerVector, w[i]);
    }
  }
  float x[Group::kVecsPerLane][Group::kVecElems];  // 4. sum, rstd, normalize, store
  float sum_sq = 0.f;
#pragma unroll
  for (int i = 0; i < Group::kVecsPerLane; ++i) {
    unpack<T>(packed[i], x[i]);
#pragma unroll
    for (int j = 0; j < Group::kVecElems; ++j) sum_sq += x[i][j] * x[i][j];
  }
  const float rstd = rstd_from(warp_sum<Group::kLanes>(sum_sq), static_cast<float>(kHeadDim), p.eps);
  if (active) {
#pragma unroll
    for (int i = 0; i < Group::kVecsPerLane; ++i) {
      float y[Group::kVecElems];
#pragma unroll
      for (int j = 0; j < Group::kVecElems; ++j) y[j] = normalized<T, kHf>(x[i][j], rstd, w[i][j]);
      if (Group::holds(lane, i)) store_vec_streaming<T>(r.x + Group::column(lane, i), pack<T>(y));
    }
  }
}

// ---- the policy (host) --------------------------------------------------------------------------
// Sizes are in waves: the rows one wave of a kernel's blocks covers (its blocks resident at once
// on this GPU, times its rows per block).
constexpr int64_t kTwoVectorsFromWaves = 1;  // of one-vector blocks
constexpr int64_t kMaxWarmWaves = 8;
static_assert(kMaxWarmWaves >= 2, "warming a wave ahead needs a second wave");

// What the policy picks for one call.
struct Policy {
  int vecs_per_lane;     // the fewest 16-byte vectors a lane holds (LaneGroup's kMinVecsPerLane)
  bool warm_next_wave;   // each lane group warms into L2 the row one wave of blocks ahead
  uint32_t rows_ahead;   // with warm_next_wave: the rows of one wave of blocks
  bool weight_vectors;   // both weights 16-byte aligned: one load per vector, not per element
};

// The choices for a call of `rows` rows, given the rows of one wave of one-vector blocks and of
// two-vector blocks, and whether both weights are 16-byte aligned.
inline Policy choose_policy(int64_t rows, int64_t one_vector_wave, int64_t two_vector_wave, bool weight_vectors) {
  Policy policy{};
  policy.vecs_per_lane = rows >= kTwoVectorsFromWaves * one_vector_wave ? 2 : 1;
  const int64_t wave = policy.vecs_per_lane == 2 ? two_vector_wave : one_vector_wave;
  policy.warm_next_wave = rows > wave && rows <= kMaxWarmWaves * wave;
  policy.rows_ahead = policy.warm_next_wave ? static_cast<uint32_t>(wave) : 0;
  policy.weight_vectors = weight_vectors;
  return policy;
}

// The rows one wave of blocks of kernel covers: blocks resident at once (all SMs) x rows per block.
template <auto kKernel, int kRowsPerBlock>
inline int64_t wave_rows() {
  return static_cast<int64_t>(persistent_grid_limit<kKernel>(kThreadsPerBlock)) * kRowsPerBlock;
}

// Calls launch.template operator()<kWarm, kWeightLoad>() for the policy's choices.
template <typename Launch>
inline void with_choices(const Policy& policy, Launch&& launch) {
  if (policy.warm_next_wave) {
    if (policy.weight_vectors) {
      launch.template operator()<Warm::kWeightsAndNextWave, WeightLoad::kPerVector>();
    } else {
      launch.template operator()<Warm::kWeightsAndNextWave, WeightLoad::kPerElement>();
    }
  } else if (policy.weight_vectors) {
    launch.template operator()<Warm::kWeights, WeightLoad::kPerVector>();
  } else {
    launch.template operator()<Warm::kWeights, WeightLoad::kPerElement>();
  }
}

template <typename T, Rounding kRounding, int kHeadDim>
inline void launch_vectors(const Params& p, uint32_t rows, cudaStream_t stream) {
  using One = LaneGroup<T, kHeadDim, 1>;
  using Two = LaneGroup<T, kHeadDim, 2>;
  // At heads of two or more vectors per lane of a whole warp (512 bf16 elements and up) the two
  // shapes are the same kernel: only the one-vector one is compiled.
  constexpr bool kTwoDiffers = Two::kLanes != One::kLanes;
  constexpr int kOneRows = kThreadsPerBlock / One::kLanes, kTwoRows = kThreadsPerBlock / Two::kLanes;
  constexpr auto kOneKernel = qk_norm_tuned_kernel<T, kRounding, kHeadDim, 1, Warm::kWeightsAndNextWave, WeightLoad::kPerVector>;
  constexpr auto kTwoKernel = qk_norm_tuned_kernel<T, kRounding, kHeadDim, 2, Warm::kWeightsAndNextWave, WeightLoad::kPerVector>;
  const int64_t one_wave = wave_rows<kOneKernel, kOneRows>();
  const int64_t two_wave = kTwoDiffers ? wave_rows<kTwoKernel, kTwoRows>() : one_wave;
  const bool weight_vectors = is_aligned(p.q_weight, kVecBytes) && is_aligned(p.k_weight, kVecBytes);
  const Policy policy = choose_policy(rows, one_wave, two_wave, weight_vectors);
  const FastDivisor heads_divisor(static_cast<uint32_t>(p.num_q_heads + p.num_kv_heads));
  auto launch_with = [&]<int kVecsPerLane>() {
    constexpr int kRowsPerBlock = kThreadsPerBlock / LaneGroup<T, kHeadDim, kVecsPerLane>::kLanes;
    const auto blocks = static_cast<unsigned>((int64_t{rows} + kRowsPerBlock - 1) / kRowsPerBlock);
    with_choices(policy, [&]<Warm kWarm, WeightLoad kWeightLoad>() {
      launch_kernel(/*programmatic=*/true, qk_norm_tuned_kernel<T, kRounding, kHeadDim, kVecsPerLane, kWarm, kWeightLoad>,
                    dim3(blocks), dim3(kThreadsPerBlock), 0, stream, p, rows, heads_divisor, policy.rows_ahead);
    });
  };
  if constexpr (kTwoDiffers) {
    if (policy.vecs_per_lane == 2) return launch_with.template operator()<2>();
  }
  launch_with.template operator()<1>();
}

// Calls launch_range(range, rows) on consecutive token ranges of `p` of at most kMaxRows rows each
// (q and k advanced to each range's first token): one range for any call that fits in memory.
constexpr int64_t kMaxRows = UINT32_MAX;

template <typename T, typename LaunchRange>
inline void for_each_token_range(const Params& p, LaunchRange&& launch_range) {
  const int64_t heads = p.num_q_heads + p.num_kv_heads;
  const int64_t tokens_per_range = kMaxRows / heads;
  for (int64_t first = 0; first < p.num_tokens; first += tokens_per_range) {
    Params range = p;
    range.num_tokens = p.num_tokens - first < tokens_per_range ? p.num_tokens - first : tokens_per_range;
    range.q = static_cast<T*>(p.q) + first * p.q_token_stride;
    range.k = static_cast<T*>(p.k) + first * p.k_token_stride;
    launch_range(range, total_rows(range));
  }
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  using T = Storage<kDType>;
  if (total_rows(p) == 0) return cudaSuccess;
  for_each_token_range<T>(p, [&](const Params& range, int64_t rows) {
    const bool on_vectors = rows_are_vectors<T>(range) &&
                            with_head_dim<64, 128, 256, 512, 1024, 80, 96, 160, 192>(range.head_dim, [&]<int kHeadDim>() {
                              launch_vectors<T, kRounding, kHeadDim>(range, static_cast<uint32_t>(rows), stream);
                            });
    if (!on_vectors) v2::launch_rows<T, kRounding>(range, rows, stream);
  });
  return cudaGetLastError();
}

}  // namespace cookbook::qk_norm::tuned
