// tuned: v7's kernel at decode, v8's at mid sizes, v5's walk at prefill, v4's tiles elsewhere, chosen per chunk by one policy; v1's kernels without peer memory
//
// The launcher decides nothing outside `plan` (policy.h): it asks the plan for each chunk of the
// call and launches the kernel it names. The same extension holds the NCCL path (rung 1's two
// kernels: the host falls back to it where the ranks cannot reach each other's memory) and the
// launch of a rank that does not take part in a call (`absent`).
#pragma once

#include <string>

#include "tp_qk_norm/policy.h"
#include "tp_qk_norm/tiles.cuh"
#include "tp_qk_norm/v1_three_launches.cuh"      // the NCCL path
#include "tp_qk_norm/v5_lagged_walk.cuh"         // prefill
#include "tp_qk_norm/v7_thread_per_vector.cuh"        // decode: a token per CTA
#include "tp_qk_norm/v8_two_tokens_per_exchange.cuh"  // mid sizes: two tokens per exchange

namespace cookbook::tp_qk_norm::tuned {

// The NCCL path's two steps: rung 1's kernels.
template <DType kDType>
cudaError_t launch_sum_sq(const Params& p, float* sum_sq, cudaStream_t stream) {
  return v1::launch_sum_sq<kDType>(p, sum_sq, stream);
}

template <DType kDType, Rounding kRounding>
cudaError_t launch_apply(const ApplyParams& a, cudaStream_t stream) {
  return v1::launch_apply<kDType, kRounding>(a, stream);
}

constexpr TileFeatures kTiles = v4::kTiles;

// The kernel a plan names, for the call's storage type and rounding.
template <typename T, bool kHfRounding>
inline void (*tile_kernel(const Kernel& kernel))(FusedParams) {
  const auto pick = [&]<int kElems, bool kStaged>() -> void (*)(FusedParams) {
    if (kernel.name == KernelName::kDecodeTiles) {
      return fused_v3_kernel<T, kElems, kStaged, kHfRounding, kTiles.early_epoch, kTiles.programmatic,
                             kTiles.batched_loads>;
    }
    return fused_kernel<T, kElems, kStaged, kHfRounding, kTiles.programmatic, kTiles.batched_loads>;
  };
  if (kernel.pack_elems == 1) return kernel.staged ? pick.template operator()<1, true>() : pick.template operator()<1, false>();
  return kernel.staged ? pick.template operator()<Vec<T>::kElems, true>() : pick.template operator()<Vec<T>::kElems, false>();
}

template <typename T, bool kHfRounding>
inline void (*kernel_of(const Kernel& kernel))(FusedParams) {
  switch (kernel.name) {
    case KernelName::kLean: return v7::lean_rows_kernel<T, kHfRounding>;
    case KernelName::kPaired: return v8::paired_rows_kernel<T, kHfRounding>;
    case KernelName::kLaggedWalk:
      switch (kernel.vecs_per_thread) {
        case 1: return v5::lagged_rows_kernel<T, 1, kHfRounding>;
        case 2: return v5::lagged_rows_kernel<T, 2, kHfRounding>;
        case 4: return v5::lagged_rows_kernel<T, 4, kHfRounding>;
        default: return v5::lagged_rows_kernel<T, 8, kHfRounding>;
      }
    default: return tile_kernel<T, kHfRounding>(kernel);
  }
}

// Resident CTAs of a kernel per SM, from the driver's occupancy calculator (cached per device and
// block size, as persistent_grid_limit caches it).
template <typename T, bool kHfRounding>
inline int blocks_per_sm(const Kernel& kernel) {
  const int sms = sm_count();
  switch (kernel.name) {
    case KernelName::kLean: return persistent_grid_limit<v7::lean_rows_kernel<T, kHfRounding>>(kernel.block) / sms;
    case KernelName::kPaired: return persistent_grid_limit<v8::paired_rows_kernel<T, kHfRounding>>(kernel.block) / sms;
    case KernelName::kLaggedWalk:
      switch (kernel.vecs_per_thread) {
        case 1: return persistent_grid_limit<v5::lagged_rows_kernel<T, 1, kHfRounding>>(kernel.block) / sms;
        case 2: return persistent_grid_limit<v5::lagged_rows_kernel<T, 2, kHfRounding>>(kernel.block) / sms;
        case 4: return persistent_grid_limit<v5::lagged_rows_kernel<T, 4, kHfRounding>>(kernel.block) / sms;
        default: return persistent_grid_limit<v5::lagged_rows_kernel<T, 8, kHfRounding>>(kernel.block) / sms;
      }
    default: return 0;  // the tiles are not persistent
  }
}

template <DType kDType, Rounding kRounding>
Call call_of(const FusedParams& chunk) {
  return {kDType,           kRounding,          chunk.world, chunk.shard.num_tokens, chunk.shard.q_hidden,
          chunk.shard.k_hidden, cross_head_norm::vector_aligned<Storage<kDType>>(chunk.shard)};
}

template <DType kDType, Rounding kRounding>
Plan plan_of(const FusedParams& chunk) {
  using T = Storage<kDType>;
  constexpr bool kHf = kRounding == Rounding::kHf;
  return plan(call_of<kDType, kRounding>(chunk), sm_count(), [](const Kernel& k) { return blocks_per_sm<T, kHf>(k); });
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const FusedParams& call, cudaStream_t stream) {
  using T = Storage<kDType>;
  constexpr bool kHf = kRounding == Rounding::kHf;
  return for_each_chunk<T>(call, [&](FusedParams chunk) {
    const Plan chosen = plan_of<kDType, kRounding>(chunk);
    const bool tiles = chosen.kernel.name == KernelName::kTiles || chosen.kernel.name == KernelName::kDecodeTiles;
    chunk.tokens_per_cta = tiles ? chosen.tokens_per_cta : 1;
    chunk.slices_per_row = tiles ? chosen.slices_per_row : 1;
    launch_kernel(chosen.programmatic, kernel_of<T, kHf>(chosen.kernel), dim3(static_cast<unsigned>(chosen.grid)),
                  dim3(chosen.block), static_cast<size_t>(chosen.shared_bytes), stream, chunk);
  });
}

// What `launch` would launch for the call's first chunk, as the plan's key=value lines, with the
// kernel's registers as the driver reports them: `cookbook explain` on a GPU. Launches nothing.
template <DType kDType, Rounding kRounding>
std::string explain(const FusedParams& call) {
  FusedParams chunk = call;
  chunk.shard.num_tokens = call.shard.num_tokens < call.capacity ? call.shard.num_tokens : call.capacity;
  const Plan chosen = plan_of<kDType, kRounding>(chunk);
  cudaFuncAttributes attributes{};
  const cudaError_t found =
      cudaFuncGetAttributes(&attributes, kernel_of<Storage<kDType>, kRounding == Rounding::kHf>(chosen.kernel));
  return describe(chosen) + Description{}.add("registers", found == cudaSuccess ? attributes.numRegs : -1).text;
}

// A rank that does not take part in a call (it rejected its arguments) still launches once, so
// that the ranks stay in step: rung 2's tile kernel with no tokens and an absent header publishes
// it to every rank, waits (bounded) for the peers' headers, records nothing and advances the
// epoch. The peers find the absent header, write nothing and report it.
template <DType kDType>
cudaError_t absent(FusedParams p, cudaStream_t stream) {
  absent_header(p);
  p.shard.num_tokens = 0;
  p.chunk_index = 0;
  p.tokens_per_cta = 1;
  p.slices_per_row = 1;
  fused_kernel<Storage<kDType>, 1, false, false><<<1, kFusedThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cookbook::tp_qk_norm::tuned
