// tp_qk_norm: cross_head_norm over column shards held by tp ranks; only the per-token sums of
// squares cross GPUs.
//
//   rank r holds the columns x_r of each token's q row (and of its k row), and the matching w_r:
//   sum_sq = sum over ranks r of sum(x_r^2)            the all-reduce: 2 floats per token
//   y_r    = x_r * rsqrt(sum_sq / full_width + eps) * (w_r + weight_offset)
//
// A shard row is a cross_head_norm row cut into tp pieces, so the row access (Params, Row,
// locate_row) comes from cross_head_norm/rows.cuh; only the width in the mean is the full one.
//
// Versions (cookbook/registry.py is the list; tests/test_cuda_sources.py keeps these lines and
// the registry's leads identical):
// v1: the three-launch pipeline: a sum-of-squares kernel writes [T, 2] floats, NCCL all-reduces them, an apply kernel re-reads the shard and writes, both kernels on 16-byte vectors where the rows and weights allow
// v2: one fused kernel: a CTA stages a tile of tokens in shared memory, pushes their partial sums into every peer's symmetric-memory buffer tagged with the call's epoch, waits for the peers' tags, and writes - removes v1's NCCL launch, its latency and the second read of the shard
// v3: at decode sizes the warps of a CTA share each row, the header check runs beside the wait, and the weights are prefetched into L1 before it - removes v2's serial load rounds and two round trips from the critical path
// v4: the decode kernel advances the epoch as soon as every CTA has read it (an atomic beside the wait) instead of after every CTA has finished - removes v3's end-of-kernel atomic round trip
// v5: v4 launched as a programmatic dependent launch: its CTAs become resident while the previous kernel finishes and wait in hardware (griddepcontrol) for its writes, and it lets the next launch do the same - removes the launch gap between back-to-back kernels from each call
// v6: v5 with each lane's loads of a row issued as one batch before any is used (phase 1's shard packs, phase 4's weights) - removes v5's serial round trips: its loads were generic, so the compiler kept each one behind the previous store into the shared tile (one DRAM latency per pack)
// v7: v6 with, at prefill sizes, a persistent walk in which a CTA sums a token's rows and pushes the partials, then finishes that token two steps later: its peers' sums have arrived by then, and its rows are read again from L2 - removes v6's shared-memory tile and its wait per tile, and holds no row through an NVLink round trip (as registers did in a reverted one-CTA-per-token kernel)
// v8: v7 with each thread's effective weights (w + weight_offset, fp32) held in registers for the whole walk, loaded once before its first token - removes the weight loads, conversions and offset adds from every token a CTA finishes: Nsight Compute showed v7's walk issue-bound (73 % of issue slots busy), not waiting on DRAM
// v9: v8 with the effective weights kept in shared memory instead of registers: each thread writes its own columns' fp32 weights there once, before the walk, and reads them back at every finish - keeps v8's per-step savings at v7's register count (72 instead of 96 at the MiniMax shard: 7 CTAs per SM instead of 5) and extends them to 8 vectors per thread
// v10: v9 with, at decode sizes, each lane's packs of its row and their weights loaded together into registers before the exchange and kept there through it - removes the decode kernel's weight loads after the wait (a memory round trip on every call's critical path; the L1 prefetch did not hide it) and its shared-memory tile
// v11: one CTA per token; thread vectors held through the exchange, the next token's loaded before the wait - removes v10's shared tiles between decode and prefill
// v12: v10's and v11's kernels chosen per chunk from a table keyed by world size - removes v10's dispatch, tuned at TP=2 alone
// v13: at decode and mid sizes, v11's walk with one thread per 16-byte vector and the call's counters read beside the first loads - removes v11's serial counter reads before its first barrier, and v10's tiles
//
// Torch-free: raw pointers and element strides (64-bit). bindings/tp_qk_norm.cu is the torch
// glue; cookbook/tp_workspace.py allocates the peer buffers and documents their protocol.
#pragma once

#include <cstring>

#include "cross_head_norm/rows.cuh"
#include "include/common.cuh"

namespace cookbook::tp_qk_norm {

using cross_head_norm::kK;
using cross_head_norm::kNumTensors;
using cross_head_norm::kQ;
using cross_head_norm::locate_row;
using cross_head_norm::Params;  // this rank's shard: q_hidden / k_hidden are the SHARD widths
using cross_head_norm::Row;
using cross_head_norm::RawWeights;  // weights as loaded: tp v6's batches and v10's held rows
using cross_head_norm::load_raw_weights;
using cross_head_norm::effective_weights;

// ------------------------------------------------------------------------------------------
// v1: the three-launch pipeline: a sum-of-squares kernel writes [T, 2] floats, NCCL all-reduces them, an apply kernel re-reads the shard and writes, both kernels on 16-byte vectors where the rows and weights allow
// The NCCL all-reduce between the kernels is issued by the host (cookbook/cuda.py). This is
// the path backend="auto" takes where the ranks cannot reach each other's memory, so its kernels
// move bytes as cross_head_norm v3 does: a CTA per (token, tensor) row walks it in 16-byte
// vectors, kV1VecsPerStep per thread per step, every load of a step issued before any is used.
// Rows or weights that are not 16-byte aligned (odd offsets into a fused tensor, widths that
// are not whole vectors) take the element-wise kernels below, grid (tokens, 2).
// ------------------------------------------------------------------------------------------
constexpr int kV1Threads = 256;  // element-wise kernels
static_assert(kV1Threads % kWarpSize == 0 && kV1Threads <= kMaxWarpsPerBlock * kWarpSize,
              "v1: whole warps, at most 1024 threads");

struct ApplyParams {
  Params shard;
  const float* sum_sq;  // [T][kNumTensors], summed over every rank
  float q_full_width;   // q_hidden * tp
  float k_full_width;
};

template <typename T>
__global__ void __launch_bounds__(kV1Threads) sum_sq_kernel(Params p, float* sum_sq) {
  const int tensor = static_cast<int>(blockIdx.y);
  const Row<T> r = locate_row<T>(p, blockIdx.x, tensor);
  float partial = 0.f;
  for (int d = threadIdx.x; d < r.hidden; d += kV1Threads) {
    const float x = to_float<T>(r.x[d]);
    partial += x * x;
  }
  partial = block_sum(partial);
  if (threadIdx.x == 0) sum_sq[static_cast<int64_t>(blockIdx.x) * kNumTensors + tensor] = partial;
}

template <typename T, bool kHfRounding>
__global__ void __launch_bounds__(kV1Threads) apply_kernel(ApplyParams a) {
  const int tensor = static_cast<int>(blockIdx.y);
  const Row<T> r = locate_row<T>(a.shard, blockIdx.x, tensor);
  const float full_width = tensor == kQ ? a.q_full_width : a.k_full_width;
  const float rstd = rstd_from(a.sum_sq[static_cast<int64_t>(blockIdx.x) * kNumTensors + tensor], full_width,
                               a.shard.eps);
  for (int d = threadIdx.x; d < r.hidden; d += kV1Threads) {  // the second read of the shard
    const float w = effective_weight<T, kHfRounding>(load_weight<T>(r.w, r.w_is_fp32, d), a.shard.weight_offset);
    r.x[d] = normalize<T, kHfRounding>(to_float<T>(r.x[d]), rstd, w);
  }
}

// The vector kernels. A step of a thread covers vectors first, first + kV1VecThreads, ... of
// its row (cross_head_norm's load_row_vectors); a CTA's step covers kV1VecsPerRowStep vectors:
// the MiniMax-M2 TP=2 shard's q row (3072 bf16, 384 vectors) in one step, its k row (64) in a
// quarter of one. kTokenMajor: grid.x walks (token, tensor) pairs, CTA 2t + tensor on token t's
// row, for q and k that are views of one tensor of token rows (cross_head_norm v9's grid: the
// rows in flight lie side by side); else grid (tokens, 2).
constexpr int kV1VecWarps = 4;
constexpr int kV1VecThreads = kV1VecWarps * kWarpSize;
constexpr int kV1VecsPerStep = 4;  // per thread: 4 x 16 bytes in flight, as v7's CTAs of cross_head_norm
constexpr int kV1VecsPerRowStep = kV1VecThreads * kV1VecsPerStep;
static_assert(cross_head_norm::valid_block_size<kV1VecThreads>, "v1 vector kernels: whole warps, at most 1024 threads");

template <typename T, bool kTokenMajor>
__device__ __forceinline__ Row<T> locate_grid_row(const Params& p) {
  if constexpr (kTokenMajor) return locate_row<T>(p, blockIdx.x / kNumTensors, static_cast<int>(blockIdx.x % kNumTensors));
  return locate_row<T>(p, blockIdx.x, static_cast<int>(blockIdx.y));
}

template <bool kTokenMajor>
__device__ __forceinline__ int64_t grid_row_slot() {  // the CTA's row's slot in sum_sq [T][kNumTensors]
  if constexpr (kTokenMajor) return blockIdx.x;
  return static_cast<int64_t>(blockIdx.x) * kNumTensors + blockIdx.y;
}

// Default caching: at batches whose shard fits in L2 the apply kernel re-reads it from there.
template <typename T, bool kTokenMajor>
__global__ void __launch_bounds__(kV1VecThreads) sum_sq_vec_kernel(Params p, float* sum_sq) {
  const Row<T> r = locate_grid_row<T, kTokenMajor>(p);
  const int num_vecs = r.hidden / Vec<T>::kElems;
  float partial = 0.f;
  for (int first = threadIdx.x; first < num_vecs; first += kV1VecsPerRowStep) {
    Vec<T> x[kV1VecsPerStep];
    partial += cross_head_norm::load_row_vectors<T, kV1VecsPerStep, false>(r, first, kV1VecThreads, x);
  }
  partial = block_sum(partial);
  if (threadIdx.x == 0) sum_sq[grid_row_slot<kTokenMajor>()] = partial;
}

// Streaming accesses: the apply kernel is the shard's last touch.
template <typename T, bool kHfRounding, bool kTokenMajor>
__global__ void __launch_bounds__(kV1VecThreads) apply_vec_kernel(ApplyParams a) {
  const Row<T> r = locate_grid_row<T, kTokenMajor>(a.shard);
  const int tensor = kTokenMajor ? static_cast<int>(blockIdx.x % kNumTensors) : static_cast<int>(blockIdx.y);
  const float full_width = tensor == kQ ? a.q_full_width : a.k_full_width;
  const float rstd = rstd_from(a.sum_sq[grid_row_slot<kTokenMajor>()], full_width, a.shard.eps);
  const int num_vecs = r.hidden / Vec<T>::kElems;
  for (int first = threadIdx.x; first < num_vecs; first += kV1VecsPerRowStep) {
    Vec<T> x[kV1VecsPerStep];
    cross_head_norm::load_row_vectors<T, kV1VecsPerStep, true>(r, first, kV1VecThreads, x);  // the sum is not needed here
    cross_head_norm::store_row_vectors<T, kV1VecsPerStep, kHfRounding, true>(r, first, kV1VecThreads, x, rstd, a.shard.weight_offset);
  }
}

// Both kernels of a call take the vector path or neither (the same rows; the sum kernel's Params
// carry no weights, which count as aligned), on the same grid.
template <typename T>
inline bool v1_vector_path(const Params& p) {
  return cross_head_norm::vector_aligned<T>(p);
}

// The (token, tensor) grid where q and k share a token stride wider than either row (views of one
// tensor of token rows) and grid.x has room for every row.
inline bool v1_token_major(const Params& p) {
  constexpr int64_t kMaxGridX = 2147483647;  // 2^31 - 1 CTAs along grid.x
  const bool share_token_stride =
      p.q_token_stride == p.k_token_stride && (p.q_token_stride > p.q_hidden || p.k_token_stride > p.k_hidden);
  return share_token_stride && p.num_tokens * kNumTensors <= kMaxGridX;
}

inline dim3 v1_vec_grid(const Params& p, bool token_major) {
  if (token_major) return dim3(static_cast<unsigned>(p.num_tokens * kNumTensors));
  return dim3(static_cast<unsigned>(p.num_tokens), kNumTensors);
}

template <typename T>
inline void launch_sum_sq(const Params& p, float* sum_sq, cudaStream_t stream) {
  if (v1_vector_path<T>(p)) {
    const bool token_major = v1_token_major(p);
    const auto kernel = token_major ? sum_sq_vec_kernel<T, true> : sum_sq_vec_kernel<T, false>;
    kernel<<<v1_vec_grid(p, token_major), kV1VecThreads, 0, stream>>>(p, sum_sq);
    return;
  }
  sum_sq_kernel<T><<<dim3(static_cast<unsigned>(p.num_tokens), kNumTensors), kV1Threads, 0, stream>>>(p, sum_sq);
}

template <typename T, bool kHfRounding>
inline void launch_apply(const ApplyParams& a, cudaStream_t stream) {
  if (v1_vector_path<T>(a.shard)) {
    const bool token_major = v1_token_major(a.shard);
    const auto kernel = token_major ? apply_vec_kernel<T, kHfRounding, true> : apply_vec_kernel<T, kHfRounding, false>;
    kernel<<<v1_vec_grid(a.shard, token_major), kV1VecThreads, 0, stream>>>(a);
    return;
  }
  apply_kernel<T, kHfRounding><<<dim3(static_cast<unsigned>(a.shard.num_tokens), kNumTensors), kV1Threads, 0, stream>>>(a);
}

// ------------------------------------------------------------------------------------------
// The peer buffers (layout and protocol: cookbook/tp_workspace.py, whose constants these match).
// Every word is (epoch << 32) | payload; a reader waits until the tag is the current epoch.
// ------------------------------------------------------------------------------------------
constexpr int kMaxRanks = 8;
constexpr int kParities = 2;  // a rank runs at most one call ahead of its peers

// The call's header: everything that must be the same on every rank, one 32-bit payload a word.
// Each launch publishes it to every rank and compares every rank's with its own before it writes
// anything, so ranks that disagree on the shapes (a rank with more tokens would wait for sums
// nobody sends) or on anything that changes the math (eps, weight_offset, rounding, dtypes, the
// implementation: each would compute with its own) all leave their shards untouched and report.
constexpr int kHeaderTokens = 0;   // the whole call's T (below 2^31)
constexpr int kHeaderWidths = 1;   // (q shard width / 2) << 16 | (k shard width / 2): even widths up to 65536
constexpr int kHeaderEps = 2;      // eps, float32 bits (what the kernel computes with)
constexpr int kHeaderOffset = 3;   // weight_offset, float32 bits
constexpr int kHeaderMath = 4;     // dtype, rounding, the weights' storage and the version (kMath* below)
constexpr int kHeaderWords = 5;
constexpr int kWidthShift = 16;
constexpr int kMathDTypeShift = 0;  // DType: 2 bits
constexpr int kMathHfBit = 2;       // rounding == "hf"
constexpr int kMathQWeightFp32Bit = 3;
constexpr int kMathKWeightFp32Bit = 4;
constexpr int kMathVersionShift = 8;
constexpr int kMathCallShift = 16;  // the low 16 bits of the host's count of the group's calls
// Every word of a rank that does not take part in the call: it rejected its arguments (and
// launched only to say so, so that the ranks stay in step). No real word takes this value:
// T < 2^31, the halved widths are at most 2^15, eps and weight_offset are finite (these bits are
// a NaN), and the math word's bits 5 to 7 are 0.
constexpr uint32_t kAbsent = 0xffffffffu;

// counters[]: device words of the protocol, int32 each.
constexpr int kEpochCounter = 0;      // the current launch's epoch,
constexpr int kDoneCounter = 1;       // how many CTAs of this launch have finished (or read the epoch),
constexpr int kFailedCounter = 2;     // the epoch a call's later chunks run at when an earlier chunk failed
                                      // (they then do nothing),
constexpr int kGaveUpCounter = 3;     // 1 once this rank gave up waiting (its later waits give up at once),
constexpr int kWaitLimitCounter = 4;  // how long a CTA's header waits may last, in ticks of 2^10 ns (the host sets it),
constexpr int kReportWhat = 5;        // and the report of the first failure since the host last read it:
constexpr int kReportTheirs = 6;      // kind | peer << kReportPeerShift | header word << kReportWordShift
constexpr int kReportOurs = 7;        // (0: none), the peer's payload of that word and this rank's,
constexpr int kReportEpoch = 8;       // and the launch's epoch
constexpr int kNumCounters = 9;
constexpr int kMismatch = 1;  // report kinds
constexpr int kGaveUp = 2;
constexpr int kReportPeerShift = 4;
constexpr int kReportWordShift = 8;
// status: pinned host words: [kStatusReport] 1 once there is a report to read (the host reads it
// from the counters after waiting for the GPU: a plain memory read at the start of every call),
// [kStatusCallNumber] the host's count of the group's calls (read by the binding at each launch).
constexpr int kStatusReport = 0;
constexpr int kStatusCallNumber = 1;
constexpr int kNumStatusWords = 2;

struct FusedParams {
  Params shard;               // num_tokens: this launch's chunk of the call
  uint32_t header[kHeaderWords];  // this call's (call_header below), the same for every chunk
  float q_full_width;         // q_hidden * tp
  float k_full_width;
  uint64_t* buffers[kMaxRanks];  // every rank's buffer, as mapped into this process
  int rank;
  int world;
  int64_t capacity;           // token slots per parity
  int chunk_index;            // 0: the call's first launch
  int tokens_per_cta;
  int slices_per_row;         // v3: warps that share a row (1 in v2)
  uint32_t* counters;         // [kNumCounters], this GPU
  volatile int64_t* status;   // [kNumStatusWords], pinned host memory
};

// Host: the header of a call (kHeader* above), as every rank computes it from its own arguments and
// its count of the group's calls (tp_workspace keeps it, and every rank counts every call, a
// rejected one too: a rank whose count differs made a different sequence of calls).
inline void call_header(FusedParams& p, int64_t call_tokens, DType dtype, bool hf_rounding, int version,
                        int64_t call_number) {
  const auto bits = [](float v) {
    uint32_t u;
    std::memcpy(&u, &v, sizeof(u));
    return u;
  };
  p.header[kHeaderTokens] = static_cast<uint32_t>(call_tokens);
  p.header[kHeaderWidths] = static_cast<uint32_t>(p.shard.q_hidden / 2) << kWidthShift |
                            static_cast<uint32_t>(p.shard.k_hidden / 2);
  p.header[kHeaderEps] = bits(p.shard.eps);
  p.header[kHeaderOffset] = bits(p.shard.weight_offset);
  p.header[kHeaderMath] = static_cast<uint32_t>(dtype) << kMathDTypeShift | uint32_t{hf_rounding} << kMathHfBit |
                          uint32_t{p.shard.q_weight_is_fp32} << kMathQWeightFp32Bit |
                          uint32_t{p.shard.k_weight_is_fp32} << kMathKWeightFp32Bit |
                          static_cast<uint32_t>(version) << kMathVersionShift |
                          static_cast<uint32_t>(call_number & 0xffff) << kMathCallShift;
}

// Host: the header of a rank that does not take part (kAbsent in every word).
inline void absent_header(FusedParams& p) {
  for (uint32_t& word : p.header) word = kAbsent;
}

// Header word `word` of this call, by selects rather than an index into the parameters (an
// indexed parameter costs the register-bound kernels registers they do not have).
__device__ __forceinline__ uint32_t header_of(const FusedParams& p, int word) {
  static_assert(kHeaderWords == 5, "the selects below");
  return word == kHeaderTokens   ? p.header[kHeaderTokens]
         : word == kHeaderWidths ? p.header[kHeaderWidths]
         : word == kHeaderEps    ? p.header[kHeaderEps]
         : word == kHeaderOffset ? p.header[kHeaderOffset]
                                 : p.header[kHeaderMath];
}

__device__ __forceinline__ uint64_t tagged(uint32_t epoch, uint32_t payload) {
  return (static_cast<uint64_t>(epoch) << 32) | payload;
}

__device__ __forceinline__ uint32_t payload_of(uint64_t word) { return static_cast<uint32_t>(word); }
__device__ __forceinline__ uint32_t tag_of(uint64_t word) { return static_cast<uint32_t>(word >> 32); }

// A 64-bit store is single-copy atomic: a reader sees the old word or the new one, never a mix,
// so the tag vouches for its payload without a fence. System scope: the reader is another GPU.
__device__ __forceinline__ void store_word(uint64_t* addr, uint64_t word) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(word) : "memory");
}

