// The tuned kernel's host policy: for one chunk of a call, which kernel runs, with which template
// arguments, grid and block, and why. Plain C++ (no CUDA or torch header): the launcher (tuned.cuh)
// runs it before every launch, and `cookbook explain` can run the same code compiled for the host.
//
// The paths, in the order `plan` tries them (kPolicy's fields name the thresholds):
//   1. 16-byte aligned rows, a chunk with tokens, a row pair of at most kLeanMaxThreads vectors,
//      and at most lean_tokens_per_sm tokens per SM: a CTA per token, one thread per vector:
//      rung 7's lean kernel up to a token per resident CTA, rung 8's paired kernel above it (two
//      tokens per CTA share one exchange);
//   2. above that band, at world sizes up to lagged_max_world, where the chunk has a token per
//      resident CTA of the walk and the row pair fits its block: rung 5's lagged walk;
//   3. else rung 4's tiles: the decode kernel where a tile has fewer rows than warps, else the
//      tile kernel; 16-byte packs where the rows are aligned, else one element.
// docs/results/tp_qk_norm_* give the measurements behind each threshold.
#pragma once

#include <cstdint>
#include <string>

#include "include/dtype.h"
#include "include/plan.h"
#include "tp_qk_norm/geometry.h"

namespace cookbook::tp_qk_norm::tuned {

struct Policy {
  int lean_tokens_per_sm;  // up to this many tokens per SM (ceil(tokens / SMs)): rung 7's or rung 8's kernel
  int lagged_max_world;    // above that band, rung 5's walk at world sizes up to this; rung 4's tiles above
};

// lean_tokens_per_sm: measured on 2 and 4 H200s at MiniMax-M2's widths, both timing methods, rung
// 8's paired kernel led the walk and the tiles up to 8 tokens per SM (1024 tokens on 132 SMs) and
// trailed from 12 (TP=8 is not measured in this band). lagged_max_world: the walk was measured
// ahead of the tiles at TP=2 and TP=4; at TP=8 only the tiles were measured at prefill, and world
// sizes between take the next measured size's choice (their shards are at least as wide).
constexpr Policy kPolicy{.lean_tokens_per_sm = 8, .lagged_max_world = 4};

// What the policy reads of a chunk.
struct Call {
  DType dtype;
  Rounding rounding;
  int world;           // ranks in the group
  int64_t num_tokens;  // of the chunk (a call longer than the workspace's capacity runs in chunks)
  int q_hidden;        // shard widths
  int k_hidden;
  bool vector_aligned;  // rows and weights on 16-byte boundaries, whole vectors
};

enum class KernelName : int { kLean, kPaired, kLaggedWalk, kTiles, kDecodeTiles };

struct Kernel {
  KernelName name = KernelName::kTiles;
  DType dtype = DType::kBFloat16;
  Rounding rounding = Rounding::kFused;
  int vecs_per_thread = 0;  // the walk's kVecsPerThread
  int pack_elems = 0;       // the tiles' kElems: a 16-byte vector's elements, or 1
  bool staged = false;      // the tiles' kStaged: the rows kept in shared memory
  int block = 0;            // threads per CTA launched
};

struct Plan {
  Kernel kernel;
  int64_t grid = 0;
  int block = 0;
  int64_t shared_bytes = 0;  // dynamic
  bool programmatic = true;
  // The numbers that decided it.
  int sms = 0;
  int64_t tokens_per_sm = 0;
  int vecs = 0;                // 16-byte vectors of a token's row pair
  int64_t resident = 0;        // CTAs of the chosen (or, on the tiles, the declined walk's) kernel resident at once
  int tokens_per_cta = 0;      // tiles
  int slices_per_row = 0;      // tiles
};

// The plan of `call` on a GPU of `sms` SMs; blocks_per_sm(kernel) is how many CTAs of `kernel` (at
// kernel.block threads) are resident at once on one SM.
template <typename BlocksPerSm>
Plan plan(const Call& call, int sms, BlocksPerSm&& blocks_per_sm, const Policy& policy = kPolicy) {
  Plan plan{};
  const int elems = vec_elems(call.dtype);
  plan.sms = sms;
  plan.tokens_per_sm = (call.num_tokens + sms - 1) / sms;
  plan.vecs = (call.q_hidden + call.k_hidden) / elems;
  const auto resident = [&](const Kernel& kernel) {
    const int blocks = blocks_per_sm(kernel);
    return int64_t{sms} * (blocks > 0 ? blocks : 1);
  };
  // 1. The lean band: rung 7's kernel while every CTA has one token, rung 8's where some have two.
  if (call.vector_aligned && call.num_tokens > 0 && plan.tokens_per_sm <= policy.lean_tokens_per_sm &&
      plan.vecs <= kLeanMaxThreads) {
    plan.kernel = {KernelName::kLean, call.dtype, call.rounding};
    plan.kernel.block = block_for(plan.vecs, 1, kLeanMinThreads);
    plan.resident = resident(plan.kernel);
    if (call.num_tokens > plan.resident) {
      plan.kernel = {KernelName::kPaired, call.dtype, call.rounding};
      plan.kernel.block = block_for(plan.vecs, 1, kPairedMinThreads);
      plan.resident = resident(plan.kernel);
    }
    plan.grid = call.num_tokens < plan.resident ? call.num_tokens : plan.resident;
    plan.block = plan.kernel.block;
    return plan;
  }
  // 2. The lagged walk.
  const int walk_vecs = lagged_vecs_per_thread(plan.vecs);
  if (call.vector_aligned && call.world <= policy.lagged_max_world && walk_vecs > 0) {
    Kernel walk{KernelName::kLaggedWalk, call.dtype, call.rounding, walk_vecs};
    walk.block = block_for(plan.vecs, walk_vecs, kLaggedMinThreads);
    plan.resident = resident(walk);
    if (call.num_tokens >= plan.resident) {
      plan.kernel = walk;
      plan.grid = plan.resident;
      plan.block = walk.block;
      return plan;
    }
  }
  // 3. The tiles.
  const int pack_elems = call.vector_aligned ? elems : 1;
  const int row_pair_bytes = (call.q_hidden + call.k_hidden) * element_bytes(call.dtype);
  const bool staged = row_pair_bytes <= kTileBytes;
  plan.tokens_per_cta = staged ? tokens_per_cta(call.num_tokens, row_pair_bytes, sms) : 1;
  plan.slices_per_row = slices_per_row(plan.tokens_per_cta);
  const int64_t ctas = (call.num_tokens + plan.tokens_per_cta - 1) / plan.tokens_per_cta;
  plan.grid = ctas > 0 ? ctas : 1;  // no tokens: still publish the header
  plan.kernel = {plan.slices_per_row > 1 ? KernelName::kDecodeTiles : KernelName::kTiles, call.dtype, call.rounding, 0,
                 pack_elems, staged, kFusedThreads};
  plan.block = kFusedThreads;
  plan.shared_bytes = staged ? int64_t{plan.tokens_per_cta} * row_pair_bytes : 0;
  return plan;
}

// ---- how `cookbook explain` tells a plan ----------------------------------------------------------
inline std::string kernel_function(const Kernel& kernel) {
  switch (kernel.name) {
    case KernelName::kLean: return "cookbook::tp_qk_norm::v7::lean_rows_kernel";
    case KernelName::kPaired: return "cookbook::tp_qk_norm::v8::paired_rows_kernel";
    case KernelName::kLaggedWalk: return "cookbook::tp_qk_norm::v5::lagged_rows_kernel";
    case KernelName::kDecodeTiles: return "cookbook::tp_qk_norm::fused_v3_kernel";
    default: return "cookbook::tp_qk_norm::fused_kernel";
  }
}

// The template arguments as nvcc's report prints them (bools as true/false), comma-separated.
inline std::string template_values(const Kernel& kernel) {
  const std::string t = storage_name(kernel.dtype);
  const std::string hf = kernel.rounding == Rounding::kHf ? "true" : "false";
  const std::string staged = kernel.staged ? "true" : "false";
  switch (kernel.name) {
    case KernelName::kLean:
    case KernelName::kPaired: return t + "," + hf;
    case KernelName::kLaggedWalk: return t + "," + std::to_string(kernel.vecs_per_thread) + "," + hf;
    case KernelName::kDecodeTiles:  // early epoch, programmatic, batched loads: rung 4's
      return t + "," + std::to_string(kernel.pack_elems) + "," + staged + "," + hf + ",true,true,true";
    default: return t + "," + std::to_string(kernel.pack_elems) + "," + staged + "," + hf + ",true,true";
  }
}

// The same, named: what `cookbook explain` prints.
inline std::string template_arguments(const Kernel& kernel) {
  const std::string t = std::string("T=") + storage_name(kernel.dtype);
  const std::string hf = std::string("kHfRounding=") + (kernel.rounding == Rounding::kHf ? "true" : "false");
  const std::string tile = ", kElems=" + std::to_string(kernel.pack_elems) + ", kStaged=" + (kernel.staged ? "true" : "false");
  switch (kernel.name) {
    case KernelName::kLean:
    case KernelName::kPaired: return t + ", " + hf;
    case KernelName::kLaggedWalk: return t + ", kVecsPerThread=" + std::to_string(kernel.vecs_per_thread) + ", " + hf;
    case KernelName::kDecodeTiles:
      return t + tile + ", " + hf + ", kEarlyEpoch=true, kProgrammatic=true, kBatched=true";
    default: return t + tile + ", " + hf + ", kProgrammatic=true, kBatched=true";
  }
}

inline const char* kernel_path(KernelName name) {
  switch (name) {
    case KernelName::kLean: return "lean";
    case KernelName::kPaired: return "paired";
    case KernelName::kLaggedWalk: return "lagged_walk";
    case KernelName::kDecodeTiles: return "decode_tiles";
    default: return "tiles";
  }
}

inline std::string describe(const Plan& plan) {
  Description d;
  d.add("kernel", kernel_function(plan.kernel))
      .add("template_values", template_values(plan.kernel))
      .add("template_arguments", template_arguments(plan.kernel))
      .add("path", kernel_path(plan.kernel.name))
      .add("grid", plan.grid)
      .add("block", plan.block)
      .add("shared_bytes", plan.shared_bytes)
      .add("programmatic", plan.programmatic)
      .add("sms", plan.sms)
      .add("tokens_per_sm", plan.tokens_per_sm)
      .add("lean_tokens_per_sm", kPolicy.lean_tokens_per_sm)
      .add("lagged_max_world", kPolicy.lagged_max_world)
      .add("vecs", plan.vecs)
      .add("resident", plan.resident);
  if (plan.kernel.name == KernelName::kTiles || plan.kernel.name == KernelName::kDecodeTiles) {
    d.add("tokens_per_cta", plan.tokens_per_cta).add("slices_per_row", plan.slices_per_row);
  }
  return d.text;
}

}  // namespace cookbook::tp_qk_norm::tuned
