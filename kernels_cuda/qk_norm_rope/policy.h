// The tuned kernel's host policy: for one call, which kernel runs, with which template arguments,
// grid and block, and why. Plain C++ (the standard library and include/dtype.h, no CUDA or torch
// header): the launcher (tuned.cuh) runs it before every launch, and `cookbook explain` can run
// the same code compiled for the host, with each kernel's resident blocks per SM computed from
// nvcc's resource report.
//
// A call takes the vector path where its rows and tables are 16-byte aligned, rope_dim is a whole
// number of two-vector units and head_dim is compiled (kVectorHeadDims); anything else runs rung
// 2's warp per row. On the vector path a lane group (PairLanes in rows.cuh) owns a row, a block
// holds rows_per_block of them, and the choice is the walk:
//   * whole tokens: where the rows need more than one trip of the whole-token kernel's resident
//     blocks, a persistent grid cut to a whole number of tokens' rows, so that each lane group
//     keeps one head for its whole walk and holds that head's weight in registers (rung 7). The
//     cut is taken only where it leaves at most 1 / kMaxIdleShare of the resident blocks out and
//     makes no lane group's walk longer than on the resident grid (a call lasts as long as its
//     longest walk);
//   * steps: otherwise, where the rows need more than one trip of the steps kernel's resident
//     blocks, the resident grid, each lane group advancing (token, head) by the launcher's steps
//     and reading its row's weight after the sum;
//   * one row: otherwise (the call fits in one trip: decode), one row per lane group, its tables
//     warmed into L2 before the programmatic wait and read with the row (rung 6).
// docs/qk_norm_rope.md gives the measurement behind each choice.
#pragma once

#include <cstdint>
#include <numeric>
#include <string>

#include "include/dtype.h"

