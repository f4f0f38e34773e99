// The tuned kernel's host policy: for one call, which kernel runs, with which template arguments,
// grid and block, and why. Plain C++ (no CUDA or torch header): the launcher (tuned.cuh) runs it
// before every launch, and `cookbook explain` runs the same code compiled for the host, on a
// machine without a GPU, with the kernels' resident blocks per SM computed from nvcc's report.
//
// A call is 2T rows (a q row and a k row per token). Its size is counted in waves: the rows one
// wave of a kernel's CTAs covers (its CTAs resident at once on this GPU; a CTA per row). The
// paths, in the order `plan` tries them:
//   1. narrow rows at many tokens: rung 7's warp per token (q's row then k's, four tokens per CTA),
//      where the wider row is at most kWarpPerTokenMaxVecs vectors per lane and the call has at
//      least kTokensPerVector tokens per vector of a token (fewer, and a warp's serial work shows);
//   2. rows wider than a CTA's registers hold: staged in shared memory by one bulk copy, where the
//      GPU has the copy engine (sm_90) and the shared memory; else rung 2's strided kernel;
//   3. rows or weights not whole 16-byte vectors: rung 2's strided kernel;
//   4. the tuned kernel, a CTA per row, shaped by the call's waves of four-warp CTAs:
//      - below one wave: rung 6's CTA (the fewest vectors per thread in up to kMaxThreads threads),
//        the weights held with the row where every row is resident at once;
//      - from one wave: four-warp CTAs of up to kMaxVecsPerThread vectors per thread, more bytes in
//        flight per SM than the 512-thread CTA's, and in calls of at most kMaxWarmCallBytes the
//        first kWarmBytes of rows warmed into L2 before the programmatic wait. Then:
//        * q and k views of one tensor, kTokenMajorMinWaves waves or more: the token-major grid
//          (a token's q CTA and k CTA side by side, so the rows in flight are neighbours in
//          memory), its block compiled in where four warps hold the row;
//        * else rows of kLikeRowsMinVecs to kLikeRowsMaxVecs vectors with q and k within
//          kLikeRowsMaxWidthRatio of each other: the 512-thread CTA of two vectors per thread (half
//          the bytes per SM asked for at once: a wave's reads and writes come as bursts);
//        * else below kTokenMajorMinWaves waves: the weights held with the row (at most
//          kMaxHeldVecs vectors per thread) and the row one wave ahead warmed into L2.
// docs/cross_head_norm.md gives the measurement behind each choice.
#pragma once

#include <cstdint>
#include <string>

#include "cross_head_norm/vectors.h"
#include "include/dtype.h"
#include "include/plan.h"

