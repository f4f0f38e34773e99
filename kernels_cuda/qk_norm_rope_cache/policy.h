// qk_norm_rope_cache's tuned kernel's host policy: which kernel a call runs, on what grid, and why.
// Plain C++ (no CUDA or torch header): the launcher (tuned.cuh) runs `plan` before every launch,
// and `cookbook explain` runs the same code on the host (explain_host.cpp), off a GPU.
//
//   * one pass: where q, k, v, the tables and both caches are whole 16-byte vectors on 16-byte
//     boundaries, rope_dim is whole two-vector units, head_dim is compiled (64, 128, 256) and the
//     rows and cache slots number under 2^31 (the kernel indexes them in 32 bits): the tuned
//     kernel, one row per lane group over every q, k and v row, programmatic;
//   * split: otherwise, qk_norm_rope's rung 2 (a warp per row) on q and k, then rung 1's copy
//     kernel (cache_copy.cuh): element-wise, any alignment and head_dim.
// docs/qk_norm_rope_cache.md gives the measurements behind the choices.
#pragma once

#include <cstdint>
#include <string>

#include "include/dtype.h"
#include "qk_norm_rope/policy.h"  // the sizes, the layout and table choices, the names: shared as they are
#include "qk_norm_rope_cache/cache_dtype.h"

namespace cookbook::qk_norm_rope_cache::tuned {

using qk_norm_rope::tuned::ceil_div;
using qk_norm_rope::tuned::Facts;
using qk_norm_rope::tuned::is_vector_head_dim;
using qk_norm_rope::tuned::kThreadsPerBlock;
using qk_norm_rope::tuned::kVectorBytes;
using qk_norm_rope::tuned::kVectorHeadDims;
using qk_norm_rope::tuned::kWarpLanes;
using qk_norm_rope::tuned::lanes_per_row_of;
using qk_norm_rope::tuned::Layout;
using qk_norm_rope::tuned::name_of;
using qk_norm_rope::tuned::storage_type_name;
using qk_norm_rope::tuned::TableDtype;
using qk_norm_rope::tuned::vec_elems_of;

constexpr int kCopyWarpsPerBlock = 8;  // the copy kernel's block (cache_copy.cuh keeps the same constant)

// The one-pass kernel divides row and slot indices by multiply-high in 32 bits: at most 2^31 rows
// and slots, so that a row past the last (a block's idle groups) cannot wrap either.
constexpr int64_t kMaxOnePassIndex = int64_t{1} << 31;
static_assert(kMaxOnePassIndex + kThreadsPerBlock <= (int64_t{1} << 32), "every row a block numbers fits in 32 bits");

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
  TableDtype cos_sin;        // cos_sin_cache
  CacheDtype cache;          // k_cache and v_cache
  bool rows_are_vectors;     // every row of q, k and v starts on a 16-byte boundary
  bool tables_are_vectors;   // both weights and the cos/sin table start on 16-byte boundaries
  bool caches_are_vectors;   // both caches start on 16-byte boundaries, strides whole two-vector units
  int64_t num_slots;         // the caches' rows: num_blocks * block_size
};

// A kernel the plan can launch, with its template arguments.
enum class KernelName : int { kOnePass, kSplit };

// Whether the one-pass kernel walks (a grid of at most the resident blocks, each lane group taking a
// row every grid's rows) or gives each lane group one row: it walks with a cache of the activation
// dtype, where it was measured ahead of a row per lane group (docs/results/qk_norm_rope_cache_*_cwalk*);
// with an FP8 cache it was slower (docs/qk_norm_rope_cache.md, tried and dropped).
constexpr bool walks(CacheDtype cache) { return cache == CacheDtype::kActivation; }