namespace cookbook::qk_norm_rope::tuned {

// The hardware sizes the policy reasons in (tuned.cuh checks them against include/common.cuh).
constexpr int kWarpLanes = 32;
constexpr int kVectorBytes = 16;  // one lane's widest load or store

constexpr int kThreadsPerBlock = 256;
constexpr int kWarpPerRowWarps = 8;  // rung 2's block (v2_one_pass_warp_per_row.cuh keeps the same constant)
constexpr int kNumWeights = 2;       // q's and k's: block 0 warms each with one lane group
static_assert(kThreadsPerBlock % kWarpLanes == 0, "whole warps per block");

// The head_dims compiled for the vector path; any other runs rung 2's warp per row.
constexpr int kVectorHeadDims[] = {64, 128, 256};

// The whole-token grid may leave at most 1 / kMaxIdleShare of the resident blocks out.
constexpr int64_t kMaxIdleShare = 32;
static_assert(kMaxIdleShare > 1, "a share of the resident blocks");

// The policy's choices, as the kernel's template arguments take them.
enum class Layout : int { kInterleaved = 0, kNeox = 1 };     // pairs (2i, 2i + 1), or (i, i + rope_dim / 2)
enum class TableDtype : int { kActivation = 0, kFloat32 = 1 };  // a table's elements: the activation dtype or float32
enum class Walk : int { kOneRow = 0, kSteps = 1, kWholeTokens = 2 };

// What the policy reads of a call.
struct Call {
  DType dtype;
  Rounding rounding;
  int64_t num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  int rope_dim;
  Layout layout;
  TableDtype weights;        // q_weight and k_weight
  TableDtype cache;          // cos_sin_cache
  bool rows_are_vectors;     // every row of q and k starts on a 16-byte boundary
  bool tables_are_vectors;   // both weights and the cache start on 16-byte boundaries
};

// A kernel the plan can launch, with its template arguments.
enum class KernelName : int { kTuned, kWarpPerRow };

struct Kernel {
  KernelName name = KernelName::kTuned;
  DType dtype = DType::kBFloat16;
  Rounding rounding = Rounding::kFused;
  int head_dim = 0;  // the tuned kernel's template arguments from here on
  Layout layout = Layout::kNeox;
  TableDtype weights = TableDtype::kActivation;
  TableDtype cache = TableDtype::kFloat32;
  Walk walk = Walk::kOneRow;
  int block = kThreadsPerBlock;
};

// Why a call is off the vector path (kNone: it is on it).
enum class OffVectors : int { kNone, kRowsUnaligned, kTablesUnaligned, kRopeDim, kHeadDim };

// What the policy picks for one call, and the numbers that decided it.
struct Plan {
  Kernel kernel;
  int64_t rows = 0;
  int64_t grid = 0;
  int block = 0;
  int shared_bytes = 0;
  bool programmatic = false;
  int64_t token_step = 0;  // a walk's step: the grid's rows, in whole tokens and heads
  int head_step = 0;
  // The vector path's geometry and the walk's numbers.
  OffVectors off_vectors = OffVectors::kNone;
  int lanes_per_row = 0;
  int rows_per_block = 0;
  int sms = 0;
  int64_t needed_blocks = 0;            // one row per lane group
  int whole_tokens_blocks_per_sm = 0;
  int64_t whole_tokens_resident = 0;    // blocks
  int64_t token_cycle_blocks = 0;       // the fewest blocks whose lane groups are whole tokens' rows
  int64_t whole_tokens_cut = 0;         // blocks: the resident ones, rounded down to whole cycles
  int64_t longest_walk_resident = 0;    // rows of the longest walk on the resident grid
  int64_t longest_walk_cut = 0;         // ... and on the cut one
  bool cut_leaves_few_out = false;
  int steps_blocks_per_sm = 0;
  int64_t steps_resident = 0;           // blocks
};

constexpr int element_bytes_of(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }
constexpr int vec_elems_of(DType dtype) { return kVectorBytes / element_bytes_of(dtype); }

constexpr bool is_vector_head_dim(int head_dim) {
  for (int d : kVectorHeadDims) {
    if (d == head_dim) return true;
  }
  return false;
}

// The lanes of a row's group: one per two-vector unit, at most a warp (PairLanes in rows.cuh).
constexpr int lanes_per_row_of(DType dtype, int head_dim) {
  const int units = head_dim / vec_elems_of(dtype) / 2;
  return units < kWarpLanes ? units : kWarpLanes;
}

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The longest walk, in rows, of `rows` rows on `grid` blocks of `rows_per_block` lane groups.
constexpr int64_t longest_walk(int64_t rows, int64_t grid, int rows_per_block) {
  return ceil_div(rows, grid * rows_per_block);
}

inline Kernel tuned_kernel(const Call& call, Walk walk) {
  return {KernelName::kTuned, call.dtype, call.rounding, call.head_dim, call.layout, call.weights, call.cache, walk,
          kThreadsPerBlock};
}

// The plan of `call` on a GPU of `sms` SMs; blocks_per_sm(kernel) is how many blocks of `kernel`
// are resident at once on one SM (cudaOccupancyMaxActiveBlocksPerMultiprocessor on a GPU).
template <typename BlocksPerSm>
Plan plan(const Call& call, int sms, BlocksPerSm&& blocks_per_sm) {
  Plan plan{};
  const int heads = call.num_q_heads + call.num_kv_heads;
  plan.rows = call.num_tokens * heads;
  plan.sms = sms;
  const int vec_elems = vec_elems_of(call.dtype);
  plan.off_vectors = !call.rows_are_vectors                  ? OffVectors::kRowsUnaligned
                     : !call.tables_are_vectors              ? OffVectors::kTablesUnaligned
                     : call.rope_dim % (2 * vec_elems) != 0  ? OffVectors::kRopeDim
                     : !is_vector_head_dim(call.head_dim)    ? OffVectors::kHeadDim
                                                             : OffVectors::kNone;
  if (plan.rows == 0) return plan;  // nothing to launch
  if (plan.off_vectors != OffVectors::kNone) {  // rung 2's warp per row
    plan.kernel = {KernelName::kWarpPerRow, call.dtype, call.rounding};
    plan.kernel.block = kWarpPerRowWarps * kWarpLanes;
    plan.block = plan.kernel.block;
    plan.lanes_per_row = kWarpLanes;
    plan.rows_per_block = kWarpPerRowWarps;
    plan.grid = ceil_div(plan.rows, plan.rows_per_block);
    return plan;
  }
  plan.lanes_per_row = lanes_per_row_of(call.dtype, call.head_dim);
  plan.rows_per_block = kThreadsPerBlock / plan.lanes_per_row;
  plan.block = kThreadsPerBlock;
  plan.programmatic = true;
  plan.needed_blocks = ceil_div(plan.rows, plan.rows_per_block);
  const auto resident_of = [&](int per_sm) { return static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1); };