namespace cookbook::cross_head_norm::tuned {

constexpr int kRowsPerToken = 2;  // q's and k's

// Path 1: rung 7's warp per token (v7_warp_per_token.cuh keeps the same constants).
constexpr int kWarpPerTokenWarps = 4;       // tokens per CTA
constexpr int kWarpPerTokenMaxVecs = 8;     // vectors per lane
constexpr int64_t kTokensPerVector = 18;    // tokens per 16-byte vector of a token (q's and k's), at least
// Path 2: the staged row (staged_row.cuh) and rung 2's strided kernel, both CTAs of 256 threads.
constexpr int kStagedThreads = 256;
constexpr int kStridedThreads = 256;
// Path 4.
constexpr int kFourWarps = 4 * kWarpSize;              // the block from one wave up
constexpr int64_t kTokenMajorMinWaves = 3;
constexpr int kMaxHeldVecs = 4;                        // 4 vectors of row and 4 of float32 weights: 48 registers
constexpr int kLikeRowsVecsPerThread = 2;              // in kMaxThreads threads
constexpr int kLikeRowsMinVecs = kFourWarps * kMaxVecsPerThread / 2 + 1;
constexpr int kLikeRowsMaxVecs = kMaxThreads * kLikeRowsVecsPerThread;
constexpr int kLikeRowsMaxWidthRatio = 2;              // the wider row at most twice the narrower
constexpr int64_t kWarmBytes = int64_t{2} << 20;       // rows warmed before the wait, first in grid order
constexpr int64_t kMaxWarmCallBytes = int64_t{192} << 20;  // read and written
constexpr int64_t kMaxGridX = 2147483647;              // CTAs along grid.x: the token-major grid's bound

static_assert(kFourWarps % kWarpSize == 0 && kFourWarps <= kMaxThreads, "four warps: within a row's largest block");
static_assert(kTokenMajorMinWaves >= 1, "the token-major grid needs the wave the four-warp CTAs need");
static_assert(kMaxHeldVecs <= kMaxVecsPerThread, "held weights: at most a thread's vector slots");
static_assert(kLikeRowsMaxVecs == kFourWarps * kMaxVecsPerThread,
              "like rows: the rows four warps hold at their most vectors per thread, in the largest CTA");
static_assert(kLikeRowsMaxWidthRatio >= 1, "a width ratio: wider over narrower");
static_assert(kWarmBytes < kMaxWarmCallBytes, "the warm covers a part of a call's rows");

// The tuned kernel's template arguments beyond the dtype, rounding and vectors per thread.
enum class GridOrder : int { kTokensByTensor, kTokenMajor };  // (tokens, 2), or (token, tensor) pairs on grid.x
enum class Weights : int { kAfterTheSum, kWithTheRow };        // when a thread loads its weight vectors
enum class Warm : int { kNothing, kFirstRows, kFirstRowsAndNextWave };  // what the CTAs warm into L2

// What the policy reads of a call.
struct Call {
  DType dtype;
  Rounding rounding;
  int64_t num_tokens;
  int q_hidden;
  int k_hidden;
  bool rows_are_vectors;         // every q and k row starts on a 16-byte boundary and is whole vectors
  bool weights_are_vectors;      // both weights start on a 16-byte boundary
  bool rows_share_token_stride;  // q and k: one token stride, wider than either row (views of one tensor)
  int64_t staged_row_bytes;      // the widest row the staged kernel's shared memory takes here; 0: no bulk copies
};

// A kernel the plan can launch, with its template arguments.
enum class KernelName : int { kRowPerCta, kWarpPerToken, kStagedRow, kStrided };

struct Kernel {
  KernelName name = KernelName::kRowPerCta;
  DType dtype = DType::kBFloat16;
  Rounding rounding = Rounding::kFused;
  int vecs = 0;  // kVecsPerThread (per lane: the warp per token); none for the staged and strided kernels
  GridOrder grid_order = GridOrder::kTokensByTensor;
  Weights weights = Weights::kAfterTheSum;
  Warm warm = Warm::kNothing;
  int fixed_block = 0;  // kBlockThreads: the block size compiled in; 0: set at launch (blockDim.x)
  int block = 0;        // threads per CTA launched
};

// The variants of the tuned kernel that the policy can launch, and so the ones compiled: for each,
// kVecsPerThread, kGridOrder, kWeights, kWarm, kBlockThreads.
struct RowVariant {
  int vecs;
  GridOrder grid_order;
  Weights weights;
  Warm warm;
  int fixed_block;
};

constexpr RowVariant kRowVariants[] = {
    // below a wave of four-warp CTAs, rung 6's CTA, the weights held where every row is resident
    {1, GridOrder::kTokensByTensor, Weights::kWithTheRow, Warm::kNothing, 0},
    {1, GridOrder::kTokensByTensor, Weights::kAfterTheSum, Warm::kNothing, 0},
    {2, GridOrder::kTokensByTensor, Weights::kWithTheRow, Warm::kNothing, 0},
    {2, GridOrder::kTokensByTensor, Weights::kAfterTheSum, Warm::kNothing, 0},
    {4, GridOrder::kTokensByTensor, Weights::kWithTheRow, Warm::kNothing, 0},
    {4, GridOrder::kTokensByTensor, Weights::kAfterTheSum, Warm::kNothing, 0},
    {8, GridOrder::kTokensByTensor, Weights::kAfterTheSum, Warm::kNothing, 0},
    // one to kTokenMajorMinWaves waves: held weights, the next wave warmed
    {2, GridOrder::kTokensByTensor, Weights::kWithTheRow, Warm::kFirstRowsAndNextWave, 0},
    {4, GridOrder::kTokensByTensor, Weights::kWithTheRow, Warm::kFirstRowsAndNextWave, 0},
    {8, GridOrder::kTokensByTensor, Weights::kAfterTheSum, Warm::kFirstRowsAndNextWave, 0},
    // many waves (and like rows, at two vectors per thread)
    {2, GridOrder::kTokensByTensor, Weights::kAfterTheSum, Warm::kFirstRows, 0},
    {4, GridOrder::kTokensByTensor, Weights::kAfterTheSum, Warm::kFirstRows, 0},
    {8, GridOrder::kTokensByTensor, Weights::kAfterTheSum, Warm::kFirstRows, 0},
    // the token-major grid
    {2, GridOrder::kTokenMajor, Weights::kAfterTheSum, Warm::kFirstRows, kFourWarps},
    {4, GridOrder::kTokenMajor, Weights::kAfterTheSum, Warm::kFirstRows, kFourWarps},
    {8, GridOrder::kTokenMajor, Weights::kAfterTheSum, Warm::kFirstRows, kFourWarps},
    {8, GridOrder::kTokenMajor, Weights::kAfterTheSum, Warm::kFirstRows, 0},
};

constexpr bool is_variant(const Kernel& kernel, const RowVariant& v) {
  return kernel.vecs == v.vecs && kernel.grid_order == v.grid_order && kernel.weights == v.weights &&
         kernel.warm == v.warm && kernel.fixed_block == v.fixed_block;
}

// Whether `kernel` is one the tuned extension compiled.
constexpr bool is_compiled(const Kernel& kernel) {
  if (kernel.name == KernelName::kWarpPerToken) return kernel.vecs == 1 || kernel.vecs == 2 || kernel.vecs == 4 || kernel.vecs == 8;
  if (kernel.name != KernelName::kRowPerCta) return true;
  for (const RowVariant& v : kRowVariants) {
    if (is_variant(kernel, v)) return true;
  }
  return false;
}

// What the policy picks for one call, and the numbers that decided it.
enum class Path : int { kNothing, kWarpPerToken, kStagedRow, kStrided, kBelowAWave, kFromAWave };

struct Plan {
  Kernel kernel;
  Path path = Path::kNothing;
  int64_t grid_x = 0, grid_y = 1, grid_z = 1;
  int block = 0;
  int64_t shared_bytes = 0;  // dynamic
  bool programmatic = false;
  // The call.
  int64_t rows = 0;           // q's and k's: 2 per token
  int q_vecs = 0, k_vecs = 0;  // 16-byte vectors of a row (whole vectors or not)
  int widest_vecs = 0;
  int64_t call_bytes = 0;     // q and k read and written
  int sms = 0;
  // Path 1.
  int64_t warp_per_token_tokens = 0;  // the tokens it needs: kTokensPerVector x (q_vecs + k_vecs)
  // Path 4: one wave of four-warp CTAs (rung 6's CTA below it).
  int four_warp_vecs = 0;         // vectors per thread four warps need (1: rung 6's CTA at any size)
  int wave_block = 0;             // threads per four-warp CTA as launched for these rows
  int wave_blocks_per_sm = 0;
  int64_t wave_rows = 0;          // rows (CTAs) of one wave
  bool fills_gpu = false;         // rows >= one wave
  bool many_waves = false;        // rows >= kTokenMajorMinWaves waves
  bool token_major = false;
  bool like_rows = false;
  int held_blocks_per_sm = 0;     // below a wave: the held kernel's
  int64_t held_resident_rows = 0;
  // The launched kernel's own wave (for its warms).
  int launched_blocks_per_sm = 0;
  int64_t launched_wave_rows = 0;
  int64_t warm_first_ctas = 0;    // CTAs first in grid order that warm their own row before the wait
  int64_t rows_ahead = 0;         // with the next wave warmed: how far ahead in grid order
};

constexpr int max_of(int a, int b) { return a > b ? a : b; }
constexpr int min_of(int a, int b) { return a < b ? a : b; }

// The vector slots a warp's lane needs for a row of `row_vecs` vectors: 1, 2, 4 or 8.
constexpr int lane_vecs(int row_vecs) {
  int vecs = 1;
  while (vecs < kWarpPerTokenMaxVecs && row_vecs > kWarpSize * vecs) vecs *= 2;
  return vecs;
}

// Vectors per thread where four warps hold the wider row: 0 where one vector each does (rung 6's
// CTA then at any size), else 2, 4 or 8.
constexpr int four_warp_vecs_for(int widest_vecs) {
  const int needed = (widest_vecs + kFourWarps - 1) / kFourWarps;
  return needed <= 1 ? 0 : needed <= 2 ? 2 : needed <= 4 ? 4 : kMaxVecsPerThread;
}

// Whether the rows take the 512-thread, two-vector CTA from a wave up (off the token-major grid).
constexpr bool like_rows(int widest_vecs, int narrowest_vecs) {
  return widest_vecs >= kLikeRowsMinVecs && widest_vecs <= kLikeRowsMaxVecs &&
         widest_vecs <= kLikeRowsMaxWidthRatio * narrowest_vecs;
}

// The CTAs, first in grid order, whose rows add up to at most kWarmBytes (on the token-major grid a
// token's q row then its k row; on the (tokens, 2) grid every q row before the first k row), at
// most the `resident` CTAs of one wave (those that can be waiting while the previous kernel
// drains); none in calls that move more than kMaxWarmCallBytes.
inline int64_t warm_ctas(const Call& call, bool token_major, int64_t call_bytes, int64_t resident) {
  const int64_t q_row_bytes = int64_t{call.q_hidden} * element_bytes(call.dtype);
  const int64_t k_row_bytes = int64_t{call.k_hidden} * element_bytes(call.dtype);
  if (call_bytes > kMaxWarmCallBytes) return 0;
  int64_t ctas = 0;
  if (token_major) {
    const int64_t tokens = kWarmBytes / (q_row_bytes + k_row_bytes);
    ctas = kRowsPerToken * tokens + (kWarmBytes - tokens * (q_row_bytes + k_row_bytes) >= q_row_bytes ? 1 : 0);
  } else {
    const int64_t q_rows_in_budget = kWarmBytes / q_row_bytes;
    const int64_t q_rows = q_rows_in_budget < call.num_tokens ? q_rows_in_budget : call.num_tokens;
    ctas = q_rows + (q_rows == call.num_tokens ? (kWarmBytes - q_rows * q_row_bytes) / k_row_bytes : 0);
  }
  return ctas < resident ? ctas : resident;
}

inline Kernel row_kernel(const Call& call, int vecs, GridOrder grid_order, Weights weights, Warm warm, int fixed_block,
                         int block) {
  return {KernelName::kRowPerCta, call.dtype, call.rounding, vecs, grid_order, weights, warm, fixed_block, block};
}

// The plan of `call` on a GPU of `sms` SMs; blocks_per_sm(kernel) is how many CTAs of `kernel` (at
// kernel.block threads) are resident at once on one SM (cudaOccupancyMaxActiveBlocksPerMultiprocessor
// on a GPU).
template <typename BlocksPerSm>
Plan plan(const Call& call, int sms, BlocksPerSm&& blocks_per_sm) {
  Plan plan{};
  const int elems = vec_elems(call.dtype);
  const int widest = max_of(call.q_hidden, call.k_hidden);
  plan.sms = sms;
  plan.rows = call.num_tokens * kRowsPerToken;
  plan.q_vecs = call.q_hidden / elems;
  plan.k_vecs = call.k_hidden / elems;
  plan.widest_vecs = widest / elems;
  plan.call_bytes = 2 * call.num_tokens * (int64_t{call.q_hidden} + call.k_hidden) * element_bytes(call.dtype);
  if (plan.rows == 0) return plan;
  const auto wave_of = [&](int blocks) { return int64_t{sms} * (blocks > 0 ? blocks : 1); };
  const bool vectors = call.rows_are_vectors && call.weights_are_vectors;
  const auto tokens_by_tensor = [&] {
    plan.grid_x = call.num_tokens;
    plan.grid_y = kRowsPerToken;
  };

  // 1. Narrow rows at many tokens: a warp per token.
  plan.warp_per_token_tokens = kTokensPerVector * (plan.q_vecs + plan.k_vecs);
  if (vectors && plan.widest_vecs <= kWarpPerTokenMaxVecs * kWarpSize && call.num_tokens >= plan.warp_per_token_tokens) {
    plan.path = Path::kWarpPerToken;
    plan.kernel = {KernelName::kWarpPerToken, call.dtype, call.rounding, lane_vecs(plan.widest_vecs)};
    plan.kernel.block = kWarpPerTokenWarps * kWarpSize;
    plan.grid_x = (call.num_tokens + kWarpPerTokenWarps - 1) / kWarpPerTokenWarps;
    plan.block = plan.kernel.block;
    plan.programmatic = true;
    return plan;
  }
  // 2. Rows wider than a CTA's registers hold, and 3. rows off the vector path.
  const bool held_in_registers = plan.widest_vecs <= kMaxThreads * kMaxVecsPerThread;
  const int64_t row_bytes = int64_t{widest} * element_bytes(call.dtype);
  if (!held_in_registers && vectors && row_bytes <= call.staged_row_bytes) {
    plan.path = Path::kStagedRow;
    plan.kernel = {KernelName::kStagedRow, call.dtype, call.rounding};
    plan.kernel.block = kStagedThreads;
    tokens_by_tensor();
    plan.block = kStagedThreads;
    plan.shared_bytes = row_bytes;
    plan.programmatic = true;
    return plan;
  }
  if (!held_in_registers || !vectors) {
    plan.path = Path::kStrided;
    plan.kernel = {KernelName::kStrided, call.dtype, call.rounding};
    plan.kernel.block = kStridedThreads;
    tokens_by_tensor();
    plan.block = kStridedThreads;
    return plan;
  }

  // 4. The tuned kernel: a CTA per row.
  plan.programmatic = true;
  plan.four_warp_vecs = four_warp_vecs_for(plan.widest_vecs);
  if (plan.four_warp_vecs > 0) {
    const int vecs = plan.four_warp_vecs;
    plan.wave_block = threads_for(plan.widest_vecs, vecs);
    plan.wave_blocks_per_sm = blocks_per_sm(row_kernel(call, vecs, GridOrder::kTokensByTensor, Weights::kAfterTheSum,
                                                       Warm::kNothing, 0, plan.wave_block));
    plan.wave_rows = wave_of(plan.wave_blocks_per_sm);
    plan.fills_gpu = plan.rows >= plan.wave_rows;
  }
  if (plan.fills_gpu) {
    plan.path = Path::kFromAWave;
    const int vecs = plan.four_warp_vecs;
    plan.many_waves = plan.rows >= kTokenMajorMinWaves * plan.wave_rows;
    plan.token_major = call.rows_share_token_stride && plan.rows <= kMaxGridX && plan.many_waves;
    plan.like_rows = !plan.token_major && vecs == kMaxVecsPerThread &&
                     like_rows(plan.widest_vecs, min_of(plan.q_vecs, plan.k_vecs));
    if (plan.token_major) {
      const int fixed = plan.widest_vecs <= kFourWarps * vecs ? kFourWarps : 0;  // else float32 rows past 4096
      plan.kernel = row_kernel(call, vecs, GridOrder::kTokenMajor, Weights::kAfterTheSum, Warm::kFirstRows, fixed,
                               fixed > 0 ? fixed : plan.wave_block);
    } else if (plan.like_rows) {
      plan.kernel = row_kernel(call, kLikeRowsVecsPerThread, GridOrder::kTokensByTensor, Weights::kAfterTheSum,
                               Warm::kFirstRows, 0, threads_for(plan.widest_vecs, kLikeRowsVecsPerThread));
    } else if (!plan.many_waves) {
      const Weights weights = vecs <= kMaxHeldVecs ? Weights::kWithTheRow : Weights::kAfterTheSum;
      plan.kernel = row_kernel(call, vecs, GridOrder::kTokensByTensor, weights, Warm::kFirstRowsAndNextWave, 0,
                               plan.wave_block);
    } else {
      plan.kernel = row_kernel(call, vecs, GridOrder::kTokensByTensor, Weights::kAfterTheSum, Warm::kFirstRows, 0,
                               plan.wave_block);
    }
    plan.launched_blocks_per_sm = blocks_per_sm(plan.kernel);
    plan.launched_wave_rows = wave_of(plan.launched_blocks_per_sm);
    plan.rows_ahead = plan.kernel.warm == Warm::kFirstRowsAndNextWave ? plan.launched_wave_rows : 0;
    plan.warm_first_ctas = warm_ctas(call, plan.token_major, plan.call_bytes, plan.launched_wave_rows);
    if (plan.token_major) {
      plan.grid_x = plan.rows;
    } else {
      tokens_by_tensor();
    }
    plan.block = plan.kernel.block;
    return plan;
  }
  // Below one wave of four-warp CTAs (or rows that one vector per thread of four warps holds):
  // rung 6's CTA, the weights held with the row where every row of the call is resident at once.
  plan.path = Path::kBelowAWave;
  const int vecs = fewest_vecs_per_thread(plan.widest_vecs);
  const int block = threads_for(plan.widest_vecs, vecs);
  plan.kernel = row_kernel(call, vecs, GridOrder::kTokensByTensor, Weights::kAfterTheSum, Warm::kNothing, 0, block);
  if (vecs <= kMaxHeldVecs) {
    const Kernel held = row_kernel(call, vecs, GridOrder::kTokensByTensor, Weights::kWithTheRow, Warm::kNothing, 0, block);
    plan.held_blocks_per_sm = blocks_per_sm(held);
    plan.held_resident_rows = wave_of(plan.held_blocks_per_sm);
    if (plan.rows <= plan.held_resident_rows) plan.kernel = held;
  }
  tokens_by_tensor();
  plan.block = block;
  return plan;
}

// ---- how `cookbook explain` tells a plan ----------------------------------------------------------
// The kernel's function name and its template arguments as nvcc's report prints them (enums as
// their values), comma-separated: how `cookbook explain` finds its registers off a GPU.
inline std::string kernel_function(const Kernel& kernel) {
  switch (kernel.name) {
    case KernelName::kWarpPerToken: return "cookbook::cross_head_norm::v7::cross_head_norm_v7_kernel";
    case KernelName::kStagedRow: return "cookbook::cross_head_norm::tuned::cross_head_norm_staged_kernel";
    case KernelName::kStrided: return "cookbook::cross_head_norm::v2::cross_head_norm_v2_kernel";
    default: return "cookbook::cross_head_norm::tuned::cross_head_norm_tuned_kernel";
  }
}

inline std::string template_values(const Kernel& kernel) {
  std::string values = std::string(storage_name(kernel.dtype)) + "," + std::to_string(static_cast<int>(kernel.rounding));
  if (kernel.name == KernelName::kWarpPerToken) values += "," + std::to_string(kernel.vecs);
  if (kernel.name == KernelName::kRowPerCta) {
    values += "," + std::to_string(kernel.vecs) + "," + std::to_string(static_cast<int>(kernel.grid_order)) + "," +
              std::to_string(static_cast<int>(kernel.weights)) + "," + std::to_string(static_cast<int>(kernel.warm)) +
              "," + std::to_string(kernel.fixed_block);
  }
  return values;
}

inline const char* grid_order_name(GridOrder order) {
  return order == GridOrder::kTokenMajor ? "GridOrder::kTokenMajor" : "GridOrder::kTokensByTensor";
}
inline const char* weights_name(Weights weights) {
  return weights == Weights::kWithTheRow ? "Weights::kWithTheRow" : "Weights::kAfterTheSum";
}
inline const char* warm_name(Warm warm) {
  return warm == Warm::kNothing ? "Warm::kNothing" : warm == Warm::kFirstRows ? "Warm::kFirstRows" : "Warm::kFirstRowsAndNextWave";
}
inline const char* path_name(Path path) {
  switch (path) {
    case Path::kWarpPerToken: return "warp_per_token";
    case Path::kStagedRow: return "staged_row";
    case Path::kStrided: return "strided";
    case Path::kBelowAWave: return "cta_per_row_below_a_wave";
    case Path::kFromAWave: return "cta_per_row_from_a_wave";
    default: return "nothing";
  }
}

inline std::string template_arguments(const Kernel& kernel) {
  std::string args = std::string("T=") + storage_name(kernel.dtype) + ", kRounding=" + rounding_name(kernel.rounding);
  if (kernel.name == KernelName::kWarpPerToken) args += ", kVecsPerLane=" + std::to_string(kernel.vecs);
  if (kernel.name == KernelName::kRowPerCta) {
    args += ", kVecsPerThread=" + std::to_string(kernel.vecs) + ", kGridOrder=" + grid_order_name(kernel.grid_order) +
            ", kWeights=" + weights_name(kernel.weights) + ", kWarm=" + warm_name(kernel.warm) +
            ", kBlockThreads=" + std::to_string(kernel.fixed_block);
  }
  return args;
}

// `numerator / denominator` with two decimals, as text ("3.91").
inline std::string ratio_text(int64_t numerator, int64_t denominator) {
  if (denominator <= 0) return "-";
  const int64_t hundredths = (numerator * 100 + denominator / 2) / denominator;
  const int64_t cents = hundredths % 100;
  return std::to_string(hundredths / 100) + "." + (cents < 10 ? "0" : "") + std::to_string(cents);
}

inline std::string describe(const Plan& plan) {
  Description d;
  d.add("kernel", kernel_function(plan.kernel))
      .add("template_arguments", template_arguments(plan.kernel))
      .add("template_values", template_values(plan.kernel))
      .add("path", path_name(plan.path))
      .add("grid", plan.grid_x * plan.grid_y * plan.grid_z)
      .add("grid_x", plan.grid_x)
      .add("grid_y", plan.grid_y)
      .add("grid_z", plan.grid_z)
      .add("block", plan.block)
      .add("shared_bytes", plan.shared_bytes)
      .add("programmatic", plan.programmatic)
      .add("rows", plan.rows)
      .add("q_vecs", plan.q_vecs)
      .add("k_vecs", plan.k_vecs)
      .add("widest_vecs", plan.widest_vecs)
      .add("call_bytes", plan.call_bytes)
      .add("sms", plan.sms)
      .add("warp_per_token_tokens", plan.warp_per_token_tokens);
  if (plan.path == Path::kBelowAWave || plan.path == Path::kFromAWave) {
    d.add("four_warp_vecs", plan.four_warp_vecs)
        .add("wave_block", plan.wave_block)
        .add("wave_blocks_per_sm", plan.wave_blocks_per_sm)
        .add("wave_rows", plan.wave_rows)
        .add("waves", ratio_text(plan.rows, plan.wave_rows))
        .add("fills_gpu", plan.fills_gpu)
        .add("many_waves", plan.many_waves)
        .add("token_major", plan.token_major)
        .add("like_rows", plan.like_rows)
        .add("held_blocks_per_sm", plan.held_blocks_per_sm)
        .add("held_resident_rows", plan.held_resident_rows)
        .add("launched_blocks_per_sm", plan.launched_blocks_per_sm)
        .add("launched_wave_rows", plan.launched_wave_rows)
        .add("warm_first_ctas", plan.warm_first_ctas)
        .add("rows_ahead", plan.rows_ahead);
  }
  return d.text;
}

}  // namespace cookbook::cross_head_norm::tuned
