// What every fused tp_qk_norm kernel shares: a shard's rows (cross_head_norm's row access), the
// exchange protocol through the peers' symmetric-memory buffers (the call's header, the epoch,
// pushing a tagged partial sum and polling for one, the report of a failed call) and the host's
// walk over a call in chunks. Each kernel lives in its own file (v2_*.cuh ... v7_*.cuh, tuned.cuh).
//
// Every word of a peer buffer is (epoch << 32) | payload; a reader waits until the tag is the
// current epoch. cookbook/tp_workspace.py allocates the buffers and documents their layout.
#pragma once

#include "cross_head_norm/rows.cuh"
#include "include/common.cuh"
#include "tp_qk_norm/params.h"

namespace cookbook::tp_qk_norm {

using cross_head_norm::kK;
using cross_head_norm::kNumTensors;
using cross_head_norm::kQ;
using cross_head_norm::locate_row;
using cross_head_norm::Row;
using cross_head_norm::RawWeights;  // weights as loaded: the batched tiles and the CTA-per-token walks
using cross_head_norm::load_raw_weights;
using cross_head_norm::effective_weights;

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

// The early epoch (v3 on): each CTA calls it once, after it has read the epoch; the last CTA to count
// itself in advances the epoch for the next launch (which reads it only after this one completes).
__device__ __forceinline__ void count_in_for_the_epoch(const FusedParams& p, uint32_t epoch) {
  if (atomicAdd(p.counters + kDoneCounter, 1u) == gridDim.x - 1) {  // every CTA has read the epoch
    p.counters[kDoneCounter] = 0;
    p.counters[kEpochCounter] = next_epoch(epoch);
  }
}

// ------------------------------------------------------------------------------------------
// Host.
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

// Runs launch_chunk(chunk) for each chunk of at most `capacity` tokens of the call (each chunk is
// one epoch of the protocol; a call with no tokens is one empty chunk, which still publishes its
// header), and returns the launch error, if any.
template <typename T, typename LaunchChunk>
inline cudaError_t for_each_chunk(const FusedParams& call, LaunchChunk&& launch_chunk) {
  int64_t first = 0;
  int chunk_index = 0;
  do {
    FusedParams chunk = call;
    const int64_t left = call.shard.num_tokens - first;
    chunk.shard.num_tokens = left < call.capacity ? left : call.capacity;
    chunk.shard.q = static_cast<T*>(call.shard.q) + first * call.shard.q_token_stride;
    chunk.shard.k = static_cast<T*>(call.shard.k) + first * call.shard.k_token_stride;
    chunk.chunk_index = chunk_index++;
    launch_chunk(chunk);
    first += chunk.shard.num_tokens;
  } while (first < call.shard.num_tokens);
  return cudaGetLastError();
}

// Tokens per SM of a chunk: ceil(tokens / SMs).
inline int64_t tokens_per_sm(const FusedParams& chunk) { return (chunk.shard.num_tokens + sm_count() - 1) / sm_count(); }

}  // namespace cookbook::tp_qk_norm
