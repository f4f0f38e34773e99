// tp_qk_norm's launch arguments and the words its kernels exchange: what every rung and the tuned
// kernel take, and what the torch binding fills in. Plain C++ (no device code).
//
//   rank r holds the columns x_r of each token's q row (and of its k row), and the matching w_r:
//   sum_sq = sum over ranks r of sum(x_r^2)            the all-reduce: 2 floats per token
//   y_r    = x_r * rsqrt(sum_sq / full_width + eps) * (w_r + weight_offset)
//
// A shard row is a cross_head_norm row cut into tp pieces, so a shard is cross_head_norm's Params
// (q_hidden and k_hidden are the SHARD widths); only the width in the mean is the full one.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>

#include "cross_head_norm/params.h"
#include "include/dtype.h"

namespace cookbook::tp_qk_norm {

using Params = cross_head_norm::Params;  // this rank's shard: q_hidden / k_hidden are the SHARD widths

// Rung 1's last step: the shard and the all-reduced sums.
struct ApplyParams {
  Params shard;
  const float* sum_sq;  // [T][2] (q's, k's), summed over every rank
  float q_full_width;   // q_hidden * tp
  float k_full_width;
};

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
constexpr int kHeaderMath = 4;     // dtype, rounding, the weights' storage and the implementation (kMath* below)
constexpr int kHeaderWords = 5;
constexpr int kWidthShift = 16;
constexpr int kMathDTypeShift = 0;  // DType: 2 bits
constexpr int kMathHfBit = 2;       // rounding == "hf"
constexpr int kMathQWeightFp32Bit = 3;
constexpr int kMathKWeightFp32Bit = 4;
constexpr int kMathImplementationShift = 8;  // a rung's number; kTunedImplementation
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
  int slices_per_row;         // tiles: warps that share a row (1: a warp per row)
  uint32_t* counters;         // [kNumCounters], this GPU
  volatile int64_t* status;   // [kNumStatusWords], pinned host memory
};

// Host: the header of a call (kHeader* above), as every rank computes it from its own arguments and
// its count of the group's calls (tp_workspace keeps it, and every rank counts every call, a
// rejected one too: a rank whose count differs made a different sequence of calls).
inline void call_header(FusedParams& p, int64_t call_tokens, DType dtype, bool hf_rounding, int implementation,
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
                          static_cast<uint32_t>(implementation) << kMathImplementationShift |
                          static_cast<uint32_t>(call_number & 0xffff) << kMathCallShift;
}

// Host: the header of a rank that does not take part (kAbsent in every word).
inline void absent_header(FusedParams& p) {
  for (uint32_t& word : p.header) word = kAbsent;
}


// The header's implementation for the tuned kernel (a rung's is its number).
constexpr int kTunedImplementation = 0;

// Every kernel file defines, in its own namespace, the launchers of the steps it runs:
//   template <DType, Rounding> cudaError_t launch(const FusedParams&, cudaStream_t)          v2 on: the fused call
//   template <DType> cudaError_t launch_sum_sq(const Params&, float* sum_sq, cudaStream_t)   v1: the sums
//   template <DType, Rounding> cudaError_t launch_apply(const ApplyParams&, cudaStream_t)    v1: the apply
// (rung 1 and the tuned kernel have the last two: the host all-reduces the sums between them).
using FusedLauncher = cudaError_t (*)(const FusedParams&, cudaStream_t);
using SumSqLauncher = cudaError_t (*)(const Params&, float*, cudaStream_t);
using ApplyLauncher = cudaError_t (*)(const ApplyParams&, cudaStream_t);

}  // namespace cookbook::tp_qk_norm
