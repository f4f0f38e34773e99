// How a group of lanes splits one (token, head) row into 16-byte vectors: plain arithmetic, shared
// by the kernels (LaneGroup in rows.cuh) and the tuned kernel's host policy (policy.h).
#pragma once

#include "include/plan.h"

namespace cookbook::qk_norm {

constexpr int next_power_of_two(int n) { return n <= 1 ? 1 : 2 * next_power_of_two((n + 1) / 2); }
constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// The lanes that share a row of `head_dim` elements of `vec_elems` per vector, each holding at
// least `min_vecs_per_lane` vectors: a power of two of lanes, at most a warp.
//   min_vecs_per_lane 1 gives a row as many lanes as it has vectors (16 at head_dim 128 in bf16),
//   2 half as many, each doing twice the work.
//   padded: a row of a whole number of vectors that is not a power of two (96 bf16 elements: 12)
//   gets the next power of two of lanes (16), and the lanes past its last vector hold none.
struct LaneShape {
  int vecs_per_row;
  int lanes;
  int vecs_per_lane;
  bool padded;
};

constexpr LaneShape lane_shape(int vec_elems, int head_dim, int min_vecs_per_lane) {
  const int vecs_per_row = head_dim / vec_elems;
  const int wanted = next_power_of_two(vecs_per_row) / min_vecs_per_lane;
  const int lanes = wanted < 1 ? 1 : wanted < kWarpSize ? wanted : kWarpSize;
  return {vecs_per_row, lanes, ceil_div(vecs_per_row, lanes), vecs_per_row % lanes != 0};
}

}  // namespace cookbook::qk_norm
