// v3: at decode sizes warps share each row, header check and epoch advance ride beside the wait, the launch is programmatic - removes v2's latency chain
//
// Three changes on a small call's critical path (v2's tiles otherwise):
//   * warps share rows: v2 gives a row to one warp: a 3072-wide bf16 shard row is 12 packs per
//     lane, three dependent rounds of loads before the partial sum can leave, while 6 of the 8
//     warps of a one-token CTA idle. When a tile has fewer rows than warps, fused_v3_kernel
//     (tiles.cuh) cuts its rows into slices_per_row slices, one warp per (row, slice): one round
//     of loads. The slices' sums meet in shared memory in a fixed order; threads [0, rows *
//     world) then push and wait while the top threads check the headers (a mismatch stops the
//     waits, so nothing can hang, and a match costs no extra round trip). The weight lines the
//     write will read are prefetched into L1 before the wait.
//   * the early epoch: the decode kernel advances the epoch as soon as every CTA has read it (an
//     atomic beside the wait) instead of after every CTA has finished: no end-of-kernel atomic.
//   * a programmatic dependent launch: the CTAs become resident while the previous kernel
//     finishes and wait in hardware (griddepcontrol.wait, in after_prior_grids) for its writes,
//     so nothing they read can be stale; they then let the next launch do the same. Under CUDA
//     graphs the attribute becomes a programmatic edge; on an older GPU the wait compiles away.
// With a warp per row (prefill sizes) there is nothing to share: v2's kernel runs, launched
// programmatically.
#pragma once

#include "tp_qk_norm/tiles.cuh"

namespace cookbook::tp_qk_norm::v3 {

constexpr TileFeatures kTiles{.share_rows_at_decode = true,
                              .early_epoch = true,
                              .programmatic = true,
                              .batched_loads = false};

template <DType kDType, Rounding kRounding>
cudaError_t launch(const FusedParams& call, cudaStream_t stream) {
  using T = Storage<kDType>;
  return for_each_chunk<T>(call, [&](const FusedParams& chunk) {
    launch_tiles_any_alignment<kTiles, T, kRounding == Rounding::kHf>(chunk, stream);
  });
}

}  // namespace cookbook::tp_qk_norm::v3