struct Kernel {
  KernelName name = KernelName::kOnePass;
  DType dtype = DType::kBFloat16;
  Rounding rounding = Rounding::kFused;
  CacheDtype cache = CacheDtype::kActivation;
  int head_dim = 0;  // the one-pass kernel's template arguments from here on
  Layout layout = Layout::kNeox;
  TableDtype weights = TableDtype::kActivation;
  TableDtype cos_sin = TableDtype::kFloat32;
  int block = kThreadsPerBlock;
};

// Why a call is off the vector path (kNone: it is on it).
enum class OffVectors : int { kNone, kRowsUnaligned, kTablesUnaligned, kCachesUnaligned, kRopeDim, kHeadDim, kIndexOver31Bits };

// What the policy picks for one call, and the numbers that decided it.
struct Plan {
  Kernel kernel;
  int64_t rows = 0;  // q, k and v rows: T * (Hq + 2 Hk)
  int64_t grid = 0;
  int block = 0;
  int shared_bytes = 0;
  bool programmatic = false;
  OffVectors off_vectors = OffVectors::kNone;
  int lanes_per_row = 0;
  int rows_per_block = 0;
  int sms = 0;
  int blocks_per_sm = 0;     // resident blocks of the one-pass kernel per SM
  int64_t waves = 0;         // a block per rows_per_block rows, in waves of resident blocks
  bool walk = false;         // the grid cut to the resident blocks, each lane group walking `waves` rows
};

// The plan of `call` on a GPU of `sms` SMs; blocks_per_sm(kernel) is how many blocks of `kernel`
// are resident at once on one SM (cudaOccupancyMaxActiveBlocksPerMultiprocessor on a GPU).
template <typename BlocksPerSm>
Plan plan(const Call& call, int sms, BlocksPerSm&& blocks_per_sm) {
  Plan plan{};
  plan.rows = call.num_tokens * (call.num_q_heads + 2 * call.num_kv_heads);
  plan.sms = sms;
  const int vec_elems = vec_elems_of(call.dtype);
  plan.off_vectors = !call.rows_are_vectors                  ? OffVectors::kRowsUnaligned
                     : !call.tables_are_vectors              ? OffVectors::kTablesUnaligned
                     : !call.caches_are_vectors              ? OffVectors::kCachesUnaligned
                     : call.rope_dim % (2 * vec_elems) != 0  ? OffVectors::kRopeDim
                     : !is_vector_head_dim(call.head_dim)    ? OffVectors::kHeadDim
                     : plan.rows > kMaxOnePassIndex || call.num_slots > kMaxOnePassIndex ? OffVectors::kIndexOver31Bits
                                                             : OffVectors::kNone;
  if (plan.rows == 0) return plan;  // nothing to launch
  if (plan.off_vectors != OffVectors::kNone) {  // the split path; the grid and block: its copy kernel's
    plan.kernel = {KernelName::kSplit, call.dtype, call.rounding, call.cache};
    plan.kernel.block = kCopyWarpsPerBlock * kWarpLanes;
    plan.block = plan.kernel.block;
    plan.lanes_per_row = kWarpLanes;
    plan.rows_per_block = kCopyWarpsPerBlock;
    plan.grid = ceil_div(call.num_tokens * call.num_kv_heads, plan.rows_per_block);
    return plan;
  }
  plan.kernel = {KernelName::kOnePass, call.dtype,   call.rounding, call.cache,       call.head_dim,
                 call.layout,          call.weights, call.cos_sin,  kThreadsPerBlock};
  plan.lanes_per_row = lanes_per_row_of(call.dtype, call.head_dim);
  plan.rows_per_block = kThreadsPerBlock / plan.lanes_per_row;
  plan.block = kThreadsPerBlock;
  plan.programmatic = true;
  const int64_t blocks = ceil_div(plan.rows, plan.rows_per_block);
  plan.blocks_per_sm = blocks_per_sm(plan.kernel);
  const int64_t resident = static_cast<int64_t>(sms) * (plan.blocks_per_sm > 0 ? plan.blocks_per_sm : 1);
  plan.waves = ceil_div(blocks, resident);
  plan.walk = walks(call.cache);
  plan.grid = plan.walk && blocks > resident ? resident : blocks;
  return plan;
}