__device__ __forceinline__ uint64_t load_word(const uint64_t* addr) {
  uint64_t word;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(word) : "l"(addr) : "memory");
  return word;
}

// The GPU's global timer (the same clock on every SM) in ticks of 2^10 ns (a shift, where a
// division by 1000 would take registers the lagged kernels do not have), modulo 2^32 (73 minutes).
constexpr int kTickShift = 10;
__device__ __forceinline__ uint32_t global_ticks() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return static_cast<uint32_t>(ns >> kTickShift);
}

__device__ __forceinline__ uint64_t* header_word(const FusedParams& p, uint64_t* buffer, int parity, int source,
                                                 int word) {
  return buffer + (static_cast<int64_t>(parity) * p.world + source) * kHeaderWords + word;
}

__device__ __forceinline__ uint64_t* sum_slot(const FusedParams& p, uint64_t* buffer, int parity, int64_t token,
                                              int tensor, int source) {
  uint64_t* const slots = buffer + static_cast<int64_t>(kParities) * p.world * kHeaderWords;
  return slots + ((parity * p.capacity + token) * kNumTensors + tensor) * p.world + source;
}

// Epochs run 1, 2, ..., 2^32 - 1, then 2, 3, ...: 0 is a fresh buffer's tag and never a launch's,
// and the parity keeps alternating across the wrap (2^32 - 1 is odd, 2 even).
constexpr uint32_t kLastEpoch = 0xffffffffu;
constexpr uint32_t kEpochAfterWrap = 2u;
static_assert(kLastEpoch % kParities == 1 && kEpochAfterWrap % kParities == 0, "the wrap keeps parities alternating");
__device__ __forceinline__ uint32_t next_epoch(uint32_t epoch) {
  return epoch == kLastEpoch ? kEpochAfterWrap : epoch + 1u;
}

__device__ __forceinline__ uint32_t counter(const FusedParams& p, int which) {
  return *static_cast<volatile uint32_t*>(p.counters + which);
}

__device__ __forceinline__ uint32_t read_epoch(const FusedParams& p) { return counter(p, kEpochCounter); }

// A later chunk of a call whose earlier chunk failed: the peers may have no such chunk, so it
// neither waits nor advances the epoch (every CTA reads the same marker).
__device__ __forceinline__ bool chunk_abandoned(const FusedParams& p, uint32_t epoch) {
  return p.chunk_index > 0 && counter(p, kFailedCounter) == epoch;
}

// The report of a failed launch, for the host (cookbook/tp_workspace.py raises it at the next
// call): the first report since the host last read one keeps its details. Device words and one
// host word, packed: it runs inside the kernels' header checks, where every register counts.
__device__ __forceinline__ void report(const FusedParams& p, uint32_t epoch, int kind, int peer, int word,
                                       uint32_t theirs, uint32_t ours) {
  const uint32_t what = static_cast<uint32_t>(kind | peer << kReportPeerShift | word << kReportWordShift);
  if (atomicCAS(p.counters + kReportWhat, 0u, what) == 0u) {
    p.counters[kReportTheirs] = theirs;
    p.counters[kReportOurs] = ours;
    p.counters[kReportEpoch] = epoch;
  }
  p.status[kStatusReport] = 1;
}

// A failed launch's later chunks (which the peers may not have) do nothing.
__device__ __forceinline__ void abandon_later_chunks(const FusedParams& p, uint32_t epoch) {
  p.counters[kFailedCounter] = next_epoch(epoch);
}

// What the threads of a CTA share about its call: whether it still stands (every header agreed,
// no wait gave up), and when its header waits give up: the wait limit after the CTA started (one
// deadline per CTA, in shared memory: a waiting thread holds no clock in registers).
struct CallState {
  int ok;
  uint32_t deadline;  // global_ticks()
};

// Thread 0 of every CTA, first (the CTA's barriers then publish it). On a rank that has given up
// the deadline is now: a header that is not there gives up at once (a launch gives up once, not
// once per wave of CTAs).
__device__ __forceinline__ void open_call(const FusedParams& p, CallState& call) {
  call.ok = 1;
  call.deadline = global_ticks() + (counter(p, kGaveUpCounter) != 0 ? 0u : counter(p, kWaitLimitCounter));
}

// Waits until the word at `addr` carries `epoch` (true, the word in `word`); gives up (false) once
// the CTA's call has failed (a thread found a header that differs or never came). Unbounded by
// itself: the kernels wait for a peer's partial sums only beside or after the check of that peer's
// header, whose wait is bounded (header_agrees), so a peer that never makes the call stops them;
// once every header has come, every peer is in this launch and pushes its sums.
__device__ __forceinline__ bool wait_for_word(const uint64_t* addr, uint32_t epoch, const volatile int* keep_waiting,
                                              uint64_t& word) {
  do {
    word = load_word(addr);
    if (tag_of(word) == epoch) return true;
  } while (*keep_waiting);
  return false;
}

// Header word `i` (source i / kHeaderWords) against this call's: false if it differs (reported,
// unless this rank is the one not taking part), or if it has not come by the CTA's deadline: then
// this rank gives up on the call. It remembers that (its later launches give up at once), makes
// the call's later chunks do nothing, and reports. (A source that launches the call late finds
// this launch's header and sums: its own if it was merely slow, and a different call number in
// the math word if it skipped a call, so it never computes with another call's sums.)
__device__ __forceinline__ bool header_agrees(const FusedParams& p, uint32_t epoch, int parity, int i,
                                              const volatile CallState* call) {
  const int source = i / kHeaderWords, word = i % kHeaderWords;
  const uint64_t* const addr = header_word(p, p.buffers[p.rank], parity, source, word);
  uint64_t got;
  bool came = true;
  for (;;) {
    got = load_word(addr);
    if (tag_of(got) == epoch) break;
    if (call->ok == 0) return false;
    if (static_cast<int32_t>(global_ticks() - call->deadline) > 0) {  // past it (right across the clock's wrap)
      came = false;
      break;
    }
  }
  const uint32_t ours = header_of(p, word);
  if (came && payload_of(got) == ours) return true;
  if (!came) p.counters[kGaveUpCounter] = 1;
  if (!came || ours != kAbsent) {  // (a rank not taking part reports nothing of its own)
    abandon_later_chunks(p, epoch);
    report(p, epoch, came ? kMismatch : kGaveUp, source, word, payload_of(got), ours);
  }
  return false;
}

// Every CTA calls it last (all threads): the last CTA to finish advances the epoch for the next
// launch (stream order publishes it). In the last two launches before the wrap it first zeroes the
// half of its buffer that launch used: after the wrap no word can carry a tag that looks current.
// (Safe: no peer writes into that half again before this rank's next launch has started.)
__device__ __forceinline__ void clear_parity(const FusedParams& p, int parity) {
  uint64_t* const mine = p.buffers[p.rank];
  for (int i = threadIdx.x; i < p.world * kHeaderWords; i += blockDim.x) {
    *header_word(p, mine, parity, i / kHeaderWords, i % kHeaderWords) = 0;
  }
  uint64_t* const slots = sum_slot(p, mine, parity, 0, kQ, 0);
  const int64_t words = p.capacity * kNumTensors * p.world;
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) slots[i] = 0;
}

__device__ __forceinline__ void end_launch(const FusedParams& p, uint32_t epoch, int parity) {
  __shared__ int is_last_cta;
  __syncthreads();
  if (threadIdx.x == 0) is_last_cta = atomicAdd(p.counters + kDoneCounter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!is_last_cta) return;
  if (epoch >= kLastEpoch - 1) clear_parity(p, parity);
  __syncthreads();
  if (threadIdx.x == 0) {
    p.counters[kDoneCounter] = 0;
    p.counters[kEpochCounter] = next_epoch(epoch);
  }
}

// The call's header, from the first CTA to every rank, itself included.
__device__ __forceinline__ void publish_header(const FusedParams& p, uint32_t epoch, int parity) {
  if (blockIdx.x == 0 && threadIdx.x < p.world * kHeaderWords) {
    const int dest = threadIdx.x / kHeaderWords, word = threadIdx.x % kHeaderWords;
    store_word(header_word(p, p.buffers[dest], parity, p.rank, word), tagged(epoch, header_of(p, word)));
  }
}

