// tuned: rung 6's CTA per row with streaming rows, its block, grid order, held weights and L2 warming chosen per call by one named policy
//
// What `backend="cuda"` and `"auto"` run. The kernel is rung 6's (a CTA per row holding it in
// 16-byte vectors in registers, x streamed, a programmatic launch, the weights loaded with the row)
// with four choices as template arguments, which `plan` in policy.h makes per call on the host:
//   * kVecsPerThread and the block: rung 6's CTA (the fewest vectors per thread in up to
//     kMaxThreads threads) below one wave of four-warp CTAs, four warps of up to eight vectors
//     each from there (or the 512-thread, two-vector CTA for rows of like widths);
//   * kGridOrder: the (tokens, 2) grid, or for q and k that are views of one tensor of token rows,
//     in calls of many waves, a 1-D grid in which a token's q CTA and k CTA follow each other;
//     kBlockThreads compiles the four-warp block in there, so a thread's vectors are its first
//     address plus fixed offsets;
//   * kWeights: the weights loaded with the row (rung 6) where the CTAs fit a register budget and
//     the call is short, else after the block sum (the registers are better spent on CTAs);
//   * kWarm: from one wave up, the first CTAs in grid order warm their own row into L2 while they
//     wait for the previous kernel (warm_l2 in include/common.cuh says why that is safe), and in
//     calls of one to a few waves every CTA warms the row of the CTA a wave after it.
// The same policy runs narrow rows at many tokens on rung 7's warp per token, rows wider than the
// registers hold on the staged kernel (staged_row.cuh), and rows off the 16-byte path on rung 2.
// docs/cross_head_norm.md gives the measurement behind each choice.
//
// grid.x: token and grid.y: tensor (kTokensByTensor), or grid.x: 2 * token + tensor (kTokenMajor);
// a CTA per row, its threads striding the row by the block, as in rungs 3-6.
#pragma once

#include <string>
#include <utility>

#include "cross_head_norm/policy.h"
#include "cross_head_norm/rows.cuh"
#include "cross_head_norm/staged_row.cuh"           // rows wider than the registers hold
#include "cross_head_norm/v2_q_and_k_on_grid_y.cuh"  // rows off the 16-byte path
#include "cross_head_norm/v7_warp_per_token.cuh"     // narrow rows at many tokens