  // Whole tokens: where the rows need more than one trip of its resident grid.
  const Kernel whole_tokens = tuned_kernel(call, Walk::kWholeTokens);
  plan.whole_tokens_blocks_per_sm = blocks_per_sm(whole_tokens);
  plan.whole_tokens_resident = resident_of(plan.whole_tokens_blocks_per_sm);
  plan.token_cycle_blocks = heads / std::gcd(heads, plan.rows_per_block);
  plan.whole_tokens_cut = plan.whole_tokens_resident / plan.token_cycle_blocks * plan.token_cycle_blocks;
  plan.longest_walk_resident = longest_walk(plan.rows, plan.whole_tokens_resident, plan.rows_per_block);
  plan.longest_walk_cut = plan.whole_tokens_cut > 0 ? longest_walk(plan.rows, plan.whole_tokens_cut, plan.rows_per_block) : 0;
  plan.cut_leaves_few_out = plan.whole_tokens_cut * kMaxIdleShare >= plan.whole_tokens_resident * (kMaxIdleShare - 1);
  if (plan.needed_blocks > plan.whole_tokens_resident && plan.whole_tokens_cut > 0 && plan.cut_leaves_few_out &&
      plan.longest_walk_cut == plan.longest_walk_resident) {
    plan.kernel = whole_tokens;
    plan.grid = plan.whole_tokens_cut;
    plan.token_step = plan.grid * plan.rows_per_block / heads;
    plan.head_step = 0;  // the cut's rows are whole tokens
    return plan;
  }
  // Steps, or one row per lane group where the call fits in one trip of the steps kernel's grid.
  const Kernel steps = tuned_kernel(call, Walk::kSteps);
  plan.steps_blocks_per_sm = blocks_per_sm(steps);
  plan.steps_resident = resident_of(plan.steps_blocks_per_sm);
  if (plan.needed_blocks <= plan.steps_resident) {
    plan.kernel = tuned_kernel(call, Walk::kOneRow);
    plan.grid = plan.needed_blocks;
    return plan;
  }
  plan.kernel = steps;
  plan.grid = plan.steps_resident;
  const int64_t stride = plan.grid * plan.rows_per_block;
  plan.token_step = stride / heads;
  plan.head_step = static_cast<int>(stride % heads);
  return plan;
}

// ---- the plan in words: `key=value` lines --------------------------------------------------
constexpr const char* storage_type_name(DType dtype) {
  return dtype == DType::kFloat32 ? "float" : dtype == DType::kFloat16 ? "__half" : "__nv_bfloat16";
}

inline const char* name_of(Rounding rounding) { return rounding == Rounding::kFused ? "Rounding::kFused" : "Rounding::kHf"; }
inline const char* name_of(Layout layout) { return layout == Layout::kNeox ? "Layout::kNeox" : "Layout::kInterleaved"; }
inline const char* name_of(TableDtype storage) {
  return storage == TableDtype::kFloat32 ? "TableDtype::kFloat32" : "TableDtype::kActivation";
}
inline const char* name_of(Walk walk) {
  return walk == Walk::kOneRow ? "Walk::kOneRow" : walk == Walk::kSteps ? "Walk::kSteps" : "Walk::kWholeTokens";
}
inline const char* name_of(OffVectors why) {
  switch (why) {
    case OffVectors::kRowsUnaligned: return "rows_unaligned";
    case OffVectors::kTablesUnaligned: return "tables_unaligned";
    case OffVectors::kRopeDim: return "rope_dim_not_whole_units";
    case OffVectors::kHeadDim: return "head_dim_not_compiled";
    default: return "none";
  }
}

