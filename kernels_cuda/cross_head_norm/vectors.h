// How a CTA's threads split a token's row into 16-byte vectors held in registers: plain arithmetic,
// shared by the kernels (rows.cuh, the rungs) and the tuned kernel's host policy (policy.h).
#pragma once

#include "include/plan.h"

namespace cookbook::cross_head_norm {

// A row held in registers: at most kMaxThreads threads of at most kMaxVecsPerThread vectors each
// (8 x 16 bytes: 32 registers of packed row per thread). Rows wider than that (32768 bf16
// elements, 16384 float32) take another path.
constexpr int kMaxThreads = 512;
constexpr int kMaxVecsPerThread = 8;
static_assert(kMaxThreads % kWarpSize == 0 && kMaxThreads <= 1024, "a block of whole warps, at most 1024 threads");

// Elements of a 16-byte vector: 8 in fp16/bf16, 4 in float32.
constexpr int vec_elems(DType dtype) { return kVecBytes / element_bytes(dtype); }

// The threads that hold `row_vecs` vectors at `vecs_per_thread` each, in whole warps (a block
// reduction needs them).
constexpr int threads_for(int row_vecs, int vecs_per_thread) {
  const int threads = (row_vecs + vecs_per_thread - 1) / vecs_per_thread;
  return (threads + kWarpSize - 1) / kWarpSize * kWarpSize;
}

// The fewest vectors per thread (1, 2, 4 or 8) that hold a row of `row_vecs` vectors in kMaxThreads
// threads; 0 where the row is wider than that.
constexpr int fewest_vecs_per_thread(int row_vecs) {
  for (int vecs = 1; vecs <= kMaxVecsPerThread; vecs *= 2) {
    if (row_vecs <= kMaxThreads * vecs) return vecs;
  }
  return 0;
}
static_assert(fewest_vecs_per_thread(kMaxThreads) == 1 && fewest_vecs_per_thread(kMaxThreads + 1) == 2 &&
                  fewest_vecs_per_thread(kMaxThreads * kMaxVecsPerThread + 1) == 0,
              "1, 2, 4, 8 vectors per thread, then none");

}  // namespace cookbook::cross_head_norm