namespace cookbook::cross_head_norm::tuned {

static_assert(v7::kWarpsPerBlock == kWarpPerTokenWarps && v7::kMaxVecsPerLane == kWarpPerTokenMaxVecs,
              "the policy describes rung 7's warp per token as it is");
static_assert(v2::kThreadsPerBlock == kStridedThreads, "the policy describes rung 2's block as it is");

// The CTA's place in grid order (the order the block scheduler dispatches CTAs in): grid.x alone on
// the token-major grid, x fastest then y on the (tokens, 2) grid.
template <bool kTokenMajor>
__device__ __forceinline__ int64_t cta_in_grid_order() {
  return kTokenMajor ? static_cast<int64_t>(blockIdx.x) : static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
}

// A row brought into L2, one prefetch per 128-byte line, spread over the block's threads.
template <typename T>
__device__ __forceinline__ void warm_row(const Row<T>& r) {
  for (int col = threadIdx.x * kL2LineElems<T>; col < r.hidden; col += blockDim.x * kL2LineElems<T>) warm_l2(r.x + col);
}

// The tuned kernel's arguments: the call's and the plan's two warming numbers, one struct (one
// kernel parameter, read as the rungs read theirs).
struct TunedParams : Params {
  int64_t rows_ahead;       // kFirstRowsAndNextWave: how far ahead in grid order a CTA warms a row (a wave)
  int64_t warm_first_ctas;  // kFirstRows on: the CTAs, first in grid order, that warm their own row
};

// The row of the CTA p.rows_ahead after this one in grid order (a CTA of the next wave).
template <typename T, bool kTokenMajor>
__device__ __forceinline__ void warm_row_ahead(const TunedParams& p) {
  const int64_t ahead = cta_in_grid_order<kTokenMajor>() + p.rows_ahead;
  const int64_t token = kTokenMajor ? ahead / kNumTensors : ahead % gridDim.x;
  const int64_t tensor = kTokenMajor ? ahead % kNumTensors : ahead / gridDim.x;
  if (tensor >= kNumTensors || token >= p.num_tokens) return;
  warm_row(locate_row<T>(p, token, static_cast<int>(tensor)));
}

template <typename T, Rounding kRounding, int kVecsPerThread, GridOrder kGridOrder, Weights kWeights, Warm kWarm,
          int kBlockThreads>
__global__ void __launch_bounds__(kBlockThreads > 0 ? kBlockThreads : kMaxThreads)
    cross_head_norm_tuned_kernel(TunedParams p) {
  static_assert(kVecsPerThread >= 1 && kVecsPerThread <= kMaxVecsPerThread, "a thread holds 1..8 vectors");
  static_assert(kBlockThreads == 0 || (valid_block_size<kBlockThreads> && kBlockThreads <= kMaxThreads),
                "a block compiled in: whole warps within a row's largest block");
  constexpr bool kHf = kRounding == Rounding::kHf;
  constexpr bool kTokenMajor = kGridOrder == GridOrder::kTokenMajor;
  constexpr bool kStreaming = true;
  // The stride between a thread's vectors: a constant with kBlockThreads, so each vector's address
  // is the thread's first one plus an immediate offset.
  const int stride = kBlockThreads > 0 ? kBlockThreads : static_cast<int>(blockDim.x);
  // Where the row lies comes from the kernel's parameters alone, so it may be found before the wait.
  const Row<T> r = kTokenMajor ? locate_row<T>(p, blockIdx.x / kNumTensors, static_cast<int>(blockIdx.x % kNumTensors))
                               : locate_row<T>(p, blockIdx.x, static_cast<int>(blockIdx.y));
  if constexpr (kWarm != Warm::kNothing) {
    if (cta_in_grid_order<kTokenMajor>() < p.warm_first_ctas) warm_row(r);  // while the previous kernel drains
  }
  after_prior_grids();  // read nothing before the previous kernel's writes are visible
  Vec<T> x[kVecsPerThread];  // kept packed across the block reduction: half the registers of float32
  if constexpr (kWeights == Weights::kWithTheRow) {
    RawWeights<T> w[kVecsPerThread];
    load_row_weights<T, kVecsPerThread>(r, threadIdx.x, stride, w);  // issued before the sum waits on x
    const float sum_sq = load_row_vectors<T, kVecsPerThread, kStreaming>(r, threadIdx.x, stride, x);
    if constexpr (kWarm == Warm::kFirstRowsAndNextWave) warm_row_ahead<T, kTokenMajor>(p);
    const float rstd = rstd_from(block_sum(sum_sq), static_cast<float>(r.hidden), p.eps);
    store_row_vectors_held<T, kVecsPerThread, kHf, kStreaming>(r, threadIdx.x, stride, x, w, rstd, p.weight_offset);
  } else {
    const float sum_sq = load_row_vectors<T, kVecsPerThread, kStreaming>(r, threadIdx.x, stride, x);
    if constexpr (kWarm == Warm::kFirstRowsAndNextWave) warm_row_ahead<T, kTokenMajor>(p);
    const float rstd = rstd_from(block_sum(sum_sq), static_cast<float>(r.hidden), p.eps);
    store_row_vectors<T, kVecsPerThread, kHf, kStreaming>(r, threadIdx.x, stride, x, rstd, p.weight_offset);
  }
}

// ---- host --------------------------------------------------------------------------------------
template <typename T>
inline Call call_of(const Params& p, DType dtype, Rounding rounding, int64_t staged_bytes) {
  const bool share_token_stride =
      p.q_token_stride == p.k_token_stride && (p.q_token_stride > p.q_hidden || p.k_token_stride > p.k_hidden);
  return {dtype,          rounding, p.num_tokens, p.q_hidden, p.k_hidden, rows_are_vectors<T>(p), weights_are_vectors(p),
          share_token_stride, staged_bytes};
}

// Calls launch.template operator()<kVariant>() with the kRowVariants entry `kernel` names; returns
// whether it was one (policy.h lists every variant the policy launches: those are compiled).
template <typename Launch, std::size_t... kIndex>
inline bool with_row_variant(const Kernel& kernel, Launch&& launch, std::index_sequence<kIndex...>) {
  return ((is_variant(kernel, kRowVariants[kIndex]) ? (launch.template operator()<kRowVariants[kIndex]>(), true) : false) ||
          ...);
}

template <typename Launch>
inline bool with_row_variant(const Kernel& kernel, Launch&& launch) {
  return with_row_variant(kernel, launch, std::make_index_sequence<std::size(kRowVariants)>());
}

template <typename T, Rounding kRounding, RowVariant kVariant>
constexpr auto kTunedKernel = cross_head_norm_tuned_kernel<T, kRounding, kVariant.vecs, kVariant.grid_order,
                                                           kVariant.weights, kVariant.warm, kVariant.fixed_block>;

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

// Resident CTAs per SM of the tuned kernel `kernel` names at kernel.block threads, on the current
// GPU (cached per kernel, block and device by persistent_grid_limit).
template <typename T, Rounding kRounding>
inline int blocks_per_sm(const Kernel& kernel) {
  int limit = 0;
  with_row_variant(kernel, [&]<RowVariant kVariant>() {
    limit = persistent_grid_limit<kTunedKernel<T, kRounding, kVariant>>(kernel.block);
  });
  const int sms = multiprocessors();
  return sms > 0 ? limit / sms : 0;
}

template <DType kDType, Rounding kRounding>
inline Plan plan_of(const Params& p) {
  using T = Storage<kDType>;
  return plan(call_of<T>(p, kDType, kRounding, staged_row_bytes<T, kRounding>()), multiprocessors(),
              [](const Kernel& kernel) { return blocks_per_sm<T, kRounding>(kernel); });
}

// Launches what `plan` says, and only that.
template <typename T, Rounding kRounding>
inline void launch_plan(const Plan& plan, const Params& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(plan.grid_x), static_cast<unsigned>(plan.grid_y), static_cast<unsigned>(plan.grid_z));
  switch (plan.kernel.name) {
    case KernelName::kStrided:
      launch_kernel(plan.programmatic, v2::cross_head_norm_v2_kernel<T, kRounding>, grid, dim3(plan.block), 0, stream, p);
      return;
    case KernelName::kWarpPerToken:
      with_vecs_per_thread(plan.kernel.vecs, [&]<int kVecs>() {
        launch_kernel(plan.programmatic, v7::cross_head_norm_v7_kernel<T, kRounding, kVecs>, grid, dim3(plan.block), 0,
                      stream, p);
      });
      return;
    case KernelName::kStagedRow:
      launch_kernel(plan.programmatic, cross_head_norm_staged_kernel<T, kRounding>, grid, dim3(plan.block),
                    static_cast<size_t>(plan.shared_bytes), stream, p);
      return;
    case KernelName::kRowPerCta:
      with_row_variant(plan.kernel, [&]<RowVariant kVariant>() {
        const TunedParams args{p, plan.rows_ahead, plan.warm_first_ctas};
        launch_kernel(plan.programmatic, kTunedKernel<T, kRounding, kVariant>, grid, dim3(plan.block), 0, stream, args);
      });
      return;
  }
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  launch_plan<Storage<kDType>, kRounding>(plan_of<kDType, kRounding>(p), p, stream);
  return cudaGetLastError();
}