// ------------------------------------------------------------------------------------------
// v2: one fused kernel: a CTA stages a tile of tokens in shared memory, pushes their partial sums into every peer's symmetric-memory buffer tagged with the call's epoch, waits for the peers' tags, and writes - removes v1's NCCL launch, its latency and the second read of the shard
// grid.x: tiles of tokens_per_cta tokens; the tile's 2 * tokens rows (q rows, then k rows) go to
// warps round-robin (warp per row). Four phases:
//   1. each warp reads its rows once (kElems-element packs: 16 bytes when aligned), keeps them
//      in the shared-memory tile (kStaged), sums x^2, and lane s stores the row's partial into
//      rank s's buffer;
//   2. threads compare every rank's header (tokens, widths) with this call's;
//   3. if they agree, thread (row, source) waits for that source's tagged partial; the row's
//      total is summed in rank order (the same float on every rank);
//   4. each warp normalizes its rows from the tile and writes them; the last CTA to finish
//      advances the epoch.
// Latency: a CTA waits once per tile, not once per row, and several tiles per SM are in flight,
// so the NVLink round trip overlaps other tiles' loads. Rows too wide to stage (kStaged = false)
// are re-read from global memory in phase 4.
// ------------------------------------------------------------------------------------------
constexpr int kFusedThreads = 256;
constexpr int kFusedWarps = kFusedThreads / kWarpSize;
constexpr int kMaxTokensPerCta = 8;
constexpr int kMaxRowsPerCta = kNumTensors * kMaxTokensPerCta;
constexpr int kTileBytes = 48 * 1024;  // dynamic shared memory a launch gets without opting in
constexpr int kLoadUnroll = 4;         // packs of a row in flight per lane (v6; v2-v5's unroll)
static_assert(kFusedThreads % kWarpSize == 0 && kFusedThreads <= kMaxWarpsPerBlock * kWarpSize,
              "v2: whole warps, at most 1024 threads");
static_assert(kMaxRowsPerCta * kMaxRanks <= kFusedThreads, "phase 3 gives each (row, source) pair a thread");
static_assert(kMaxRanks * kHeaderWords <= kFusedThreads, "phase 2 gives each header word a thread");
static_assert(kMaxRanks <= kWarpSize, "phase 1: lane s pushes to rank s");

template <typename T, int kElems>
struct alignas(sizeof(T) * kElems) Pack {
  T v[kElems];
};

// Row `row` of a CTA's tile: rows [0, tokens) are q rows, [tokens, 2 * tokens) k rows.
template <typename T>
struct TileRow {
  Row<T> row;
  int tensor;
  int64_t token;    // in this launch's chunk
  int tile_offset;  // elements from the tile's start
  float full_width;
};

template <typename T>
__device__ __forceinline__ TileRow<T> tile_row(const FusedParams& p, int64_t first_token, int tokens, int row) {
  const int tensor = row < tokens ? kQ : kK;
  const int i = tensor == kQ ? row : row - tokens;
  const int offset = tensor == kQ ? i * p.shard.q_hidden : tokens * p.shard.q_hidden + i * p.shard.k_hidden;
  const float full_width = tensor == kQ ? p.q_full_width : p.k_full_width;
  return {locate_row<T>(p.shard, first_token + i, tensor), tensor, first_token + i, offset, full_width};
}

template <typename T, int kElems, bool kHfRounding>
__device__ __forceinline__ void load_weights(const Row<T>& r, int col, float weight_offset, float (&w)[kElems]) {
  if constexpr (kElems == Vec<T>::kElems) {
    cross_head_norm::load_weight_vec<T, kHfRounding>(r.w, r.w_is_fp32, col, weight_offset, w);
  } else {
#pragma unroll
    for (int j = 0; j < kElems; ++j) {
      w[j] = effective_weight<T, kHfRounding>(load_weight<T>(r.w, r.w_is_fp32, col + j), weight_offset);
    }
  }
}

// Phase 1 of one lane: packs c = first, first + stride, ... of row t are staged in the tile
// (kStaged), their weights prefetched into L1 (kPrefetchWeights), and their squares summed.
// v2-v5 load a pack and then use it; a generic load may alias the shared tile, so the compiler
// keeps each load behind the previous pack's store into it: one memory round trip per pack.
// v6 (kBatched) issues kLoadUnroll loads before using any. Either way a lane sums its packs in
// ascending order, so the sums (and the results) are the same bits.
template <typename T, int kElems, bool kStaged, bool kPrefetchWeights, bool kBatched>
__device__ __forceinline__ float stage_and_sum(const TileRow<T>& t, Pack<T, kElems>* staged, int first, int stride) {
  using P = Pack<T, kElems>;
  const P* const src = reinterpret_cast<const P*>(t.row.x);
  const int packs = t.row.hidden / kElems;
  const int weight_bytes = t.row.w_is_fp32 ? static_cast<int>(sizeof(float)) : static_cast<int>(sizeof(T));
  float sum_sq = 0.f;
  const auto use = [&](int c, const P& x) {
    if constexpr (kStaged) staged[c] = x;
    if constexpr (kPrefetchWeights) {
      prefetch_l1(static_cast<const char*>(t.row.w) + static_cast<int64_t>(c) * kElems * weight_bytes);
    }
#pragma unroll
    for (int j = 0; j < kElems; ++j) {
      const float xf = to_float<T>(x.v[j]);
      sum_sq += xf * xf;
    }
  };
  if constexpr (kBatched) {
    for (int base = first; base < packs; base += kLoadUnroll * stride) {
      P x[kLoadUnroll];
#pragma unroll
      for (int b = 0; b < kLoadUnroll; ++b) {
        if (base + b * stride < packs) x[b] = src[base + b * stride];
      }
#pragma unroll
      for (int b = 0; b < kLoadUnroll; ++b) {
        if (base + b * stride < packs) use(base + b * stride, x[b]);
      }
    }
  } else {
#pragma unroll kLoadUnroll
    for (int c = first; c < packs; c += stride) use(c, src[c]);
  }
  return sum_sq;
}

// Phase 4 of one lane: the same packs of row t, from the tile (kStaged) or re-read, normalized
// with rstd and written. v6 (kBatched) issues a batch's global loads (the weights, and x where
// the row was not staged) before the first conversion; the one-element packs of misaligned rows
// keep the plain loop.
template <typename T, int kElems, bool kStaged, bool kHfRounding, bool kBatched>
__device__ __forceinline__ void normalize_and_write(const TileRow<T>& t, const Pack<T, kElems>* staged, int first,
                                                    int stride, float rstd, float weight_offset) {
  using P = Pack<T, kElems>;
  P* const dst = reinterpret_cast<P*>(t.row.x);
  const int packs = t.row.hidden / kElems;
  const auto write = [&](int c, const P& x, const float (&w)[kElems]) {
    P y;
#pragma unroll
    for (int j = 0; j < kElems; ++j) y.v[j] = normalize<T, kHfRounding>(to_float<T>(x.v[j]), rstd, w[j]);
    dst[c] = y;
  };
  if constexpr (kBatched && kElems == Vec<T>::kElems) {
    for (int base = first; base < packs; base += kLoadUnroll * stride) {
      P x[kLoadUnroll];  // re-read rows only: a staged pack is read from the tile when it is used
      RawWeights<T> raw[kLoadUnroll];
#pragma unroll
      for (int b = 0; b < kLoadUnroll; ++b) {
        const int c = base + b * stride;
        if (c < packs) {
          if constexpr (!kStaged) x[b] = dst[c];
          raw[b] = load_raw_weights<T>(t.row, c * kElems);
        }
      }
#pragma unroll
      for (int b = 0; b < kLoadUnroll; ++b) {
        const int c = base + b * stride;
        if (c < packs) {
          float w[kElems];
          effective_weights<T, kHfRounding>(raw[b], t.row.w_is_fp32, weight_offset, w);
          write(c, kStaged ? staged[c] : x[b], w);
        }
      }
    }
  } else {
#pragma unroll kLoadUnroll
    for (int c = first; c < packs; c += stride) {
      const P x = kStaged ? staged[c] : dst[c];
      float w[kElems];
      load_weights<T, kElems, kHfRounding>(t.row, c * kElems, weight_offset, w);
      write(c, x, w);
    }
  }
}

template <typename T, int kElems, bool kStaged, bool kHfRounding, bool kProgrammatic = false,
          bool kBatched = false>
__global__ void __launch_bounds__(kFusedThreads) fused_kernel(FusedParams p) {
  using P = Pack<T, kElems>;
  extern __shared__ __align__(kVecBytes) unsigned char tile_bytes[];
  __shared__ float partials[kMaxRowsPerCta][kMaxRanks];
  __shared__ CallState call;

  if constexpr (kProgrammatic) after_prior_grids();
  const uint32_t epoch = read_epoch(p);
  if (chunk_abandoned(p, epoch)) return;
  const int parity = static_cast<int>(epoch % kParities);
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t first_token = static_cast<int64_t>(blockIdx.x) * p.tokens_per_cta;
  const int64_t left = p.shard.num_tokens - first_token;
  const int tokens = left < p.tokens_per_cta ? static_cast<int>(left > 0 ? left : 0) : p.tokens_per_cta;
  const int rows = kNumTensors * tokens;
  P* const tile = reinterpret_cast<P*>(tile_bytes);

  if (threadIdx.x == 0) open_call(p, call);
  publish_header(p, epoch, parity);

  // Phase 1: read, stage, sum, push.
  for (int row = warp; row < rows; row += kFusedWarps) {
    const TileRow<T> t = tile_row<T>(p, first_token, tokens, row);
    float sum_sq = stage_and_sum<T, kElems, kStaged, false, kBatched>(t, tile + t.tile_offset / kElems, lane, kWarpSize);
    sum_sq = warp_sum(sum_sq);
    if (lane < p.world) {
      store_word(sum_slot(p, p.buffers[lane], parity, t.token, t.tensor, p.rank), tagged(epoch, __float_as_uint(sum_sq)));
    }
  }
  __syncthreads();  // the call's state is initialized

  // Phase 2: every rank's header must match ours before anyone waits for sums that may never come.
  if (threadIdx.x < p.world * kHeaderWords && !header_agrees(p, epoch, parity, threadIdx.x, &call)) call.ok = 0;
  __syncthreads();
  const bool agree = call.ok != 0;

  // Phase 3: thread (row, source) waits for that source's partial of the row.
  if (agree && threadIdx.x < rows * p.world) {
    const int row = threadIdx.x / p.world, source = threadIdx.x % p.world;
    const TileRow<T> t = tile_row<T>(p, first_token, tokens, row);
    const uint64_t* slot = sum_slot(p, p.buffers[p.rank], parity, t.token, t.tensor, source);
    uint64_t word;
    if (wait_for_word(slot, epoch, &call.ok, word)) {
      partials[row][source] = __uint_as_float(payload_of(word));
    } else {
      call.ok = 0;
    }
  }
  __syncthreads();
  const bool summed = call.ok != 0;  // every wait came back (a peer may have vanished meanwhile)

  // Phase 4: normalize the staged rows and write them.
  for (int row = warp; summed && row < rows; row += kFusedWarps) {
    const TileRow<T> t = tile_row<T>(p, first_token, tokens, row);
    float total = 0.f;
    for (int source = 0; source < p.world; ++source) total += partials[row][source];  // rank order
    const float rstd = rstd_from(total, t.full_width, p.shard.eps);
    normalize_and_write<T, kElems, kStaged, kHfRounding, kBatched>(t, tile + t.tile_offset / kElems, lane, kWarpSize,
                                                                    rstd, p.shard.weight_offset);
  }

  end_launch(p, epoch, parity);
}

// ------------------------------------------------------------------------------------------
// v3: at decode sizes the warps of a CTA share each row, the header check runs beside the wait, and the weights are prefetched into L1 before it - removes v2's serial load rounds and two round trips from the critical path
// v2 gives a row to one warp: a 3072-wide bf16 shard row is 12 packs per lane, three dependent
// rounds of loads before the partial sum can leave, while 6 of the 8 warps of a one-token CTA
// idle. Here, when a tile has fewer rows than warps, its rows are cut into `slices_per_row`
// slices (8 warps / rows), one warp per (row, slice): one round of loads. (With a warp per row
// the launcher runs v2's kernel: at prefill sizes there is nothing to share.) The slices' sums meet in shared memory in a fixed
// order. Threads [0, rows * world) then push and wait, while the top threads check the headers:
// a mismatch stops the waits (they poll the shared flag too), so nothing can hang, but a match
// costs no extra round trip. The weight lines phase 4 will read are prefetched into L1 in phase 1.
// ------------------------------------------------------------------------------------------
static_assert(kMaxRowsPerCta >= kFusedWarps, "v3: (row, slice) units never outnumber kMaxRowsPerCta");
static_assert(kMaxRowsPerCta * kMaxRanks + kMaxRanks * kHeaderWords <= kFusedThreads,
              "v3: the waiting threads and the header-checking threads are disjoint");

// v4: the decode kernel advances the epoch as soon as every CTA has read it (an atomic beside the wait) instead of after every CTA has finished - removes v3's end-of-kernel atomic round trip
// Safe: each CTA reads the epoch once, at its start, before it counts itself in, so the last CTA
// to count itself in can advance it; the next launch starts only after this one completes. The
// two launches before the wrap keep v3's end-of-launch path (they zero their half at the end).
constexpr int kEpochThread = kFusedThreads - 1 - kMaxRanks * kHeaderWords;  // neither a waiting nor a header thread
static_assert(kEpochThread >= kMaxRowsPerCta * kMaxRanks, "v4: the epoch thread does not wait for sums");

// v4's early epoch: each CTA calls it once, after it has read the epoch; the last CTA to count
// itself in advances the epoch for the next launch (which reads it only after this one completes).
__device__ __forceinline__ void count_in_for_the_epoch(const FusedParams& p, uint32_t epoch) {
  if (atomicAdd(p.counters + kDoneCounter, 1u) == gridDim.x - 1) {  // every CTA has read the epoch
    p.counters[kDoneCounter] = 0;
    p.counters[kEpochCounter] = next_epoch(epoch);
  }
}

