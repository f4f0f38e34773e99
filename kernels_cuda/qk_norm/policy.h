// The tuned kernel's host policy: for one call, which kernel runs, with which template arguments,
// grid and block, and why. Plain C++ (no CUDA or torch header): the launcher (tuned.cuh) runs it
// before every launch, and `cookbook explain` runs the same code compiled for the host, on a
// machine without a GPU, with the kernels' resident blocks per SM computed from nvcc's report.
//
// Sizes are in waves: the rows one wave of a kernel's blocks covers (its blocks resident at once
// on this GPU, times its rows per block). Two choices depend on the call's size:
//   * vectors per lane: 1 in calls smaller than one wave of one-vector blocks (the lanes' serial
//     work is the time there), 2 from a wave up (rung 6's trade);
//   * warm ahead: in calls of more than one and at most kMaxWarmWaves waves, each lane group warms
//     into L2 the row one wave ahead of its own once its own loads are issued, so the block that
//     takes that row finds it in L2; at many waves the blocks in flight alone keep DRAM busy, and a
//     second request per line costs more than it saves.
// and one on the call's pointers: the weights are loaded as 16-byte vectors where both are
// 16-byte aligned. docs/qk_norm.md gives the measurement behind each choice.
#pragma once

#include <cstdint>
#include <string>

#include "include/dtype.h"
#include "include/plan.h"
#include "qk_norm/lanes.h"

