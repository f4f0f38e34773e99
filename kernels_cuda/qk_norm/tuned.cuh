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
// The choices that depend on the call (vectors per lane, warming the next wave, the weights'
// loads, the path) are made on the host by `plan` in policy.h, which `cookbook explain` runs too.
//
// grid.x: ceil(rows / kRowsPerBlock); lane group -> row, as in rungs 4-6. Rows are 32-bit in the
// kernel: a call of more rows is launched in token ranges of fewer than 2^32 rows each.
#pragma once

#include <string>

#include "qk_norm/policy.h"
#include "qk_norm/rows.cuh"
#include "qk_norm/v2_warp_per_row.cuh"  // rows off the vector path

namespace cookbook::qk_norm::tuned {

static_assert(v2::kWarpsPerBlock == kWarpPerRowWarps, "the policy describes rung 2's block as it is");

// The effective float32 weights (w + weight_offset; rounded to T first in the Hugging Face order)
// of the kVecElems columns from `first_column` of weight `w`: 16-byte loads where `as_vectors`
// (the weight is 16-byte aligned), element by element otherwise.
template <typename T, Rounding kRounding>
__device__ __forceinline__ void load_weight_vector(const Params& p, const void* w, int first_column, bool as_vectors,
                                                   float (&out)[Vec<T>::kElems]) {
  constexpr int kVecElems = Vec<T>::kElems;
  constexpr int kFloatsPerVec = kVecBytes / static_cast<int>(sizeof(float));
  static_assert(kVecElems % kFloatsPerVec == 0, "a vector's float32 weights are whole 16-byte loads");
  if (as_vectors && p.weight_is_fp32) {
#pragma unroll
    for (int h = 0; h < kVecElems / kFloatsPerVec; ++h) {
      const float4 f = reinterpret_cast<const float4*>(static_cast<const float*>(w) + first_column)[h];
      out[kFloatsPerVec * h] = f.x;
      out[kFloatsPerVec * h + 1] = f.y;
      out[kFloatsPerVec * h + 2] = f.z;
      out[kFloatsPerVec * h + 3] = f.w;
    }
  } else if (as_vectors) {
    unpack<T>(load_vec<T>(static_cast<const T*>(w) + first_column), out);
  } else {
#pragma unroll
    for (int j = 0; j < kVecElems; ++j) out[j] = load_weight<T>(w, p.weight_is_fp32, first_column + j);
  }
#pragma unroll
  for (int j = 0; j < kVecElems; ++j) out[j] = effective_weight<T, kRounding == Rounding::kHf>(out[j], p.weight_offset);
}

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

// ---- the launcher (host) ---------------------------------------------------------------------
// What the policy reads of a call: Params and the pointers' alignment.
template <typename T>
inline Call call_of(const Params& p, DType dtype, Rounding rounding) {
  return {dtype, rounding, p.num_tokens, p.num_q_heads, p.num_kv_heads, p.head_dim, rows_are_vectors<T>(p),
          is_aligned(p.q_weight, kVecBytes) && is_aligned(p.k_weight, kVecBytes)};
}

// Calls launch.template operator()<kHeadDim, kVecsPerLane, kWarm, kWeightLoad>() for the tuned
// kernel `kernel` names (one of the compiled head_dims); returns whether it was one.
template <typename T, typename Launch>
inline bool with_kernel(const Kernel& kernel, Launch&& launch) {
  return with_head_dim<64, 128, 256, 512, 1024, 80, 96, 160, 192>(kernel.head_dim, [&]<int kHeadDim>() {
    const auto with_load = [&]<int kVecs, Warm kWarm>() {
      if (kernel.weight_load == WeightLoad::kPerVector) {
        launch.template operator()<kHeadDim, kVecs, kWarm, WeightLoad::kPerVector>();
      } else {
        launch.template operator()<kHeadDim, kVecs, kWarm, WeightLoad::kPerElement>();
      }
    };
    const auto with_warm = [&]<int kVecs>() {
      if (kernel.warm == Warm::kWeightsAndNextWave) {
        with_load.template operator()<kVecs, Warm::kWeightsAndNextWave>();
      } else {
        with_load.template operator()<kVecs, Warm::kWeights>();
      }
    };
    // At heads of two or more vectors per lane of a whole warp the two shapes are one kernel,
    // compiled once (the policy never asks for the second).
    constexpr bool kTwoDiffers = LaneGroup<T, kHeadDim, 2>::kLanes != LaneGroup<T, kHeadDim, 1>::kLanes;
    if (kTwoDiffers && kernel.vecs_per_lane == 2) {
      with_warm.template operator()<kTwoDiffers ? 2 : 1>();
    } else {
      with_warm.template operator()<1>();
    }
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
  with_kernel<T>(kernel, [&]<int kHeadDim, int kVecs, Warm kWarm, WeightLoad kWeightLoad>() {
    limit = persistent_grid_limit<qk_norm_tuned_kernel<T, kRounding, kHeadDim, kVecs, kWarm, kWeightLoad>>(kernel.block);
  });
  const int sms = multiprocessors();
  return sms > 0 ? limit / sms : 0;
}

template <DType kDType, Rounding kRounding>
inline Plan plan_of(const Params& p) {
  using T = Storage<kDType>;
  return plan(call_of<T>(p, kDType, kRounding), multiprocessors(),
              [](const Kernel& kernel) { return blocks_per_sm<T, kRounding>(kernel); });
}

// Launches what `plan` says for the rows of `p` (one token range).
template <typename T, Rounding kRounding>
inline void launch_plan(const Plan& plan, const Params& p, cudaStream_t stream) {
  if (plan.kernel.name == KernelName::kWarpPerRow) return v2::launch_rows<T, kRounding>(p, plan.rows, stream);
  const FastDivisor heads_divisor(static_cast<uint32_t>(p.num_q_heads + p.num_kv_heads));
  with_kernel<T>(plan.kernel, [&]<int kHeadDim, int kVecs, Warm kWarm, WeightLoad kWeightLoad>() {
    launch_kernel(plan.programmatic, qk_norm_tuned_kernel<T, kRounding, kHeadDim, kVecs, kWarm, kWeightLoad>,
                  dim3(static_cast<unsigned>(plan.grid)), dim3(plan.block), 0, stream, p,
                  static_cast<uint32_t>(plan.rows), heads_divisor, plan.rows_ahead);
  });
}

// Calls launch_range(range) on consecutive token ranges of `p` of at most kMaxRows rows each (q and
// k advanced to each range's first token): one range for any call that fits in memory.
template <typename T, typename LaunchRange>
inline void for_each_token_range(const Params& p, LaunchRange&& launch_range) {
  const int64_t heads = p.num_q_heads + p.num_kv_heads;
  const int64_t tokens_per_range = kMaxRows / heads;
  for (int64_t first = 0; first < p.num_tokens; first += tokens_per_range) {
    Params range = p;
    range.num_tokens = p.num_tokens - first < tokens_per_range ? p.num_tokens - first : tokens_per_range;
    range.q = static_cast<T*>(p.q) + first * p.q_token_stride;
    range.k = static_cast<T*>(p.k) + first * p.k_token_stride;
    launch_range(range);
  }
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  using T = Storage<kDType>;
  if (total_rows(p) == 0) return cudaSuccess;
  for_each_token_range<T>(p, [&](const Params& range) { launch_plan<T, kRounding>(plan_of<kDType, kRounding>(range), range, stream); });
  return cudaGetLastError();
}

// What `launch` would run for `p` on the current GPU (the first token range), as key=value lines,
// with each kernel's registers as the driver reports them: `cookbook explain` on a GPU.
template <DType kDType, Rounding kRounding>
std::string explain(const Params& p) {
  using T = Storage<kDType>;
  const Plan chosen = plan_of<kDType, kRounding>(p);
  std::string text = describe(chosen);
  cudaFuncAttributes attributes{};
  bool found = false;
  if (chosen.kernel.name == KernelName::kWarpPerRow) {
    found = cudaFuncGetAttributes(&attributes, v2::qk_norm_v2_kernel<T, kRounding>) == cudaSuccess;
  } else {
    with_kernel<T>(chosen.kernel, [&]<int kHeadDim, int kVecs, Warm kWarm, WeightLoad kWeightLoad>() {
      found = cudaFuncGetAttributes(&attributes, qk_norm_tuned_kernel<T, kRounding, kHeadDim, kVecs, kWarm, kWeightLoad>) == cudaSuccess;
    });
  }
  if (found && chosen.rows > 0) text += Description{}.add("registers", attributes.numRegs).text;
  return text;
}

}  // namespace cookbook::qk_norm::tuned
