// v2: one fused kernel: a CTA stages its tokens in shared memory, pushes their sums into every peer's buffer, waits - removes v1's NCCL launch and re-read
//
// The sums cross the GPUs through symmetric memory: each rank's buffer is mapped into every peer,
// so a partial sum is one 8-byte store into the peer's buffer, tagged with the call's epoch, and
// the peer polls its own buffer for the tag (the protocol: exchange.cuh). fused_kernel
// (tiles.cuh): grid.x tiles of tokens_per_cta tokens, a warp per row, four phases (read, stage
// and push; check the headers; wait for the peers' partials; normalize from the tile and write).
// A CTA waits once per tile, not once per row, and several tiles per SM are in flight, so the
// NVLink round trip overlaps other tiles' loads. Rows that are not 16-byte aligned take packs of
// one element.
#pragma once

#include "tp_qk_norm/tiles.cuh"

namespace cookbook::tp_qk_norm::v2 {

constexpr TileFeatures kTiles{.share_rows_at_decode = false,
                              .early_epoch = false,
                              .programmatic = false,
                              .batched_loads = false};

template <DType kDType, Rounding kRounding>
cudaError_t launch(const FusedParams& call, cudaStream_t stream) {
  using T = Storage<kDType>;
  return for_each_chunk<T>(call, [&](const FusedParams& chunk) {
    launch_tiles_any_alignment<kTiles, T, kRounding == Rounding::kHf>(chunk, stream);
  });
}

}  // namespace cookbook::tp_qk_norm::v2