namespace cookbook::qk_norm::tuned {

constexpr int kThreadsPerBlock = 256;
constexpr int kNumWeights = 2;  // q's and k's
static_assert(kThreadsPerBlock % kWarpSize == 0, "whole warps per block");

constexpr int64_t kTwoVectorsFromWaves = 1;  // of one-vector blocks
constexpr int64_t kMaxWarmWaves = 8;
static_assert(kMaxWarmWaves >= 2, "warming a wave ahead needs a second wave");

// The head_dims compiled for the vector path: powers of two, and heads of a whole number of
// vectors that is not a power of two, in padded lane groups. Any other runs rung 2's warp per row.
constexpr int kVectorHeadDims[] = {64, 128, 256, 512, 1024, 80, 96, 160, 192};

// Rows are 32-bit in the kernel: a call of more rows is launched in token ranges of fewer.
constexpr int64_t kMaxRows = UINT32_MAX;

// The policy's choices, as the kernel's template arguments take them.
enum class Warm : int { kWeights, kWeightsAndNextWave };  // what the kernel warms into L2
enum class WeightLoad : int { kPerElement, kPerVector };   // kPerVector: both weights 16-byte aligned

// What the policy reads of a call.
struct Call {
  DType dtype;
  Rounding rounding;
  int64_t num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  bool rows_are_vectors;     // every row of q and k starts on a 16-byte boundary
  bool weights_are_vectors;  // both weights start on a 16-byte boundary
};

// A kernel the plan can launch, with its template arguments.
enum class KernelName : int { kTuned, kWarpPerRow };

struct Kernel {
  KernelName name = KernelName::kTuned;
  DType dtype = DType::kBFloat16;
  Rounding rounding = Rounding::kFused;
  int head_dim = 0;       // kHeadDim (tuned kernel only)
  int vecs_per_lane = 0;  // kVecsPerLane: the fewest vectors a lane holds (tuned kernel only)
  Warm warm = Warm::kWeights;
  WeightLoad weight_load = WeightLoad::kPerElement;
  int block = kThreadsPerBlock;
};

// The rung-2 path's block: a warp per row (v2_warp_per_row.cuh keeps the same constant).
constexpr int kWarpPerRowWarps = 8;

// What the policy picks for one call, and the numbers that decided it.
struct Plan {
  Kernel kernel;
  int64_t rows = 0;          // of the launch (the first token range where there are several)
  int64_t token_ranges = 0;  // launches of at most kMaxRows rows each
  int64_t grid = 0;
  int block = 0;
  int lanes_per_row = 0;     // a lane group (tuned kernel); a warp (rung 2's path)
  int vecs_per_lane_held = 0;
  int rows_per_block = 0;
  bool programmatic = false;
  // The vector path's policy.
  int sms = 0;
  int one_vector_blocks_per_sm = 0;
  int two_vector_blocks_per_sm = 0;
  int64_t one_vector_wave = 0;  // rows
  int64_t two_vector_wave = 0;  // rows
  bool warm_next_wave = false;
  uint32_t rows_ahead = 0;      // with warm_next_wave: the rows of one wave of blocks
};

constexpr bool is_vector_head_dim(int head_dim) {
  for (int d : kVectorHeadDims) {
    if (d == head_dim) return true;
  }
  return false;
}

constexpr int vec_elems(DType dtype) { return kVecBytes / element_bytes(dtype); }

// The tuned kernel of `call` holding at least `vecs_per_lane` vectors per lane, warming `warm`.
inline Kernel tuned_kernel(const Call& call, int vecs_per_lane, Warm warm, WeightLoad weight_load) {
  return {KernelName::kTuned, call.dtype, call.rounding, call.head_dim, vecs_per_lane, warm, weight_load, kThreadsPerBlock};
}

// The plan of `call` on a GPU of `sms` SMs; blocks_per_sm(kernel) is how many blocks of `kernel`
// are resident at once on one SM (cudaOccupancyMaxActiveBlocksPerMultiprocessor on a GPU).
template <typename BlocksPerSm>
Plan plan(const Call& call, int sms, BlocksPerSm&& blocks_per_sm) {
  Plan plan{};
  const int64_t heads = call.num_q_heads + call.num_kv_heads;
  const int64_t tokens_per_range = heads > 0 ? kMaxRows / heads : 1;
  plan.token_ranges = call.num_tokens == 0 ? 0 : (call.num_tokens + tokens_per_range - 1) / tokens_per_range;
  plan.rows = (call.num_tokens < tokens_per_range ? call.num_tokens : tokens_per_range) * heads;
  plan.sms = sms;
  if (!call.rows_are_vectors || !is_vector_head_dim(call.head_dim)) {  // rung 2's warp per row
    plan.kernel = {KernelName::kWarpPerRow, call.dtype, call.rounding};
    plan.kernel.block = kWarpPerRowWarps * kWarpSize;
    plan.block = plan.kernel.block;
    plan.lanes_per_row = kWarpSize;
    plan.rows_per_block = kWarpPerRowWarps;
    plan.grid = (plan.rows + plan.rows_per_block - 1) / plan.rows_per_block;
    return plan;
  }
  // Waves are measured with the kernel that warms ahead and loads vectors, as compiled for the call.
  const LaneShape one = lane_shape(vec_elems(call.dtype), call.head_dim, 1);
  const LaneShape two = lane_shape(vec_elems(call.dtype), call.head_dim, 2);
  // At heads of two or more vectors per lane of a whole warp (512 bf16 elements and up) the two
  // shapes are the same kernel: only the one-vector one is compiled.
  const bool two_differs = two.lanes != one.lanes;
  const int one_rows = kThreadsPerBlock / one.lanes, two_rows = kThreadsPerBlock / two.lanes;
  plan.one_vector_blocks_per_sm = blocks_per_sm(tuned_kernel(call, 1, Warm::kWeightsAndNextWave, WeightLoad::kPerVector));
  plan.two_vector_blocks_per_sm =
      two_differs ? blocks_per_sm(tuned_kernel(call, 2, Warm::kWeightsAndNextWave, WeightLoad::kPerVector))
                  : plan.one_vector_blocks_per_sm;
  const auto wave_of = [&](int blocks_per_sm_, int rows_per_block) {
    return static_cast<int64_t>(sms) * (blocks_per_sm_ > 0 ? blocks_per_sm_ : 1) * rows_per_block;
  };
  plan.one_vector_wave = wave_of(plan.one_vector_blocks_per_sm, one_rows);
  plan.two_vector_wave = two_differs ? wave_of(plan.two_vector_blocks_per_sm, two_rows) : plan.one_vector_wave;

  const int vecs_per_lane = plan.rows >= kTwoVectorsFromWaves * plan.one_vector_wave ? 2 : 1;
  const int64_t wave = vecs_per_lane == 2 ? plan.two_vector_wave : plan.one_vector_wave;
  plan.warm_next_wave = plan.rows > wave && plan.rows <= kMaxWarmWaves * wave;
  plan.rows_ahead = plan.warm_next_wave ? static_cast<uint32_t>(wave) : 0;
  const int compiled_vecs = two_differs ? vecs_per_lane : 1;
  plan.kernel = tuned_kernel(call, compiled_vecs,
                             plan.warm_next_wave ? Warm::kWeightsAndNextWave : Warm::kWeights,
                             call.weights_are_vectors ? WeightLoad::kPerVector : WeightLoad::kPerElement);
  const LaneShape shape = compiled_vecs == 2 ? two : one;
  plan.lanes_per_row = shape.lanes;
  plan.vecs_per_lane_held = shape.vecs_per_lane;
  plan.rows_per_block = kThreadsPerBlock / shape.lanes;
  plan.block = kThreadsPerBlock;
  plan.grid = (plan.rows + plan.rows_per_block - 1) / plan.rows_per_block;
  plan.programmatic = true;
  return plan;
}

// The kernel's function name and its template arguments as nvcc's report prints them (enums as
// their values), comma-separated: how `cookbook explain` finds its registers off a GPU.
inline std::string kernel_function(const Kernel& kernel) {
  return kernel.name == KernelName::kTuned ? "cookbook::qk_norm::tuned::qk_norm_tuned_kernel"
                                           : "cookbook::qk_norm::v2::qk_norm_v2_kernel";
}

inline std::string template_values(const Kernel& kernel) {
  std::string values = std::string(storage_name(kernel.dtype)) + "," + std::to_string(static_cast<int>(kernel.rounding));
  if (kernel.name == KernelName::kTuned) {
    values += "," + std::to_string(kernel.head_dim) + "," + std::to_string(kernel.vecs_per_lane) + "," +
              std::to_string(static_cast<int>(kernel.warm)) + "," + std::to_string(static_cast<int>(kernel.weight_load));
  }
  return values;
}

inline std::string template_arguments(const Kernel& kernel) {
  std::string args = std::string("T=") + storage_name(kernel.dtype) + ", kRounding=" + rounding_name(kernel.rounding);
  if (kernel.name == KernelName::kTuned) {
    args += ", kHeadDim=" + std::to_string(kernel.head_dim) + ", kVecsPerLane=" + std::to_string(kernel.vecs_per_lane) +
            ", kWarm=" + (kernel.warm == Warm::kWeights ? "Warm::kWeights" : "Warm::kWeightsAndNextWave") +
            ", kWeightLoad=" + (kernel.weight_load == WeightLoad::kPerVector ? "WeightLoad::kPerVector" : "WeightLoad::kPerElement");
  }
  return args;
}

inline std::string describe(const Plan& plan) {
  Description d;
  d.add("kernel", kernel_function(plan.kernel))
      .add("template_arguments", template_arguments(plan.kernel))
      .add("template_values", template_values(plan.kernel))
      .add("grid", plan.grid)
      .add("block", plan.block)
      .add("shared_bytes", 0)
      .add("programmatic", plan.programmatic)
      .add("rows", plan.rows)
      .add("token_ranges", plan.token_ranges)
      .add("lanes_per_row", plan.lanes_per_row)
      .add("rows_per_block", plan.rows_per_block);
  if (plan.kernel.name == KernelName::kTuned) {
    d.add("vecs_per_lane", plan.vecs_per_lane_held)
        .add("sms", plan.sms)
        .add("one_vector_blocks_per_sm", plan.one_vector_blocks_per_sm)
        .add("two_vector_blocks_per_sm", plan.two_vector_blocks_per_sm)
        .add("one_vector_wave", plan.one_vector_wave)
        .add("two_vector_wave", plan.two_vector_wave)
        .add("warm_next_wave", plan.warm_next_wave)
        .add("rows_ahead", static_cast<int64_t>(plan.rows_ahead))
        .add("weight_vectors", plan.kernel.weight_load == WeightLoad::kPerVector);
  }
  return d.text;
}

}  // namespace cookbook::qk_norm::tuned
