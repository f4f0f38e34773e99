// How tp_qk_norm's fused kernels cut a call: tiles of tokens per CTA (v2-v4), threads per row pair
// (v5, v7). Plain arithmetic, shared by the kernels and the tuned kernel's host policy (policy.h),
// so that `cookbook explain` computes the launch the launcher makes.
#pragma once

#include <cstdint>

#include "cross_head_norm/vectors.h"
#include "include/plan.h"

namespace cookbook::tp_qk_norm {

using cross_head_norm::threads_for;
using cross_head_norm::vec_elems;

constexpr int kRowsPerToken = 2;  // q's and k's

// The tiles (v2-v4): CTAs of kFusedThreads threads, each staging up to kMaxTokensPerCta tokens'
// rows in kTileBytes of dynamic shared memory (what a launch gets without opting in).
constexpr int kFusedThreads = 256;
constexpr int kFusedWarps = kFusedThreads / kWarpSize;
constexpr int kMaxTokensPerCta = 8;
constexpr int kMaxRowsPerCta = kRowsPerToken * kMaxTokensPerCta;
constexpr int kTileBytes = 48 * 1024;

// Tokens per CTA: as many as the tile holds (at most kMaxTokensPerCta), but no more than it takes
// to give every SM a CTA: at decode sizes one token per CTA, so the few rows spread out.
constexpr int tokens_per_cta(int64_t tokens, int row_pair_bytes, int sms) {
  const int fit = row_pair_bytes > 0 ? kTileBytes / row_pair_bytes : kMaxTokensPerCta;
  const int64_t spread = (tokens + sms - 1) / sms;
  int64_t chosen = fit < kMaxTokensPerCta ? fit : kMaxTokensPerCta;
  if (spread < chosen) chosen = spread;
  return chosen < 1 ? 1 : static_cast<int>(chosen);
}

// Warps per row from v3 on: all of a CTA's warps share its rows when there are fewer rows than warps.
constexpr int slices_per_row(int tokens_per_cta) {
  const int rows = kRowsPerToken * tokens_per_cta;
  return rows < kFusedWarps ? kFusedWarps / rows : 1;
}

// v5's lagged walk: blocks of 64 to 128 threads, 1, 2, 4 or 8 vectors per thread: row pairs up to
// kLaggedMaxThreads * kLaggedMaxVecsPerThread vectors.
constexpr int kLaggedMaxThreads = 128;
constexpr int kLaggedMinThreads = 64;
constexpr int kLaggedMaxVecsPerThread = 8;

// The fewest vectors per thread that fit `vecs` in kLaggedMaxThreads threads; 0 where none does.
constexpr int lagged_vecs_per_thread(int vecs) {
  for (int per_thread = 1; per_thread <= kLaggedMaxVecsPerThread; per_thread *= 2) {
    if (vecs <= kLaggedMaxThreads * per_thread) return per_thread;
  }
  return 0;
}

// v7's lean kernel: one thread per 16-byte vector of the row pair, in whole warps, at least
// kLeanMinThreads (room for the waiting, header and epoch threads).
constexpr int kLeanMaxThreads = 1024;
constexpr int kLeanMinThreads = 64;
// v8's kernel: room for the waiting threads of two tokens as well.
constexpr int kPairedMinThreads = 96;

// The block of a kernel that holds `vecs` vectors at `per_thread` each, at least `min_threads`.
constexpr int block_for(int vecs, int per_thread, int min_threads) {
  const int whole_warps = threads_for(vecs, per_thread);
  return whole_warps < min_threads ? min_threads : whole_warps;
}

}  // namespace cookbook::tp_qk_norm