// ---- the plan in words: `key=value` lines --------------------------------------------------
inline const char* name_of(CacheDtype cache) {
  return cache == CacheDtype::kFp8E4m3 ? "CacheDtype::kFp8E4m3" : "CacheDtype::kActivation";
}
inline const char* name_of(OffVectors why) {
  switch (why) {
    case OffVectors::kRowsUnaligned: return "rows_unaligned";
    case OffVectors::kTablesUnaligned: return "tables_unaligned";
    case OffVectors::kCachesUnaligned: return "caches_unaligned";
    case OffVectors::kRopeDim: return "rope_dim_not_whole_units";
    case OffVectors::kHeadDim: return "head_dim_not_compiled";
    case OffVectors::kIndexOver31Bits: return "index_over_31_bits";
    default: return "none";
  }
}

// The kernel's function name and its template arguments as nvcc's report prints them (enums as
// their values), comma-separated: how `cookbook explain` finds its registers off a GPU. The split
// path is named by its copy kernel (qk_norm_rope's warp per row runs before it).
inline std::string kernel_function(const Kernel& kernel) {
  return kernel.name == KernelName::kOnePass ? "cookbook::qk_norm_rope_cache::tuned::qk_norm_rope_cache_tuned_kernel"
                                             : "cookbook::qk_norm_rope_cache::copy::qk_norm_rope_cache_copy_kernel";
}

inline std::string template_values(const Kernel& kernel) {
  const std::string storage = storage_type_name(kernel.dtype);
  const std::string cache = std::to_string(static_cast<int>(kernel.cache));
  if (kernel.name == KernelName::kSplit) return storage + "," + cache;
  return storage + "," + std::to_string(static_cast<int>(kernel.rounding)) + "," + std::to_string(kernel.head_dim) + "," +
         std::to_string(static_cast<int>(kernel.layout)) + "," + std::to_string(static_cast<int>(kernel.weights)) + "," +
         std::to_string(static_cast<int>(kernel.cos_sin)) + "," + cache;
}

inline std::string template_arguments(const Kernel& kernel) {
  std::string args = std::string("T=") + storage_type_name(kernel.dtype);
  if (kernel.name == KernelName::kSplit) return args + ", kCache=" + name_of(kernel.cache);
  return args + ", kRounding=" + name_of(kernel.rounding) + ", kHeadDim=" + std::to_string(kernel.head_dim) +
         ", kLayout=" + name_of(kernel.layout) + ", kWeights=" + name_of(kernel.weights) + ", kCosSin=" +
         name_of(kernel.cos_sin) + ", kCache=" + name_of(kernel.cache);
}

inline std::string describe(const Plan& plan) {
  Facts facts;
  facts.add("kernel", kernel_function(plan.kernel))
      .add("template_arguments", template_arguments(plan.kernel))
      .add("template_values", template_values(plan.kernel))
      .add("path", plan.kernel.name == KernelName::kOnePass ? "one_pass" : "split")
      .add("grid", plan.grid)
      .add("block", plan.block)
      .add("shared_bytes", plan.shared_bytes)
      .add("programmatic", plan.programmatic)
      .add("rows", plan.rows)
      .add("lanes_per_row", plan.lanes_per_row)
      .add("rows_per_block", plan.rows_per_block)
      .add("off_vectors", name_of(plan.off_vectors))
      .add("cache", name_of(plan.kernel.cache));
  if (plan.kernel.name == KernelName::kOnePass) {
    facts.add("sms", plan.sms).add("blocks_per_sm", plan.blocks_per_sm).add("waves", plan.waves).add("walk", plan.walk);
  }
  return facts.text();
}

}  // namespace cookbook::qk_norm_rope_cache::tuned