// What `launch` would run for `p` on the current GPU, as key=value lines, with the kernel's
// registers as the driver reports them: `cookbook explain` on a GPU.
template <DType kDType, Rounding kRounding>
std::string explain(const Params& p) {
  using T = Storage<kDType>;
  const Plan chosen = plan_of<kDType, kRounding>(p);
  std::string text = describe(chosen);
  cudaFuncAttributes attributes{};
  bool found = false;
  const auto attributes_of = [&](auto kernel) { found = cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess; };
  switch (chosen.kernel.name) {
    case KernelName::kStrided: attributes_of(v2::cross_head_norm_v2_kernel<T, kRounding>); break;
    case KernelName::kWarpPerToken:
      with_vecs_per_thread(chosen.kernel.vecs, [&]<int kVecs>() { attributes_of(v7::cross_head_norm_v7_kernel<T, kRounding, kVecs>); });
      break;
    case KernelName::kStagedRow: attributes_of(cross_head_norm_staged_kernel<T, kRounding>); break;
    case KernelName::kRowPerCta:
      with_row_variant(chosen.kernel, [&]<RowVariant kVariant>() { attributes_of(kTunedKernel<T, kRounding, kVariant>); });
      break;
  }
  if (found && chosen.rows > 0) text += Description{}.add("registers", attributes.numRegs).text;
  return text;
}

}  // namespace cookbook::cross_head_norm::tuned