// Phase 2+3 of the decode kernels (v3 on): thread (row, rank r) adds up the row's slice sums in
// a fixed order, pushes the partial to rank r and waits for rank r's; the top world *
// kHeaderWords threads check the headers meanwhile (a mismatch clears call->ok, which stops
// the waits), and from v4 on one other thread counts the CTA in for the next epoch.
template <typename T, bool kEarlyEpoch>
__device__ __forceinline__ void exchange_row_sums(const FusedParams& p, uint32_t epoch, int64_t first_token, int tokens,
                                                  int slices, const float* unit_sums,
                                                  float (*partials)[kMaxRanks], CallState* call) {
  const int parity = static_cast<int>(epoch % kParities);
  const bool near_wrap = epoch >= kLastEpoch - 1;
  const int rows = kNumTensors * tokens;
  const int header_thread = threadIdx.x - (kFusedThreads - p.world * kHeaderWords);
  if (threadIdx.x < rows * p.world) {
    const int row = threadIdx.x / p.world, r = threadIdx.x % p.world;
    const TileRow<T> t = tile_row<T>(p, first_token, tokens, row);
    float sum_sq = 0.f;
    for (int slice = 0; slice < slices; ++slice) sum_sq += unit_sums[row * slices + slice];  // fixed order
    store_word(sum_slot(p, p.buffers[r], parity, t.token, t.tensor, p.rank), tagged(epoch, __float_as_uint(sum_sq)));
    uint64_t word;
    if (wait_for_word(sum_slot(p, p.buffers[p.rank], parity, t.token, t.tensor, r), epoch, &call->ok, word)) {
      partials[row][r] = __uint_as_float(payload_of(word));
    } else {
      call->ok = 0;
    }
  } else if (header_thread >= 0 && !header_agrees(p, epoch, parity, header_thread, call)) {
    call->ok = 0;
  } else if (kEarlyEpoch && !near_wrap && threadIdx.x == kEpochThread) {
    count_in_for_the_epoch(p, epoch);
  }
}

template <typename T, int kElems, bool kStaged, bool kHfRounding, bool kEarlyEpoch = false,
          bool kProgrammatic = false, bool kBatched = false>
__global__ void __launch_bounds__(kFusedThreads) fused_v3_kernel(FusedParams p) {
  using P = Pack<T, kElems>;
  extern __shared__ __align__(kVecBytes) unsigned char tile_bytes[];
  __shared__ float unit_sums[kMaxRowsPerCta];  // one per (row, slice)
  __shared__ float partials[kMaxRowsPerCta][kMaxRanks];
  __shared__ CallState call;

  if constexpr (kProgrammatic) after_prior_grids();
  const uint32_t epoch = read_epoch(p);
  if (chunk_abandoned(p, epoch)) return;
  const bool near_wrap = epoch >= kLastEpoch - 1;
  const int parity = static_cast<int>(epoch % kParities);
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t first_token = static_cast<int64_t>(blockIdx.x) * p.tokens_per_cta;
  const int64_t left = p.shard.num_tokens - first_token;
  const int tokens = left < p.tokens_per_cta ? static_cast<int>(left > 0 ? left : 0) : p.tokens_per_cta;
  const int rows = kNumTensors * tokens;
  const int slices = p.slices_per_row;
  const int units = rows * slices;
  const int lanes_per_row = slices * kWarpSize;
  P* const tile = reinterpret_cast<P*>(tile_bytes);

  if (threadIdx.x == 0) open_call(p, call);
  publish_header(p, epoch, parity);

  // Phase 1: warp (row, slice) reads packs slice * 32 + lane, + slices * 32, ... of its row.
  for (int unit = warp; unit < units; unit += kFusedWarps) {
    const int row = unit / slices, slice = unit % slices;
    const TileRow<T> t = tile_row<T>(p, first_token, tokens, row);
    float sum_sq = stage_and_sum<T, kElems, kStaged, true, kBatched>(t, tile + t.tile_offset / kElems,
                                                                     slice * kWarpSize + lane, lanes_per_row);
    sum_sq = warp_sum(sum_sq);
    if (lane == 0) unit_sums[unit] = sum_sq;
  }
  __syncthreads();

  // Phase 2+3: thread (row, rank r) pushes the row's partial to rank r and waits for rank r's;
  // the top world * kHeaderWords threads check the headers meanwhile.
  exchange_row_sums<T, kEarlyEpoch>(p, epoch, first_token, tokens, slices, unit_sums, partials, &call);
  __syncthreads();
  const bool agree = call.ok != 0;

  // Phase 4: the same (row, slice) units normalize their packs from the tile and write them.
  for (int unit = warp; agree && unit < units; unit += kFusedWarps) {
    const int row = unit / slices, slice = unit % slices;
    const TileRow<T> t = tile_row<T>(p, first_token, tokens, row);
    float total = 0.f;
    for (int source = 0; source < p.world; ++source) total += partials[row][source];  // rank order
    const float rstd = rstd_from(total, t.full_width, p.shard.eps);
    normalize_and_write<T, kElems, kStaged, kHfRounding, kBatched>(t, tile + t.tile_offset / kElems,
                                                                    slice * kWarpSize + lane, lanes_per_row, rstd,
                                                                    p.shard.weight_offset);
  }
  if (!kEarlyEpoch || near_wrap) end_launch(p, epoch, parity);
}

// ------------------------------------------------------------------------------------------
// v5: v4 launched as a programmatic dependent launch: its CTAs become resident while the previous kernel finishes and wait in hardware (griddepcontrol) for its writes, and it lets the next launch do the same - removes the launch gap between back-to-back kernels from each call
// At decode sizes a call is a few microseconds, and part of each is the gap between kernels: the
// previous kernel drains, then this grid's CTAs are launched and start. With the launch attribute
// (sm_90+, set by the host) the CTAs may become resident before the previous kernel has finished;
// each one's first instruction, griddepcontrol.wait, holds it until every prior grid has completed
// and its writes are visible, so nothing it reads (x, the weights, the epoch counter) can be
// stale. It then executes griddepcontrol.launch_dependents: the next launch's CTAs become
// resident only once every CTA of this grid has executed it or exited, so they never take an SM
// one of ours still needs (the deadlock argument above is unchanged). Both kernels (v2's at
// prefill sizes, v4's at decode sizes) get it. Under CUDA graphs the attribute becomes a
// programmatic edge; on an older GPU the host launches without it and the wait compiles away.
// (after_prior_grids and launch_kernel, in include/common.cuh, are shared with the other ops.)
// ------------------------------------------------------------------------------------------

// ------------------------------------------------------------------------------------------
// v6: v5 with each lane's loads of a row issued as one batch before any is used (phase 1's shard packs, phase 4's weights) - removes v5's serial round trips: its loads were generic, so the compiler kept each one behind the previous store into the shared tile (one DRAM latency per pack)
// Seen in v5's SASS: phase 1 is LD.128, STS.128, LD.128, STS.128, ...: each store into the tile
// waits for its load, and the next load may not pass that store (a generic address might be the
// tile's). A lane with n packs of a row therefore waited n memory latencies before its partial
// sum could leave: at 128 tokens of a 3072-wide shard, 3 (one token per CTA, four warps per
// row); at 512 tokens, 12 (four tokens per CTA, a warp per row). stage_and_sum and
// normalize_and_write (above) issue up to kLoadUnroll loads, then use them; the order in which
// a lane sums is unchanged, so v6 gives v5's bits. Both kernels (decode and prefill) get it.
// ------------------------------------------------------------------------------------------

// ------------------------------------------------------------------------------------------
// v7: v6 with, at prefill sizes, a persistent walk in which a CTA sums a token's rows and pushes the partials, then finishes that token two steps later: its peers' sums have arrived by then, and its rows are read again from L2 - removes v6's shared-memory tile and its wait per tile, and holds no row through an NVLink round trip (as registers did in a reverted one-CTA-per-token kernel)
// Measured on two H200s (docs/tp_qk_norm.md, "Where the prefill time goes"): at 16384 tokens of
// the MiniMax shard v6 took 87-89 us against the local shard's 60 (cross_head_norm v9), and as
// long with its waits removed, so v6's cost is its memory path (a warp per row, through a
// shared-memory tile), not the exchange. Holding a token's rows in registers instead (one CTA per
// token, reverted) made 16384 tokens slower, 130 us: each CTA kept its rows through the NVLink
// round trip of its sums, so only 56 KiB per SM was in flight. Here nothing waits holding a row:
//
//   step s of CTA b (tokens b, b + G, b + 2G, ... of a grid of G resident CTAs):
//     1. request token b + sG's q and k shard rows (16-byte loads that stay in L2);
//     2. finish token b + (s - kLag)G: request its rows again - from L2, where step s - kLag left
//        them - then wait for the peers' sums (pushed kLag steps ago, so normally already here),
//        then normalize and store the rows;
//     3. sum the squares of step 1's rows (in flight during step 2) and push the two partials to
//        every rank.
//
// DRAM sees each byte read once and written once; the second read is an L2 hit as long as the
// rows of kLag steps of the whole grid (kLag * G * row pair bytes: 13 MB at the MiniMax shard)
// stay in L2 (60 MiB on the H200). The header check and the epoch count (v4's) run beside the
// CTA's first wait. Deadlock: a CTA's token t waits only for token t's partials, which each rank
// pushes after finishing only tokens below t; by induction on t every push comes, provided CTA b
// of every rank is resident (the grid is at most the resident CTAs, and ranks run the same grid).
// Smaller calls (fewer tokens than resident CTAs) keep v6's kernels.
// Measured on two H200s (bench harness, us, v6 -> v7, local shard): 16384 tokens 88.6 -> 80.7
// (59.6), 8192 52.3 -> 47.1 (31.1), 2048 18.6 -> 15.7 (9.9). Issuing step 2's second read after
// the wait instead of before it gave 87.5 at 16384 tokens.
// ------------------------------------------------------------------------------------------

// ------------------------------------------------------------------------------------------
// v8: v7 with each thread's effective weights (w + weight_offset, fp32) held in registers for the whole walk, loaded once before its first token - removes the weight loads, conversions and offset adds from every token a CTA finishes: Nsight Compute showed v7's walk issue-bound (73 % of issue slots busy), not waiting on DRAM
// Measured with Nsight Compute on one H200, v7's kernel alone (world 1, the MiniMax TP=2 shard,
// 16384 tokens; docs/tp_qk_norm.md, "Where v7's time goes"): 73 % of its issue slots busy, the
// warps mostly stalled on barriers or not selected, DRAM at 55 % of its peak, and as slow
// without the wait (the exchange) or without the second read (the L2 hit). Its time is
// instructions. Per 16-byte vector a step spent about as much on the vector's weights (the L1
// load, the branch between fp32 and activation-type weights, the unpack and the offset add) as on
// normalizing it, although a thread's columns, and so its weights, are the same at every step of
// the walk. v8 computes them once, before the walk (kHeldWeights), at 24 more registers per
// thread at the MiniMax shard (96: 5 CTAs per SM instead of 7); the issue slots busy fall to
// 56 %, and the walk is 3-4 % faster at 8192 and 16384 tokens (10 % at a TP=8-sized shard on
// one GPU) and ties at 2048 (Results).
// ------------------------------------------------------------------------------------------

// ------------------------------------------------------------------------------------------
// v9: v8 with the effective weights kept in shared memory instead of registers: each thread writes its own columns' fp32 weights there once, before the walk, and reads them back at every finish - keeps v8's per-step savings at v7's register count (72 instead of 96 at the MiniMax shard: 7 CTAs per SM instead of 5) and extends them to 8 vectors per thread
// v8 bought its instructions with registers: 96 per thread, 5 CTAs of 4 warps per SM, 30 %
// achieved occupancy, and the walk still spends most of its time on barriers and waits with
// few warps to switch to. Shared memory is idle in the lagged walk (the tile went with v7), and a
// thread's weights are private to it: thread i writes columns i, i + blockDim.x, ... and only it
// reads them back, so no barrier is needed, and the float4 planes (elements 0-3, 4-7 of each
// vector, consecutive threads at consecutive float4s) are read without bank conflicts. A CTA holds
// kLaggedMaxThreads * kVecsPerThread * kElems floats: 16 KiB at 4 bf16 vectors per thread.
// Measured (Results in docs/tp_qk_norm.md): on one H200 (world 1), 68.7 us against v8's 75.1 at
// 16384 tokens of the MiniMax TP=2 shard, 41 % achieved occupancy against 30 %; on two H200s
// (bench harness, us, v8 -> v9, local shard), 16384 tokens 76.84 -> 71.46 (60.08), 8192 47.60 ->
// 38.46 (30.91), 2048 14.29 -> 13.36 (9.7); at 8 vectors per thread (8192 x 6144/1024 on one GPU)
// 86.6 -> 75.0 (61.8), where v8 runs v7's kernel.
// ------------------------------------------------------------------------------------------

// Where the lagged walk keeps a thread's effective weights: v7 reloads them (L1 hits) at every
// finish, v8 holds them in registers, v9 in shared memory.
enum class WeightSource { kReloaded, kRegisters, kShared };
constexpr int kLaggedMaxThreads = 128;
constexpr int kLaggedMinThreads = 64;
constexpr int kLaggedMaxVecsPerThread = 8;
constexpr int kLaggedWeightUnroll = 2;  // vectors whose weights are loaded before any is used
// Steps between a token's push and its finish. Measured on two H200s at 16384 tokens of the
// MiniMax shard (us, lag 1 / 2 / 3): 89.9 / 80.7 / 93.6. With one step the wait is exposed; why
// three is slower again was not profiled (more rows held in L2 between their two reads is the
// likely cost).
constexpr int kLag = 2;
static_assert(kLag >= 1, "a token is finished only after its partials were pushed");
static_assert(kNumTensors * kMaxRanks + kMaxRanks * kHeaderWords + 1 <= kLaggedMinThreads,
              "v7: the waiting threads, header threads and the epoch thread fit the smallest block");
static_assert(kLaggedMinThreads % kWarpSize == 0 && kLaggedMaxThreads % kWarpSize == 0, "whole warps");

