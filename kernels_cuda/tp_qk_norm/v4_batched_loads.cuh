// v4: each lane's loads of a row issued as one batch before any is used - removes v3's one memory latency per pack behind its tile stores
//
// Seen in v3's SASS: phase 1 is LD.128, STS.128, LD.128, STS.128, ...: each store into the tile
// waits for its load, and the next load may not pass that store (a generic address might be the
// tile's). A lane with n packs of a row therefore waited n memory latencies before its partial
// sum could leave: at 128 tokens of a 3072-wide shard, 3 (one token per CTA, four warps per row);
// at 512 tokens, 12 (four tokens per CTA, a warp per row). With batched_loads, stage_and_sum and
// normalize_and_write (tiles.cuh) issue up to kLoadUnroll loads (the shard's packs, then the
// weights), then use them; the order in which a lane sums is unchanged, so v4 gives v3's bits.
// Both tile kernels (decode and prefill) get it.
#pragma once

#include "tp_qk_norm/tiles.cuh"

namespace cookbook::tp_qk_norm::v4 {

constexpr TileFeatures kTiles{.share_rows_at_decode = true,
                              .early_epoch = true,
                              .programmatic = true,
                              .batched_loads = true};

// One chunk in v4's tiles (v5 on, and the tuned kernel, run it where their kernels do not).
template <typename T, bool kHfRounding>
inline void launch_chunk(const FusedParams& chunk, cudaStream_t stream) {
  launch_tiles_any_alignment<kTiles, T, kHfRounding>(chunk, stream);
}

template <DType kDType, Rounding kRounding>
cudaError_t launch(const FusedParams& call, cudaStream_t stream) {
  using T = Storage<kDType>;
  return for_each_chunk<T>(call, [&](const FusedParams& chunk) {
    launch_chunk<T, kRounding == Rounding::kHf>(chunk, stream);
  });
}

}  // namespace cookbook::tp_qk_norm::v4