// The kernel's function name and its template arguments as nvcc's report prints them (enums as
// their values), comma-separated: how `cookbook explain` finds its registers off a GPU.
inline std::string kernel_function(const Kernel& kernel) {
  return kernel.name == KernelName::kTuned ? "cookbook::qk_norm_rope::tuned::qk_norm_rope_tuned_kernel"
                                           : "cookbook::qk_norm_rope::v2::qk_norm_rope_v2_kernel";
}

inline std::string template_values(const Kernel& kernel) {
  std::string values = std::string(storage_type_name(kernel.dtype)) + "," + std::to_string(static_cast<int>(kernel.rounding));
  if (kernel.name == KernelName::kTuned) {
    values += "," + std::to_string(kernel.head_dim) + "," + std::to_string(static_cast<int>(kernel.layout)) + "," +
              std::to_string(static_cast<int>(kernel.weights)) + "," + std::to_string(static_cast<int>(kernel.cache)) +
              "," + std::to_string(static_cast<int>(kernel.walk));
  }
  return values;
}

inline std::string template_arguments(const Kernel& kernel) {
  std::string args = std::string("T=") + storage_type_name(kernel.dtype) + ", kRounding=" + name_of(kernel.rounding);
  if (kernel.name == KernelName::kTuned) {
    args += ", kHeadDim=" + std::to_string(kernel.head_dim) + ", kLayout=" + name_of(kernel.layout) +
            ", kWeights=" + name_of(kernel.weights) + ", kCache=" + name_of(kernel.cache) + ", kWalk=" + name_of(kernel.walk);
  }
  return args;
}

// One `key=value` line per fact.
class Facts {
 public:
  Facts& add(const char* key, const std::string& value) {
    text_ += std::string(key) + "=" + value + "\n";
    return *this;
  }
  Facts& add(const char* key, const char* value) { return add(key, std::string(value)); }
  Facts& add(const char* key, bool value) { return add(key, value ? "true" : "false"); }
  Facts& add(const char* key, int64_t value) { return add(key, std::to_string(value)); }
  Facts& add(const char* key, int value) { return add(key, std::to_string(value)); }
  const std::string& text() const { return text_; }

 private:
  std::string text_;
};

inline std::string describe(const Plan& plan) {
  Facts facts;
  facts.add("kernel", kernel_function(plan.kernel))
      .add("template_arguments", template_arguments(plan.kernel))
      .add("template_values", template_values(plan.kernel))
      .add("grid", plan.grid)
      .add("block", plan.block)
      .add("shared_bytes", plan.shared_bytes)
      .add("programmatic", plan.programmatic)
      .add("rows", plan.rows)
      .add("lanes_per_row", plan.lanes_per_row)
      .add("rows_per_block", plan.rows_per_block)
      .add("off_vectors", name_of(plan.off_vectors));
  if (plan.kernel.name == KernelName::kTuned) {
    facts.add("walk", name_of(plan.kernel.walk))
        .add("sms", plan.sms)
        .add("needed_blocks", plan.needed_blocks)
        .add("whole_tokens_blocks_per_sm", plan.whole_tokens_blocks_per_sm)
        .add("whole_tokens_resident", plan.whole_tokens_resident)
        .add("token_cycle_blocks", plan.token_cycle_blocks)
        .add("whole_tokens_cut", plan.whole_tokens_cut)
        .add("cut_leaves_few_out", plan.cut_leaves_few_out)
        .add("longest_walk_resident", plan.longest_walk_resident)
        .add("longest_walk_cut", plan.longest_walk_cut)
        .add("steps_blocks_per_sm", plan.steps_blocks_per_sm)
        .add("steps_resident", plan.steps_resident)
        .add("token_step", plan.token_step)
        .add("head_step", plan.head_step);
  }
  return facts.text();
}

}  // namespace cookbook::qk_norm_rope::tuned