// A token's q and k shard rows laid end to end as 16-byte vectors: vector c is q's vector c below
// q_vecs, else k's vector c - q_vecs.
template <typename T>
struct RowPair {
  Row<T> q, k;
  int q_vecs, vecs;

  // By value, as selects: a reference into the pair would put the pair in local memory.
  __device__ __forceinline__ Row<T> row(int c) const { return c < q_vecs ? q : k; }
  __device__ __forceinline__ int col(int c) const { return (c < q_vecs ? c : c - q_vecs) * Vec<T>::kElems; }
};

// One finished 16-byte vector: x * rstd * w (w: the effective weights) rounded once (or in the
// Hugging Face order), stored with the streaming hint (its last access in the call).
template <typename T, bool kHfRounding>
__device__ __forceinline__ void write_normalized(T* dst, const Vec<T>& x, float rstd, const float (&w)[Vec<T>::kElems]) {
  float xf[Vec<T>::kElems];
  unpack<T>(x, xf);
  Vec<T> y;
#pragma unroll
  for (int e = 0; e < Vec<T>::kElems; ++e) y.v[e] = normalize<T, kHfRounding>(xf[e], rstd, w[e]);
  store_vec_streaming<T>(dst, y);
}

template <typename T>
__device__ __forceinline__ RowPair<T> row_pair(const FusedParams& p, int64_t token) {
  const int q_vecs = p.shard.q_hidden / Vec<T>::kElems;
  return {locate_row<T>(p.shard, token, kQ), locate_row<T>(p.shard, token, kK), q_vecs,
          q_vecs + p.shard.k_hidden / Vec<T>::kElems};
}

// CTAs of kLaggedMaxThreads threads per SM that the register budget aims at (ptxas, sm_90, no
// spills): 8 (64 registers) up to 2 vectors per thread; 7 at 4 (72: a step holds two tokens'
// vectors, 8 KiB of each per CTA, and at 64 it spilled), 5 in the Hugging Face order, whose extra
// roundings in fp16 needed more than 80; 4 at 8 vectors. v8's held weights (one float per element
// of the thread's vectors) take 61-64 registers at 1 vector, 76-80 at 2 and 96 at 4: the
// held_weights branch.
// v9's shared weights leave the registers at v7's count, so it takes v7's budget.
constexpr int lagged_min_ctas_per_sm(int vecs_per_thread, bool hf_rounding, WeightSource weights) {
  if (weights == WeightSource::kRegisters) return vecs_per_thread <= 1 ? 8 : vecs_per_thread <= 2 ? 6 : 5;
  return vecs_per_thread <= 2 ? 8 : vecs_per_thread <= 4 ? (hf_rounding ? 5 : 7) : 4;
}
// v8 holds the weights of at most this many vectors per thread (32 registers in bf16); wider row
// pairs (8 vectors per thread) keep v7's kernel.
constexpr int kHeldWeightsMaxVecs = 4;

// v9's weights in shared memory: float4 planes (kElems / 4 of them), each indexed [vector j of the
// thread][thread], so that a warp reads 32 consecutive float4s.
constexpr int kFloatsPerPlane = 4;
template <typename T, int kVecsPerThread>
struct SharedWeights {
  static constexpr int kPlanes = Vec<T>::kElems / kFloatsPerPlane;
  static_assert(Vec<T>::kElems % kFloatsPerPlane == 0, "a vector is whole float4 planes");
  float4 plane[kPlanes][kVecsPerThread][kLaggedMaxThreads];

  __device__ __forceinline__ void put(int j, const float (&w)[Vec<T>::kElems]) {
#pragma unroll
    for (int k = 0; k < kPlanes; ++k) {
      const int e = k * kFloatsPerPlane;
      plane[k][j][threadIdx.x] = make_float4(w[e], w[e + 1], w[e + 2], w[e + 3]);
    }
  }
  __device__ __forceinline__ void get(int j, float (&w)[Vec<T>::kElems]) const {
#pragma unroll
    for (int k = 0; k < kPlanes; ++k) {
      const float4 f = plane[k][j][threadIdx.x];
      const int e = k * kFloatsPerPlane;
      w[e] = f.x, w[e + 1] = f.y, w[e + 2] = f.z, w[e + 3] = f.w;
    }
  }
};
constexpr int kStaticSharedBytes = 48 * 1024;  // the most a kernel may declare statically
static_assert(sizeof(SharedWeights<__nv_bfloat16, kLaggedMaxVecsPerThread>) +
                      sizeof(float) * kNumTensors * kMaxRanks + sizeof(int) <= kStaticSharedBytes,
              "v9's widest weights, the partials and the agreement flag fit static shared memory");

template <typename T, int kVecsPerThread, bool kHfRounding, WeightSource kWeights>
__global__ void __launch_bounds__(kLaggedMaxThreads, lagged_min_ctas_per_sm(kVecsPerThread, kHfRounding, kWeights))
    lagged_rows_kernel(FusedParams p) {
  constexpr bool kHeldWeights = kWeights == WeightSource::kRegisters;
  constexpr bool kSharedWeights = kWeights == WeightSource::kShared;
  static_assert(!kHeldWeights || kVecsPerThread <= kHeldWeightsMaxVecs, "v8 holds the weights of few vectors");
  constexpr int kElems = Vec<T>::kElems;
  __shared__ float partials[kNumTensors][kMaxRanks];
  __shared__ CallState call;
  __shared__ std::conditional_t<kSharedWeights, SharedWeights<T, kVecsPerThread>, char> shared_w;  // v9 only

  after_prior_grids();
  const uint32_t epoch = read_epoch(p);
  if (chunk_abandoned(p, epoch)) return;
  const bool near_wrap = epoch >= kLastEpoch - 1;
  const int parity = static_cast<int>(epoch % kParities);
  const int64_t tokens = p.shard.num_tokens;
  const int64_t grid = gridDim.x;
  const int waiting_threads = kNumTensors * p.world;  // thread (tensor, rank r) pushes to r, waits for r
  const int header_thread = threadIdx.x - (blockDim.x - p.world * kHeaderWords);
  const int epoch_thread = blockDim.x - 1 - p.world * kHeaderWords;

  if (threadIdx.x == 0) open_call(p, call);
  __syncthreads();
  publish_header(p, epoch, parity);

  // v8 and v9: this thread's effective weights, the same at every step (its columns do not
  // change), kept in registers (v8) or in this thread's slots of shared memory (v9).
  float held_w[kHeldWeights ? kVecsPerThread : 1][kElems];
  if constexpr (kHeldWeights || kSharedWeights) {
    const RowPair<T> first = row_pair<T>(p, blockIdx.x);  // any token: only the weight columns are used
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      if (c < first.vecs) {
        const Row<T> row = first.row(c);
        const RawWeights<T> raw = load_raw_weights<T>(row, first.col(c));
        if constexpr (kHeldWeights) {
          effective_weights<T, kHfRounding>(raw, row.w_is_fp32, p.shard.weight_offset, held_w[j]);
        } else {
          float w[kElems];
          effective_weights<T, kHfRounding>(raw, row.w_is_fp32, p.shard.weight_offset, w);
          shared_w.put(j, w);  // read back by this thread alone: no barrier
        }
      }
    }
  }

  bool first_finish = true;
  for (int64_t step = 0;; ++step) {
    const int64_t summed = blockIdx.x + step * grid;            // whose rows are requested and summed
    const int64_t finished = blockIdx.x + (step - kLag) * grid;  // whose rows are normalized
    if (finished >= tokens) break;  // every token of the CTA is finished (block-uniform)
    const bool sum_now = summed < tokens;
    const bool finish_now = step >= kLag;  // (a CTA with fewer tokens than kLag has steps that do neither)

    // 1. Request the summed token's rows; nothing waits for them until 3.
    Vec<T> x[kVecsPerThread];
    RowPair<T> pair{};
    if (sum_now) {
      pair = row_pair<T>(p, summed);
#pragma unroll
      for (int j = 0; j < kVecsPerThread; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < pair.vecs) x[j] = load_vec_l2<T>(pair.row(c).x + pair.col(c));
      }
    }

    // 2. Finish the token summed kLag steps ago: its rows requested again (from L2, where step
    //    s - kLag left them) before the wait for its sums, so that the wait and both requests overlap.
    if (finish_now) {
      const RowPair<T> done = row_pair<T>(p, finished);
      Vec<T> again[kVecsPerThread];
#pragma unroll
      for (int j = 0; j < kVecsPerThread; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < done.vecs) again[j] = load_vec_streaming<T>(done.row(c).x + done.col(c));  // the last read
      }
      if (threadIdx.x < waiting_threads) {
        const int tensor = threadIdx.x / p.world, r = threadIdx.x % p.world;
        uint64_t word;
        if (wait_for_word(sum_slot(p, p.buffers[p.rank], parity, finished, tensor, r), epoch, &call.ok, word)) {
          partials[tensor][r] = __uint_as_float(payload_of(word));
        } else {
          call.ok = 0;
        }
      } else if (first_finish && header_thread >= 0 && !header_agrees(p, epoch, parity, header_thread, &call)) {
        call.ok = 0;
      } else if (first_finish && !near_wrap && threadIdx.x == epoch_thread) {
        count_in_for_the_epoch(p, epoch);
      }
      first_finish = false;
      __syncthreads();
      if (call.ok == 0) break;  // the same value in every thread: nothing is written
      float totals[kNumTensors] = {0.f, 0.f};
      for (int r = 0; r < p.world; ++r) {  // rank order: the same floats on every rank
        totals[kQ] += partials[kQ][r];
        totals[kK] += partials[kK][r];
      }
      const float q_rstd = rstd_from(totals[kQ], p.q_full_width, p.shard.eps);
      const float k_rstd = rstd_from(totals[kK], p.k_full_width, p.shard.eps);
      if constexpr (kHeldWeights || kSharedWeights) {
#pragma unroll
        for (int j = 0; j < kVecsPerThread; ++j) {
          const int c = threadIdx.x + j * blockDim.x;
          if (c < done.vecs) {
            const float rstd = c < done.q_vecs ? q_rstd : k_rstd;
            T* dst = done.row(c).x + done.col(c);
            if constexpr (kHeldWeights) {
              write_normalized<T, kHfRounding>(dst, again[j], rstd, held_w[j]);
            } else {
              float w[kElems];
              shared_w.get(j, w);
              write_normalized<T, kHfRounding>(dst, again[j], rstd, w);
            }
          }
        }
      } else {
#pragma unroll
        for (int base = 0; base < kVecsPerThread; base += kLaggedWeightUnroll) {
          RawWeights<T> raw[kLaggedWeightUnroll];  // L1 hits: every step of the CTA reads the same columns
#pragma unroll
          for (int b = 0; b < kLaggedWeightUnroll; ++b) {
            const int c = threadIdx.x + (base + b) * blockDim.x;
            if (base + b < kVecsPerThread && c < done.vecs) raw[b] = load_raw_weights<T>(done.row(c), done.col(c));
          }
#pragma unroll
          for (int b = 0; b < kLaggedWeightUnroll; ++b) {
            const int c = threadIdx.x + (base + b) * blockDim.x;
            if (base + b < kVecsPerThread && c < done.vecs) {
              const Row<T> row = done.row(c);
              float w[kElems];
              effective_weights<T, kHfRounding>(raw[b], row.w_is_fp32, p.shard.weight_offset, w);
              write_normalized<T, kHfRounding>(row.x + done.col(c), again[base + b], c < done.q_vecs ? q_rstd : k_rstd,
                                               w);
            }
          }
        }
      }
      if (!sum_now) __syncthreads();  // every thread has read partials before the next step rewrites them
    }

    // 3. Sum the requested rows and push the partials (block_sum's barriers also order 2's reads of
    //    partials before the next step's waits rewrite them).
    if (sum_now) {
      float sums[kNumTensors] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < kVecsPerThread; ++j) {
        const int c = threadIdx.x + j * blockDim.x;
        if (c < pair.vecs) {
          float xf[kElems];
          unpack<T>(x[j], xf);
          float sum_sq = 0.f;
#pragma unroll
          for (int e = 0; e < kElems; ++e) sum_sq += xf[e] * xf[e];
          if (c < pair.q_vecs) {  // a select, not an index: the sums stay in registers
            sums[kQ] += sum_sq;
          } else {
            sums[kK] += sum_sq;
          }
        }
      }
      block_sum<kNumTensors>(sums);
      if (threadIdx.x < waiting_threads) {
        const int tensor = threadIdx.x / p.world, r = threadIdx.x % p.world;
        store_word(sum_slot(p, p.buffers[r], parity, summed, tensor, p.rank),
                   tagged(epoch, __float_as_uint(tensor == kQ ? sums[kQ] : sums[kK])));
      }
    }
  }
  if (near_wrap) end_launch(p, epoch, parity);
}

// ------------------------------------------------------------------------------------------
// v10: v9 with, at decode sizes, each lane's packs of its row and their weights loaded together into registers before the exchange and kept there through it - removes the decode kernel's weight loads after the wait (a memory round trip on every call's critical path; the L1 prefetch did not hide it) and its shared-memory tile
// Measured with clock64 stamps in v9's decode kernel (one H200, world 1, 127 tokens of the
// MiniMax TP=2 shard, one token per CTA, four warps per row; a throwaway build, numbers from
// docs/tp_qk_norm.md): of a CTA's ~5200 cycles, phase 1 (x loaded, staged, summed) took
// ~1700, the push and the wait ~1450, reading the epoch ~170 and phase 4 ~2000, although phase
// 4 reads x back from shared memory and its weight lines had been prefetched into L1 in phase
// 1. Phase 4's only global loads are the weights, and 2000 cycles is a memory round trip plus
// the work. Here a lane issues its x loads and its raw weight loads in one batch in phase 1, so
// both round trips overlap, and phase 4 reads only registers. A lane holds up to
// kHeldPacksPerLane packs of x and of weights (ptxas: 144 registers in bf16, 124 in fp32, 143 in
// fp16, no spill; occupancy does not matter at these sizes, one CTA per SM, which its launch
// bounds say: with ptxas's default budget it spilled); wider rows, and unaligned ones, keep v9's
// kernel. The exchange (phase 2+3) is v4's, shared with v3-v9's decode kernel.
// ------------------------------------------------------------------------------------------
constexpr int kHeldPacksPerLane = 8;  // 8 x 16 bytes of x and 8 (16 or 32 bytes) of weights

