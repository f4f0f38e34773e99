// The tiles of tokens of rungs 2 to 4 (and of the tuned kernel where its other kernels do not
// run): a CTA stages a tile of tokens' rows in shared memory, exchanges their sums once per tile,
// and writes. Two kernels:
//   fused_kernel     a warp per row (v2), every size;
//   fused_v3_kernel  where a tile has fewer rows than warps (decode sizes, v3 on): the warps of
//                    the CTA share each row, and the exchange runs beside the header check.
// Their template arguments beyond the dtype, the pack width and the staging are the rungs' ideas,
// named in TileFeatures; launch_tiles picks the kernel, the tile and the grid.
#pragma once

#include "tp_qk_norm/exchange.cuh"
#include "tp_qk_norm/geometry.h"

namespace cookbook::tp_qk_norm {

static_assert(kRowsPerToken == kNumTensors, "a token's rows: its q row and its k row");

// ------------------------------------------------------------------------------------------
// fused_kernel, rung 2's (see v2_fused_tiles.cuh)
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
// Rows too wide to stage (kStaged = false) are re-read from global memory in phase 4.
// ------------------------------------------------------------------------------------------
constexpr int kLoadUnroll = 4;  // packs of a row in flight per lane (v4's batches; v2's and v3's unroll)
static_assert(kFusedThreads % kWarpSize == 0 && kFusedThreads <= kMaxWarpsPerBlock * kWarpSize,
              "tiles: whole warps, at most 1024 threads");
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
// v2 and v3 load a pack and then use it; a generic load may alias the shared tile, so the compiler
// keeps each load behind the previous pack's store into it: one memory round trip per pack.
// v4 (kBatched) issues kLoadUnroll loads before using any. Either way a lane sums its packs in
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
// with rstd and written. v4 (kBatched) issues a batch's global loads (the weights, and x where
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
// fused_v3_kernel, rung 3's (see v3_decode_latency.cuh)
// ------------------------------------------------------------------------------------------
static_assert(kMaxRowsPerCta >= kFusedWarps, "v3: (row, slice) units never outnumber kMaxRowsPerCta");
static_assert(kMaxRowsPerCta * kMaxRanks + kMaxRanks * kHeaderWords <= kFusedThreads,
              "v3: the waiting threads and the header-checking threads are disjoint");

// The early epoch (v3): the decode kernel advances the epoch as soon as every CTA has read it.
// Safe: each CTA reads the epoch once, at its start, before it counts itself in, so the last CTA
// to count itself in can advance it; the next launch starts only after this one completes. The
// two launches before the wrap keep the end-of-launch path (they zero their half at the end).
constexpr int kEpochThread = kFusedThreads - 1 - kMaxRanks * kHeaderWords;  // neither a waiting nor a header thread
static_assert(kEpochThread >= kMaxRowsPerCta * kMaxRanks, "v3: the epoch thread does not wait for sums");

// Phase 2+3 of the decode kernels: thread (row, rank r) adds up the row's slice sums in
// a fixed order, pushes the partial to rank r and waits for rank r's; the top world *
// kHeaderWords threads check the headers meanwhile (a mismatch clears call->ok, which stops
// the waits), and with the early epoch one other thread counts the CTA in for the next epoch.
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
// Host: the rungs' ideas, and the launch of a chunk's tiles.
// ------------------------------------------------------------------------------------------
struct TileFeatures {
  bool share_rows_at_decode;  // v3: fused_v3_kernel where a tile has fewer rows than warps
  bool early_epoch;           // v3: its epoch advances once every CTA has read it
  bool programmatic;          // v3: a programmatic dependent launch (griddepcontrol)
  bool batched_loads;         // v4: a lane's loads of a row issued as one batch
};

template <TileFeatures kTiles, typename T, int kElems, bool kStaged, bool kHfRounding>
inline void launch_tile_kernel(const FusedParams& p, unsigned grid, size_t tile_bytes, cudaStream_t stream) {
  void (*kernel)(FusedParams) = fused_kernel<T, kElems, kStaged, kHfRounding, kTiles.programmatic, kTiles.batched_loads>;
  if constexpr (kTiles.share_rows_at_decode) {
    if (p.slices_per_row > 1) {
      kernel = fused_v3_kernel<T, kElems, kStaged, kHfRounding, kTiles.early_epoch, kTiles.programmatic,
                               kTiles.batched_loads>;
    }
  }
  launch_kernel(kTiles.programmatic, kernel, dim3(grid), dim3(kFusedThreads), tile_bytes, stream, p);
}

// One chunk in tiles of kElems-element packs (16 bytes where the rows are aligned, else 1).
template <TileFeatures kTiles, typename T, int kElems, bool kHfRounding>
inline void launch_tiles(FusedParams p, cudaStream_t stream) {
  const int row_pair_bytes = (p.shard.q_hidden + p.shard.k_hidden) * static_cast<int>(sizeof(T));
  const bool staged = row_pair_bytes <= kTileBytes;
  p.tokens_per_cta = staged ? tokens_per_cta(p.shard.num_tokens, row_pair_bytes, sm_count()) : 1;
  p.slices_per_row = kTiles.share_rows_at_decode ? slices_per_row(p.tokens_per_cta) : 1;
  const int64_t ctas = (p.shard.num_tokens + p.tokens_per_cta - 1) / p.tokens_per_cta;
  const unsigned grid = ctas > 0 ? static_cast<unsigned>(ctas) : 1u;  // no tokens: still publish the header
  if (staged) {
    const size_t tile = static_cast<size_t>(p.tokens_per_cta) * row_pair_bytes;
    launch_tile_kernel<kTiles, T, kElems, true, kHfRounding>(p, grid, tile, stream);
  } else {
    launch_tile_kernel<kTiles, T, kElems, false, kHfRounding>(p, grid, 0, stream);
  }
}

// 16-byte packs where the rows and weights allow, else one element at a time.
template <TileFeatures kTiles, typename T, bool kHfRounding>
inline void launch_tiles_any_alignment(const FusedParams& chunk, cudaStream_t stream) {
  if (cross_head_norm::vector_aligned<T>(chunk.shard)) {
    launch_tiles<kTiles, T, Vec<T>::kElems, kHfRounding>(chunk, stream);
  } else {
    launch_tiles<kTiles, T, 1, kHfRounding>(chunk, stream);
  }
}

}  // namespace cookbook::tp_qk_norm