template <typename T, bool kHfRounding>
__global__ void __launch_bounds__(kFusedThreads, 1) fused_held_kernel(FusedParams p) {
  constexpr int kElems = Vec<T>::kElems;
  __shared__ float unit_sums[kMaxRowsPerCta];  // one per (row, slice)
  __shared__ float partials[kMaxRowsPerCta][kMaxRanks];
  __shared__ CallState call;

  after_prior_grids();
  const uint32_t epoch = read_epoch(p);
  if (chunk_abandoned(p, epoch)) return;
  const bool near_wrap = epoch >= kLastEpoch - 1;
  const int parity = static_cast<int>(epoch % kParities);
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t first_token = static_cast<int64_t>(blockIdx.x) * p.tokens_per_cta;
  const int64_t left = p.shard.num_tokens - first_token;
  const int tokens = left < p.tokens_per_cta ? static_cast<int>(left > 0 ? left : 0) : p.tokens_per_cta;
  const int slices = p.slices_per_row;
  const int unit = warp;  // the launcher keeps rows * slices <= kFusedWarps: a warp has one unit or none
  const bool has_unit = unit < kNumTensors * tokens * slices;
  const int row = unit / slices, slice = unit % slices;
  const int first = slice * kWarpSize + lane, stride = slices * kWarpSize;

  if (threadIdx.x == 0) open_call(p, call);
  publish_header(p, epoch, parity);

  // Phase 1: warp (row, slice) loads packs first, first + stride, ... of its row and their
  // weights, every load issued before any is used, and sums the squares.
  TileRow<T> t{};
  int packs = 0;
  if (has_unit) {
    t = tile_row<T>(p, first_token, tokens, row);
    packs = t.row.hidden / kElems;
  }
  Vec<T> x[kHeldPacksPerLane];
  RawWeights<T> raw[kHeldPacksPerLane];
#pragma unroll
  for (int i = 0; i < kHeldPacksPerLane; ++i) {
    const int c = first + i * stride;
    if (c < packs) {
      x[i] = load_x<T, true>(t.row.x + c * kElems);
      raw[i] = load_raw_weights<T>(t.row, c * kElems);
    }
  }
  float sum_sq = 0.f;
#pragma unroll
  for (int i = 0; i < kHeldPacksPerLane; ++i) {
    if (first + i * stride < packs) {
      float xf[kElems];
      unpack<T>(x[i], xf);
#pragma unroll
      for (int j = 0; j < kElems; ++j) sum_sq += xf[j] * xf[j];
    }
  }
  sum_sq = warp_sum(sum_sq);
  if (has_unit && lane == 0) unit_sums[unit] = sum_sq;
  __syncthreads();

  exchange_row_sums<T, true>(p, epoch, first_token, tokens, slices, unit_sums, partials, &call);
  __syncthreads();

  // Phase 4: normalize the held packs with the held weights and write them.
  if (call.ok != 0 && has_unit) {
    float total = 0.f;
    for (int source = 0; source < p.world; ++source) total += partials[row][source];  // rank order
    const float rstd = rstd_from(total, t.full_width, p.shard.eps);
#pragma unroll
    for (int i = 0; i < kHeldPacksPerLane; ++i) {
      const int c = first + i * stride;
      if (c < packs) {
        float xf[kElems], w[kElems], y[kElems];
        unpack<T>(x[i], xf);
        effective_weights<T, kHfRounding>(raw[i], t.row.w_is_fp32, p.shard.weight_offset, w);
#pragma unroll
        for (int j = 0; j < kElems; ++j) y[j] = normalized<T, kHfRounding>(xf[j], rstd, w[j]);
        store_x<T, true>(t.row.x + c * kElems, pack<T>(y));
      }
    }
  }
  if (near_wrap) end_launch(p, epoch, parity);
}

// ------------------------------------------------------------------------------------------
// v11: one CTA per token; thread vectors held through the exchange, the next token's loaded before the wait - removes v10's shared tiles between decode and prefill
// Between decode and prefill v10 runs v6's kernel: a CTA stages four to six tokens in a shared
// tile, one warp per row, and waits once per tile; at 512 tokens of the MiniMax TP=2 shard that
// is 128 CTAs on 132 SMs, one warp per row loading 12 packs, far from the local shard. Here a
// CTA takes one token at a time and its block is sized to the row pair: thread i holds vectors
// i, i + blockDim.x, ... (one each at the MiniMax TP=4 shard's 224 threads, two at TP=2's), so
// every vector of every token in flight is one load of its own, and many short CTAs share an SM (v7's finding: a fast memory path needs many short CTAs with their rows
// in registers). What v7's reverted CTA-per-token kernel lacked is loads in flight while a CTA
// waits: here the CTA requests its next token (b + G) before it waits for this one's sums, so
// the NVLink round trip overlaps that load, at the price of one more vector per thread.
//   At decode sizes (a token per CTA) it is v10's held kernel without the slices: each thread
// loads its vector and its weights once; and the first token's loads are issued before the
// epoch is read (they do not depend on it), so that L2 round trip overlaps them instead of
// preceding them (CTA 0's loads also waited for its header stores, which need the epoch).
// Deadlock: CTA b's token t waits only for token t's partials, which each rank pushes after
// finishing only tokens below t (v7's argument); the grid is at most the resident CTAs.
// ------------------------------------------------------------------------------------------
// Blocks of 64 to 256 threads, one, two or four vectors per thread: row pairs up to 1024 vectors
// (8192 bf16 elements; the MiniMax TP=2 shard's 448 vectors are 224 threads of two); wider ones
// keep v10's kernels. The register budget (ptxas, no spills; a thread holds its vectors, the next
// token's and their weights) keeps CTAs per SM for tokens in flight: at most 64 registers at one
// vector per thread (4 CTAs of the TP=4 shard's 224 threads), 128 at two, 255 at four.
constexpr int kTokenRowsMaxThreads = 256;
constexpr int kTokenRowsMinThreads = 64;
constexpr int kTokenRowsMaxVecsPerThread = 4;
constexpr int token_rows_min_ctas_per_sm(int vecs_per_thread) {
  return vecs_per_thread <= 1 ? 4 : vecs_per_thread <= 2 ? 2 : 1;
}
static_assert(kNumTensors * kMaxRanks + kMaxRanks * kHeaderWords + 1 <= kTokenRowsMinThreads,
              "v11: the waiting threads, header threads and the epoch thread fit the smallest block");
static_assert(kTokenRowsMinThreads % kWarpSize == 0 && kTokenRowsMaxThreads % kWarpSize == 0, "whole warps");

// One of a thread's vectors, the same columns at every token: where it lies in token 0's row (q's or
// k's) and that row's token stride, so that token t's is at x0 + t * stride (two 64-bit values
// per vector, where a RowPair would hold both rows' pointers, widths and weights).
template <typename T>
struct TokenColumn {
  T* x0;
  int64_t stride;  // elements per token; 0 for a thread with no vector here
  bool is_q;
};

template <typename T, int kVecsPerThread>
__device__ __forceinline__ void locate_columns(const FusedParams& p, TokenColumn<T> (&col)[kVecsPerThread],
                                               RawWeights<T> (&w_raw)[kVecsPerThread]) {
  const int q_vecs = p.shard.q_hidden / Vec<T>::kElems;
  const int vecs = q_vecs + p.shard.k_hidden / Vec<T>::kElems;
#pragma unroll
  for (int j = 0; j < kVecsPerThread; ++j) {
    const int c = threadIdx.x + j * blockDim.x;
    const bool is_q = c < q_vecs;
    const Row<T> row = locate_row<T>(p.shard, 0, is_q ? kQ : kK);
    const int element = (is_q ? c : c - q_vecs) * Vec<T>::kElems;
    col[j] = {row.x + element, c < vecs ? (is_q ? p.shard.q_token_stride : p.shard.k_token_stride) : 0, is_q};
    if (c < vecs) w_raw[j] = load_raw_weights<T>(row, element);
  }
}

// The thread's vectors of token `token` (vectors threadIdx.x, + blockDim.x, ... of its row pair).
template <typename T, int kVecsPerThread>
__device__ __forceinline__ void load_token(const TokenColumn<T> (&col)[kVecsPerThread], int64_t token,
                                           Vec<T> (&x)[kVecsPerThread]) {
#pragma unroll
  for (int j = 0; j < kVecsPerThread; ++j) {
    if (col[j].stride != 0) x[j] = load_x<T, true>(col[j].x0 + token * col[j].stride);
  }
}

template <typename T, int kVecsPerThread, bool kHfRounding>
__global__ void __launch_bounds__(kTokenRowsMaxThreads, token_rows_min_ctas_per_sm(kVecsPerThread))
    token_rows_kernel(FusedParams p) {
  constexpr int kElems = Vec<T>::kElems;
  __shared__ float partials[kNumTensors][kMaxRanks];
  __shared__ CallState call;

  after_prior_grids();
  // The first token's vectors and this thread's weights, requested before anything that needs the
  // epoch. The launcher gives every CTA a token.
  const int64_t tokens = p.shard.num_tokens;
  TokenColumn<T> col[kVecsPerThread];
  RawWeights<T> w_raw[kVecsPerThread];
  locate_columns<T, kVecsPerThread>(p, col, w_raw);
  Vec<T> x[kVecsPerThread];
  load_token<T, kVecsPerThread>(col, blockIdx.x, x);

  const uint32_t epoch = read_epoch(p);
  if (chunk_abandoned(p, epoch)) return;
  const bool near_wrap = epoch >= kLastEpoch - 1;
  const int parity = static_cast<int>(epoch % kParities);
  const int waiting_threads = kNumTensors * p.world;  // thread (tensor, rank r) pushes to r, waits for r
  const int header_thread = threadIdx.x - (blockDim.x - p.world * kHeaderWords);
  const int epoch_thread = blockDim.x - 1 - p.world * kHeaderWords;
  if (threadIdx.x == 0) open_call(p, call);
  __syncthreads();
  publish_header(p, epoch, parity);

  bool first = true;
  for (int64_t token = blockIdx.x; token < tokens; token += gridDim.x) {
    // The next token's vectors, requested now: they arrive while this token's sums cross the GPUs.
    Vec<T> x_next[kVecsPerThread];
    if (token + gridDim.x < tokens) load_token<T, kVecsPerThread>(col, token + gridDim.x, x_next);

    float sums[kNumTensors] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      if (col[j].stride != 0) {
        float xf[kElems];
        unpack<T>(x[j], xf);
        float sum_sq = 0.f;
#pragma unroll
        for (int e = 0; e < kElems; ++e) sum_sq += xf[e] * xf[e];
        if (col[j].is_q) {  // a select, not an index: the sums stay in registers
          sums[kQ] += sum_sq;
        } else {
          sums[kK] += sum_sq;
        }
      }
    }
    // Its barriers also order the previous token's reads of `partials` before this token's waits
    // rewrite them.
    block_sum<kNumTensors>(sums);

    // Push, wait; at the first token the header check and the epoch count run beside the wait.
    if (threadIdx.x < waiting_threads) {
      const int tensor = threadIdx.x / p.world, r = threadIdx.x % p.world;
      store_word(sum_slot(p, p.buffers[r], parity, token, tensor, p.rank),
                 tagged(epoch, __float_as_uint(tensor == kQ ? sums[kQ] : sums[kK])));
      uint64_t word;
      if (wait_for_word(sum_slot(p, p.buffers[p.rank], parity, token, tensor, r), epoch, &call.ok, word)) {
        partials[tensor][r] = __uint_as_float(payload_of(word));
      } else {
        call.ok = 0;
      }
    } else if (first && header_thread >= 0 && !header_agrees(p, epoch, parity, header_thread, &call)) {
      call.ok = 0;
    } else if (first && !near_wrap && threadIdx.x == epoch_thread) {
      count_in_for_the_epoch(p, epoch);
    }
    first = false;
    __syncthreads();
    if (call.ok == 0) break;  // the same value in every thread: nothing more is written

    float totals[kNumTensors] = {0.f, 0.f};
    for (int r = 0; r < p.world; ++r) {  // rank order: the same floats on every rank
      totals[kQ] += partials[kQ][r];
      totals[kK] += partials[kK][r];
    }
    const float q_rstd = rstd_from(totals[kQ], p.q_full_width, p.shard.eps);
    const float k_rstd = rstd_from(totals[kK], p.k_full_width, p.shard.eps);
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      if (col[j].stride != 0) {
        float xf[kElems], w[kElems], y[kElems];
        unpack<T>(x[j], xf);
        effective_weights<T, kHfRounding>(w_raw[j], col[j].is_q ? p.shard.q_weight_is_fp32 : p.shard.k_weight_is_fp32,
                                          p.shard.weight_offset, w);
        const float rstd = col[j].is_q ? q_rstd : k_rstd;
#pragma unroll
        for (int e = 0; e < kElems; ++e) y[e] = normalized<T, kHfRounding>(xf[e], rstd, w[e]);
        store_x<T, true>(col[j].x0 + token * col[j].stride, pack<T>(y));
      }
    }
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) x[j] = x_next[j];
  }
  if (near_wrap) end_launch(p, epoch, parity);
}

// ------------------------------------------------------------------------------------------
// v13: at decode and mid sizes, v11's walk with one thread per 16-byte vector and the call's counters read beside the first loads - removes v11's serial counter reads before its first barrier, and v10's tiles
// v11's walk (a CTA per token, the next token requested before the wait) with two changes on
// the latency chain of a small call:
//   * thread 0's reads of the wait limit and of the gave-up flag are issued right after
//     griddepcontrol.wait, beside the first token's loads and the epoch read. v11 read them in
//     open_call after the epoch had arrived, one after the other (the limit only where the flag
//     was clear): two more L2 round trips before the CTA's first barrier, on every call.
//   * one 16-byte vector per thread (block = the row pair in whole warps, up to 1024 threads), at
//     every world size: at TP=2 the MiniMax-M2 shard's 448 vectors are 448 threads (v11: 224 of
//     two vectors; v12 ran v10's tiles at one token per SM there). Its registers (ptxas, bf16:
//     56, no spill) keep 5 CTAs of the TP=4 shard's 224 threads per SM. (At 32 registers, SGLang's
//     budget for the same walk, the protocol's paths spilled.) Row pairs of more than 1024 vectors
//     keep v12's kernels.
// The protocol (header, epoch, waits, wrap) is v11's, unchanged.
// ------------------------------------------------------------------------------------------
constexpr int kLeanMaxThreads = 1024;   // one vector per thread: row pairs up to 1024 vectors
constexpr int kLeanMinThreads = 64;     // room for the waiting, header and epoch threads
constexpr int kLeanMinCtasPerSm = 1;   // ptxas's budget at 1024 threads: 64 registers
static_assert(kNumTensors * kMaxRanks + kMaxRanks * kHeaderWords + 1 <= kLeanMinThreads,
              "v13: the waiting threads, header threads and the epoch thread fit the smallest block");
static_assert(kLeanMinThreads % kWarpSize == 0 && kLeanMaxThreads % kWarpSize == 0, "whole warps");
static_assert(cross_head_norm::valid_block_size<kLeanMaxThreads>, "block_sum: at most 1024 threads");

template <typename T, bool kHfRounding>
__global__ void __launch_bounds__(kLeanMaxThreads, kLeanMinCtasPerSm) lean_rows_kernel(FusedParams p) {
  constexpr int kElems = Vec<T>::kElems;
  __shared__ float partials[kNumTensors][kMaxRanks];
  __shared__ CallState call;

  after_prior_grids();
  // Thread 0's counters, the thread's weights and the first token's vector: requested together.
  uint32_t gave_up = 0, wait_limit = 0;
  if (threadIdx.x == 0) {
    gave_up = counter(p, kGaveUpCounter);
    wait_limit = counter(p, kWaitLimitCounter);
  }
  const int q_vecs = p.shard.q_hidden / kElems;
  const int vecs = q_vecs + p.shard.k_hidden / kElems;
  const int c = threadIdx.x;  // this thread's vector of the row pair, the same at every token
  const bool has_vec = c < vecs;
  const bool is_q = c < q_vecs;
  const Row<T> row0 = locate_row<T>(p.shard, 0, is_q ? kQ : kK);
  T* const x0 = row0.x + (is_q ? c : c - q_vecs) * kElems;
  const int64_t stride = is_q ? p.shard.q_token_stride : p.shard.k_token_stride;
  const int64_t tokens = p.shard.num_tokens;
  RawWeights<T> w_raw;
  Vec<T> x;
  if (has_vec) {
    x = load_x<T, true>(x0 + blockIdx.x * stride);  // the launcher gives every CTA a token
    w_raw = load_raw_weights<T>(row0, (is_q ? c : c - q_vecs) * kElems);
  }

  const uint32_t epoch = read_epoch(p);
  if (chunk_abandoned(p, epoch)) return;
  const bool near_wrap = epoch >= kLastEpoch - 1;
  const int parity = static_cast<int>(epoch % kParities);
  const int waiting_threads = kNumTensors * p.world;  // thread (tensor, rank r) pushes to r, waits for r
  const int header_thread = threadIdx.x - (blockDim.x - p.world * kHeaderWords);
  const int epoch_thread = blockDim.x - 1 - p.world * kHeaderWords;
  if (threadIdx.x == 0) {  // open_call, from the values read above
    call.ok = 1;
    call.deadline = global_ticks() + (gave_up != 0 ? 0u : wait_limit);
  }
  __syncthreads();
  publish_header(p, epoch, parity);

  bool first = true;
  for (int64_t token = blockIdx.x; token < tokens; token += gridDim.x) {
    Vec<T> x_next;  // requested now: it arrives while this token's sums cross the GPUs
    if (has_vec && token + gridDim.x < tokens) x_next = load_x<T, true>(x0 + (token + gridDim.x) * stride);

    float sums[kNumTensors] = {0.f, 0.f};
    if (has_vec) {
      float xf[kElems];
      unpack<T>(x, xf);
      float sum_sq = 0.f;
#pragma unroll
      for (int e = 0; e < kElems; ++e) sum_sq += xf[e] * xf[e];
      sums[kQ] = is_q ? sum_sq : 0.f;
      sums[kK] = is_q ? 0.f : sum_sq;
    }
    block_sum<kNumTensors>(sums);  // its barriers order the last token's reads of `partials` first

    if (threadIdx.x < waiting_threads) {
      const int tensor = threadIdx.x / p.world, r = threadIdx.x % p.world;
      store_word(sum_slot(p, p.buffers[r], parity, token, tensor, p.rank),
                 tagged(epoch, __float_as_uint(tensor == kQ ? sums[kQ] : sums[kK])));
      uint64_t word;
      if (wait_for_word(sum_slot(p, p.buffers[p.rank], parity, token, tensor, r), epoch, &call.ok, word)) {
        partials[tensor][r] = __uint_as_float(payload_of(word));
      } else {
        call.ok = 0;
      }
    } else if (first && header_thread >= 0 && !header_agrees(p, epoch, parity, header_thread, &call)) {
      call.ok = 0;
    } else if (first && !near_wrap && threadIdx.x == epoch_thread) {
      count_in_for_the_epoch(p, epoch);
    }
    first = false;
    __syncthreads();
    if (call.ok == 0) break;  // the same value in every thread: nothing more is written

    if (has_vec) {
      float total = 0.f;
      for (int r = 0; r < p.world; ++r) total += partials[is_q ? kQ : kK][r];  // rank order, as every rank
      const float rstd = rstd_from(total, is_q ? p.q_full_width : p.k_full_width, p.shard.eps);
      float xf[kElems], w[kElems], y[kElems];
      unpack<T>(x, xf);
      effective_weights<T, kHfRounding>(w_raw, row0.w_is_fp32, p.shard.weight_offset, w);
#pragma unroll
      for (int e = 0; e < kElems; ++e) y[e] = normalized<T, kHfRounding>(xf[e], rstd, w[e]);
      store_x<T, true>(x0 + token * stride, pack<T>(y));
      x = x_next;
    }
  }
  if (near_wrap) end_launch(p, epoch, parity);
}

// ------------------------------------------------------------------------------------------
// Launchers (host).
// ------------------------------------------------------------------------------------------
inline int sm_count() {
  static int cached[kMaxDevices] = {};
  int device = 0;
  cudaGetDevice(&device);
  if (device < kMaxDevices && cached[device] > 0) return cached[device];
  int sms = 1;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (device < kMaxDevices) cached[device] = sms;
  return sms;
}

// Tokens per CTA: as many as the tile holds (at most kMaxTokensPerCta), but no more than it
// takes to give every SM a CTA: at decode sizes one token per CTA, so the few rows spread out.
inline int tokens_per_cta(int64_t tokens, int row_pair_bytes) {
  const int fit = row_pair_bytes > 0 ? kTileBytes / row_pair_bytes : kMaxTokensPerCta;
  const int64_t spread = (tokens + sm_count() - 1) / sm_count();
  int64_t chosen = fit < kMaxTokensPerCta ? fit : kMaxTokensPerCta;
  if (spread < chosen) chosen = spread;
  return chosen < 1 ? 1 : static_cast<int>(chosen);
}

// Warps per row in v3: all of a CTA's warps share its rows when there are fewer rows than warps.
inline int slices_per_row(int tokens_per_cta) {
  const int rows = kNumTensors * tokens_per_cta;
  return rows < kFusedWarps ? kFusedWarps / rows : 1;
}

// v3 runs its own kernel only where warps share rows (decode sizes); with a warp per row it IS v2
// (measured: the prefetches and the later push cost v2's prefill speed, 1.35x at 16384 tokens).
template <int kVersion, typename T, int kElems, bool kStaged, bool kHfRounding>
inline void launch_fused_kernel(const FusedParams& p, unsigned grid, size_t tile_bytes, cudaStream_t stream) {
  constexpr bool kEarlyEpoch = kVersion >= 4;
  constexpr bool kProgrammatic = kVersion >= 5;
  constexpr bool kBatched = kVersion >= 6;
  void (*kernel)(FusedParams) =
      kVersion == 2 || p.slices_per_row == 1
          ? fused_kernel<T, kElems, kStaged, kHfRounding, kProgrammatic, kBatched>
          : fused_v3_kernel<T, kElems, kStaged, kHfRounding, kEarlyEpoch, kProgrammatic, kBatched>;
  launch_kernel(kProgrammatic, kernel, dim3(grid), dim3(kFusedThreads), tile_bytes, stream, p);
}

// For v10's launch: whether a lane's share of the wider row, at the launch's slices per row, fits in
// kHeldPacksPerLane packs (the decode kernel's units are (row, slice) warps: rows * slices <=
// kFusedWarps whenever slices > 1).
template <typename T>
inline bool held_rows_fit(const FusedParams& p) {
  const int widest = p.shard.q_hidden > p.shard.k_hidden ? p.shard.q_hidden : p.shard.k_hidden;
  return widest / Vec<T>::kElems <= kHeldPacksPerLane * p.slices_per_row * kWarpSize &&
         kNumTensors * p.tokens_per_cta * p.slices_per_row <= kFusedWarps;
}

// `allow_held` = false (v12's table) keeps v10's held-row kernel out: v6's kernels run instead.
template <int kVersion, typename T, int kElems, bool kHfRounding>
inline void launch_fused_packs(FusedParams p, cudaStream_t stream, bool allow_held = true) {
  const int row_pair_bytes = (p.shard.q_hidden + p.shard.k_hidden) * static_cast<int>(sizeof(T));
  const bool staged = row_pair_bytes <= kTileBytes;
  p.tokens_per_cta = staged ? tokens_per_cta(p.shard.num_tokens, row_pair_bytes) : 1;
  p.slices_per_row = kVersion == 2 ? 1 : slices_per_row(p.tokens_per_cta);
  const int64_t ctas = (p.shard.num_tokens + p.tokens_per_cta - 1) / p.tokens_per_cta;
  const unsigned grid = ctas > 0 ? static_cast<unsigned>(ctas) : 1u;  // no tokens: still publish the header
  if constexpr (kVersion >= 10 && kElems == Vec<T>::kElems) {
    if (allow_held && staged && p.slices_per_row > 1 && held_rows_fit<T>(p)) {
      return launch_kernel(true, fused_held_kernel<T, kHfRounding>, dim3(grid), dim3(kFusedThreads), 0, stream, p);
    }
  }
  if (staged) {
    const size_t tile = static_cast<size_t>(p.tokens_per_cta) * row_pair_bytes;
    launch_fused_kernel<kVersion, T, kElems, true, kHfRounding>(p, grid, tile, stream);
  } else {
    launch_fused_kernel<kVersion, T, kElems, false, kHfRounding>(p, grid, 0, stream);
  }
}

// v7's kernel at kVecsPerThread vectors per thread on a persistent grid of its resident CTAs, if
// the chunk has at least a token for each; returns whether it launched.
template <typename T, int kVecsPerThread, bool kHfRounding, WeightSource kWeights>
inline bool launch_lagged_rows_fixed(FusedParams p, int vecs, cudaStream_t stream) {
  constexpr auto kernel = lagged_rows_kernel<T, kVecsPerThread, kHfRounding, kWeights>;
  const int whole_warps = cross_head_norm::threads_for(vecs, kVecsPerThread);
  const int threads = whole_warps < kLaggedMinThreads ? kLaggedMinThreads : whole_warps;
  const int64_t resident = persistent_grid_limit<kernel>(threads);
  if (p.shard.num_tokens < resident) return false;
  p.tokens_per_cta = 1;
  p.slices_per_row = 1;
  launch_kernel(true, kernel, dim3(static_cast<unsigned>(resident)), dim3(threads), 0, stream, p);
  return true;
}

// v7's prefill path for a chunk of 16-byte aligned rows: the fewest vectors per thread that fit
// the row pair in kLaggedMaxThreads threads (as cross_head_norm v3 sizes its block); false where
// the row pair is too wide or the chunk too small (v6 runs).
// v8 (registers) the same, its weights held up to kHeldWeightsMaxVecs per thread; v9 (shared
// memory) at every width.
template <typename T, bool kHfRounding, WeightSource kWeights>
inline bool launch_lagged_rows(const FusedParams& p, cudaStream_t stream) {
  const int vecs = (p.shard.q_hidden + p.shard.k_hidden) / Vec<T>::kElems;
  static_assert(kLaggedMaxVecsPerThread == 8 && kHeldWeightsMaxVecs == 4, "the cases below");
  constexpr WeightSource kWide = kWeights == WeightSource::kRegisters ? WeightSource::kReloaded : kWeights;
  if (vecs <= kLaggedMaxThreads) return launch_lagged_rows_fixed<T, 1, kHfRounding, kWeights>(p, vecs, stream);
  if (vecs <= 2 * kLaggedMaxThreads) return launch_lagged_rows_fixed<T, 2, kHfRounding, kWeights>(p, vecs, stream);
  if (vecs <= 4 * kLaggedMaxThreads) return launch_lagged_rows_fixed<T, 4, kHfRounding, kWeights>(p, vecs, stream);
  if (vecs <= 8 * kLaggedMaxThreads) return launch_lagged_rows_fixed<T, 8, kHfRounding, kWide>(p, vecs, stream);
  return false;
}

// The lagged walk's weight source of each version from v7 on.
constexpr WeightSource lagged_weights(int version) {
  return version >= 9 ? WeightSource::kShared : version == 8 ? WeightSource::kRegisters : WeightSource::kReloaded;
}

// v11's kernel at kVecsPerThread vectors per thread, on a persistent grid: a CTA per token up to
// the resident CTAs, then each CTA walks tokens b, b + G, ...
template <typename T, int kVecsPerThread, bool kHfRounding>
inline void launch_token_rows_fixed(FusedParams p, int vecs, cudaStream_t stream) {
  constexpr auto kernel = token_rows_kernel<T, kVecsPerThread, kHfRounding>;
  const int whole_warps = cross_head_norm::threads_for(vecs, kVecsPerThread);
  const int threads = whole_warps < kTokenRowsMinThreads ? kTokenRowsMinThreads : whole_warps;
  const int64_t resident = persistent_grid_limit<kernel>(threads);
  const int64_t grid = p.shard.num_tokens < resident ? p.shard.num_tokens : resident;
  p.tokens_per_cta = 1;
  p.slices_per_row = 1;
  launch_kernel(true, kernel, dim3(static_cast<unsigned>(grid)), dim3(threads), 0, stream, p);
}

// v11's path for a chunk of 16-byte aligned rows: the fewest vectors per thread that fit the row
// pair in kTokenRowsMaxThreads threads; false where the row pair is too wide, or the chunk has no
// token (v2's kernel then publishes the empty call's header).
template <typename T, bool kHfRounding>
inline bool launch_token_rows(const FusedParams& p, cudaStream_t stream) {
  if (p.shard.num_tokens == 0) return false;
  const int vecs = (p.shard.q_hidden + p.shard.k_hidden) / Vec<T>::kElems;
  static_assert(kTokenRowsMaxVecsPerThread == 4, "the cases below");
  if (vecs <= kTokenRowsMaxThreads) {
    launch_token_rows_fixed<T, 1, kHfRounding>(p, vecs, stream);
  } else if (vecs <= 2 * kTokenRowsMaxThreads) {
    launch_token_rows_fixed<T, 2, kHfRounding>(p, vecs, stream);
  } else if (vecs <= 4 * kTokenRowsMaxThreads) {
    launch_token_rows_fixed<T, 4, kHfRounding>(p, vecs, stream);
  } else {
    return false;
  }
  return true;
}

// v13's kernel on a persistent grid (a CTA per token up to the resident CTAs); false where the
// row pair has more vectors than a block has threads, or the chunk has no token (v2's kernel
// then publishes the empty call's header).
template <typename T, bool kHfRounding>
inline bool launch_lean_rows(FusedParams p, cudaStream_t stream) {
  const int vecs = (p.shard.q_hidden + p.shard.k_hidden) / Vec<T>::kElems;
  if (p.shard.num_tokens == 0 || vecs > kLeanMaxThreads) return false;
  constexpr auto kernel = lean_rows_kernel<T, kHfRounding>;
  const int whole_warps = cross_head_norm::threads_for(vecs, 1);
  const int threads = whole_warps < kLeanMinThreads ? kLeanMinThreads : whole_warps;
  const int64_t resident = persistent_grid_limit<kernel>(threads);
  const int64_t grid = p.shard.num_tokens < resident ? p.shard.num_tokens : resident;
  p.tokens_per_cta = 1;
  p.slices_per_row = 1;
  launch_kernel(true, kernel, dim3(static_cast<unsigned>(grid)), dim3(threads), 0, stream, p);
  return true;
}

// ------------------------------------------------------------------------------------------
// v12: v10's and v11's kernels chosen per chunk from a table keyed by world size - removes v10's dispatch, tuned at TP=2 alone
// Which kernel is fastest for a number of tokens depends on the shard's width and on how many
// ranks wait for each other, both set by the world size: narrower shards put more tokens in a
// tile and make each token's loads shorter against the same exchange latency. So the table has
// a row per world size, in tokens per SM (the held kernel's tiling and the resident CTAs scale
// with the SMs), read at every chunk: tokens per SM = ceil(chunk tokens / SMs).
//   up to held_rows: v10's held-row kernel (v6's decode kernel where the rows do not fit it);
//   up to token_rows: v11's token rows;
//   above: v9's lagged walk where lagged_prefill is set and the chunk has a token per resident
//          CTA, else v6's kernels (tiles).
// Where the rows are not 16-byte aligned every version runs v6's one-element kernels.
// ------------------------------------------------------------------------------------------
struct Dispatch {
  int held_rows;        // tokens per SM up to which v10's held-row kernel runs (its tiling allows 2)
  int token_rows;       // and above that, up to which v11's token-row kernel runs
  bool lagged_prefill;  // above both: v9's lagged walk (true) or v6's tiles
};

// The rows, from measurements (docs/tp_qk_norm.md, "v12", says which; `python -m cookbook.bench.tp
// --propose-dispatch` reads a sweep and prints the row). TP=2 and TP=4 are what their MiniMax-M2
// pages measured: v10's held rows at one token per SM at TP=2 (none at TP=4), v11's token rows up
// to 4 tokens per SM, v9's lagged walk above. TP=8 runs the tiles at prefill, the only prefill
// kernel its page measured. World sizes without a measurement take the row of the next measured
// size up: their shards are at least as wide.
constexpr Dispatch kDispatchByWorld[kMaxRanks + 1] = {
    {1, 4, true},   // 0: unused
    {1, 4, true},   // 1: a group of one (the checks run it), as 2
    {1, 4, true},   // 2: measured
    {0, 4, true},   // 3: as 4
    {0, 4, true},   // 4: measured
    {2, 0, false},  // 5: as 8
    {2, 0, false},  // 6: as 8
    {2, 0, false},  // 7: as 8
    {2, 0, false},  // 8: measured (prefill)
};

template <typename T, bool kHfRounding>
inline void launch_by_table(const FusedParams& chunk, bool packed, cudaStream_t stream) {
  constexpr int kElems = Vec<T>::kElems;
  if (!packed) return launch_fused_packs<12, T, 1, kHfRounding>(chunk, stream);
  const Dispatch d = kDispatchByWorld[chunk.world];
  const int64_t tokens_per_sm = (chunk.shard.num_tokens + sm_count() - 1) / sm_count();
  if (tokens_per_sm <= d.held_rows) return launch_fused_packs<12, T, kElems, kHfRounding>(chunk, stream);
  if (tokens_per_sm <= d.token_rows && launch_token_rows<T, kHfRounding>(chunk, stream)) return;
  if (d.lagged_prefill && launch_lagged_rows<T, kHfRounding, WeightSource::kShared>(chunk, stream)) return;
  launch_fused_packs<12, T, kElems, kHfRounding>(chunk, stream, /*allow_held=*/false);
}

// v13's dispatch: the lean kernel up to kLeanTokensPerSm tokens per SM at every world size, v12's
// table above. Measured on 4 and 2 H200s at MiniMax-M2's widths, both timing methods
// (docs/results/tp_qk_norm_h200x4_v12_v13_v14.md, tp_qk_norm_h200x2_v12_v13_v14.md and their
// _back_to_back pages): the lean kernel led v12 up to 512 tokens (4 per
// SM) and trailed it at 2048 (16 per SM: 12.85 against 12.18 us at TP=4, 19.32 against 15.14 at
// TP=2, where its 448-thread CTAs keep 2 per SM), so the band ends at 4.
constexpr int kLeanTokensPerSm = 4;

template <typename T, bool kHfRounding>
inline void launch_lean_or_table(const FusedParams& chunk, bool packed, cudaStream_t stream) {
  const int64_t tokens_per_sm = (chunk.shard.num_tokens + sm_count() - 1) / sm_count();
  if (packed && tokens_per_sm <= kLeanTokensPerSm && launch_lean_rows<T, kHfRounding>(chunk, stream)) return;
  launch_by_table<T, kHfRounding>(chunk, packed, stream);
}

// One launch per chunk of at most `capacity` tokens (each chunk is one epoch of the protocol).
template <int kVersion, typename T, bool kHfRounding>
inline void launch_fused(const FusedParams& call, cudaStream_t stream) {
  const bool packed = cross_head_norm::vector_aligned<T>(call.shard);
  int64_t first = 0;
  int chunk_index = 0;
  do {
    FusedParams chunk = call;
    const int64_t left = call.shard.num_tokens - first;
    chunk.shard.num_tokens = left < call.capacity ? left : call.capacity;
    chunk.shard.q = static_cast<T*>(call.shard.q) + first * call.shard.q_token_stride;
    chunk.shard.k = static_cast<T*>(call.shard.k) + first * call.shard.k_token_stride;
    chunk.chunk_index = chunk_index++;
    if (kVersion >= 13) {
      launch_lean_or_table<T, kHfRounding>(chunk, packed, stream);
    } else if (kVersion == 12) {
      launch_by_table<T, kHfRounding>(chunk, packed, stream);
    } else if (kVersion == 11 && packed && launch_token_rows<T, kHfRounding>(chunk, stream)) {
      // v11's kernel took the chunk (v10's kernels where the row pair is too wide)
    } else if (kVersion >= 7 && packed && launch_lagged_rows<T, kHfRounding, lagged_weights(kVersion)>(chunk, stream)) {
      // v7's (v8's, v9's) kernel took the chunk
    } else if (packed) {
      launch_fused_packs<kVersion, T, Vec<T>::kElems, kHfRounding>(chunk, stream);
    } else {
      launch_fused_packs<kVersion, T, 1, kHfRounding>(chunk, stream);  // any alignment: one element at a time
    }
    first += chunk.shard.num_tokens;
  } while (first < call.shard.num_tokens);
}

constexpr int kNumVersions = 13;
constexpr int kTunedVersion = kNumVersions;  // what backend="cuda" runs

// ------------------------------------------------------------------------------------------
// Host entry points, one per dtype and rounding, so that a build can compile them in separate units
// in parallel: the tuned extension (cookbook/cuda.py: `load_tp`) compiles each
// (dtype, rounding) in its own unit with COOKBOOK_TP_TUNED defined, where fused_of compiles
// kTunedVersion alone (and v1's two kernels): every unit declares the entry points extern
// (COOKBOOK_TP_SPLIT_UNITS), so the dispatchers below instantiate nothing, and a kernel unit then
// instantiates its own. The ladder's extension compiles every version in one unit.
// ------------------------------------------------------------------------------------------
template <typename T>
cudaError_t sum_sq_of(const Params& p, float* out, cudaStream_t stream) {
  launch_sum_sq<T>(p, out, stream);
  return cudaGetLastError();
}

template <typename T, bool kHfRounding>
cudaError_t apply_of(const ApplyParams& a, cudaStream_t stream) {
  launch_apply<T, kHfRounding>(a, stream);
  return cudaGetLastError();
}

// The fused versions (v2..kNumVersions); v1 is sum_sq + the host's all-reduce + apply.
template <typename T, bool kHfRounding>
cudaError_t fused_of(const FusedParams& p, int version, cudaStream_t stream) {
#ifdef COOKBOOK_TP_TUNED
  if (version != kTunedVersion) return cudaErrorInvalidValue;
  launch_fused<kTunedVersion, T, kHfRounding>(p, stream);
#else
  switch (version) {
    case 2: launch_fused<2, T, kHfRounding>(p, stream); break;
    case 3: launch_fused<3, T, kHfRounding>(p, stream); break;
    case 4: launch_fused<4, T, kHfRounding>(p, stream); break;
    case 5: launch_fused<5, T, kHfRounding>(p, stream); break;
    case 6: launch_fused<6, T, kHfRounding>(p, stream); break;
    case 7: launch_fused<7, T, kHfRounding>(p, stream); break;
    case 8: launch_fused<8, T, kHfRounding>(p, stream); break;
    case 9: launch_fused<9, T, kHfRounding>(p, stream); break;
    case 10: launch_fused<10, T, kHfRounding>(p, stream); break;
    case 11: launch_fused<11, T, kHfRounding>(p, stream); break;
    case 12: launch_fused<12, T, kHfRounding>(p, stream); break;
    case 13: launch_fused<13, T, kHfRounding>(p, stream); break;
    default: return cudaErrorInvalidValue;
  }
  static_assert(kNumVersions == 13, "a case per fused version above");
#endif
  return cudaGetLastError();
}

#ifdef COOKBOOK_TP_SPLIT_UNITS  // defined in the units of the tuned extension (cookbook/cuda.py)
#define COOKBOOK_TP_EXTERN(T)                                                                   \
  extern template cudaError_t sum_sq_of<T>(const Params&, float*, cudaStream_t);                \
  extern template cudaError_t apply_of<T, false>(const ApplyParams&, cudaStream_t);             \
  extern template cudaError_t apply_of<T, true>(const ApplyParams&, cudaStream_t);              \
  extern template cudaError_t fused_of<T, false>(const FusedParams&, int, cudaStream_t);        \
  extern template cudaError_t fused_of<T, true>(const FusedParams&, int, cudaStream_t);
COOKBOOK_TP_EXTERN(float)
COOKBOOK_TP_EXTERN(__half)
COOKBOOK_TP_EXTERN(__nv_bfloat16)
#undef COOKBOOK_TP_EXTERN
#endif

// By the call's dtype and rounding: f.template operator()<T, kHfRounding>().
template <typename F>
inline cudaError_t by_dtype(DType dtype, bool hf_rounding, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return hf_rounding ? f.template operator()<float, true>() : f.template operator()<float, false>();
    case DType::kFloat16: return hf_rounding ? f.template operator()<__half, true>() : f.template operator()<__half, false>();
    case DType::kBFloat16:
      return hf_rounding ? f.template operator()<__nv_bfloat16, true>() : f.template operator()<__nv_bfloat16, false>();
  }
  return cudaErrorInvalidValue;
}

inline cudaError_t sum_sq(const Params& p, DType dtype, float* out, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  return by_dtype(dtype, false, [&]<typename T, bool>() { return sum_sq_of<T>(p, out, stream); });
}

inline cudaError_t apply(const ApplyParams& a, DType dtype, bool hf_rounding, cudaStream_t stream) {
  if (a.shard.num_tokens == 0) return cudaSuccess;
  return by_dtype(dtype, hf_rounding, [&]<typename T, bool kHf>() { return apply_of<T, kHf>(a, stream); });
}

inline cudaError_t fused(const FusedParams& p, DType dtype, bool hf_rounding, int version, cudaStream_t stream) {
  if (version < 2 || version > kNumVersions || p.world < 1 || p.world > kMaxRanks) return cudaErrorInvalidValue;
  return by_dtype(dtype, hf_rounding, [&]<typename T, bool kHf>() { return fused_of<T, kHf>(p, version, stream); });
}

// A rank that does not take part in a call (it rejected its arguments) still launches once, so
// that the ranks stay in step: v2's kernel with no tokens and an absent header publishes it to
// every rank, waits (bounded) for the peers' headers, records nothing and advances the epoch.
// The peers find the absent header, write nothing and report it.
inline cudaError_t absent(FusedParams p, cudaStream_t stream) {
  absent_header(p);
  p.shard.num_tokens = 0;
  p.chunk_index = 0;
  p.tokens_per_cta = 1;
  p.slices_per_row = 1;
  fused_kernel<float, 1, false, false><<<1, kFusedThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cookbook::tp_qk_norm
