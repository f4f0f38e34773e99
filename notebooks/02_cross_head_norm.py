# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # `cross_head_norm`: RMSNorm over all heads, and what registers cost in occupancy
#
# The second op of the cookbook, in the order of the Triton tutorials: why the op exists, its
# math and contract on a tiny example, the PyTorch reference, the napkin math, the Numba kernel,
# the numbered CUDA C versions and the flaw each one fixes, the compiler's resource report and
# the theoretical occupancy it allows, an agreement check of every implementation, and the
# side-by-side benchmark. The lesson of this op is **occupancy**: a row is thousands of elements,
# so one CTA owns a row, and how many registers each thread keeps live decides how many CTAs an
# SM can hold at once.
#
# It runs top to bottom on a laptop: without a GPU the Numba kernel runs under Numba's CUDA
# simulator on tiny shapes and the timing cells show what the benchmark recorded on a GPU
# (`docs/results/`) instead of measuring. Every number printed below is computed here or read
# from a recorded results page; the code shown is read from the tested sources, never pasted.
#
# **The first cell matters.** Numba reads `NUMBA_ENABLE_CUDASIM` once, when it is first
# imported, so on a machine without a GPU the simulator must be switched on *before anything
# imports Numba*: `walkthrough.setup()` does that (see `notebooks/01_qk_norm` for the details).
# `cookbook/walkthrough.py` holds what every notebook here shares: setup, agreement tables,
# timing, plots and short excerpts of the sources.

# %%
import sys
from pathlib import Path

# Run from a checkout (e.g. `notebooks/`): make its packages importable, whether installed or not.
ROOT = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "cookbook" / "walkthrough.py").is_file()), None)
if ROOT is not None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cookbook import walkthrough  # imports neither Numba nor a CUDA extension

session = walkthrough.setup()  # without a GPU: NUMBA_ENABLE_CUDASIM=1, before anything imports Numba

# %%
import inspect
import re

import torch

import cookbook
from cookbook import bench, nvcc_report, registry

OP = "cross_head_norm"
contract = registry.contract(OP)  # the contract module cookbook/ops/cross_head_norm.py
torch.set_printoptions(precision=6, linewidth=120)

# %% [markdown]
# ## 1. Motivation: normalizing q and k over all heads at once
#
# `qk_norm` (notebook 01) normalizes each head separately. OLMo2, Wan (and LTX), and MiniMax
# normalize q and k **across all heads**: the RMS statistic of a token's q is taken over its whole
# `num_heads * head_dim` row, before the projection output is split into heads. In Hugging
# Face's OLMo2 attention the forward pass reads, in essence:
#
# ```python
# q = self.q_norm(self.q_proj(x))          # RMSNorm over hidden = heads * head_dim, weight [hidden]
# k = self.k_norm(self.k_proj(x))          # k_hidden = kv_heads * head_dim (smaller with GQA)
# q, k = q.view(*tokens, -1, head_dim), k.view(*tokens, -1, head_dim)
# q, k = apply_rotary_pos_emb(q, k, cos, sin)
# ```
#
# In an engine q and k are column slices of one fused qkv tensor, and with grouped-query
# attention q and k rows have **different widths** (MiniMax-M2 at TP=1: 6144 and 1024). The
# op does almost no arithmetic per byte; what is new compared to `qk_norm` is the row length:
# thousands of elements instead of 128, which one warp cannot hold in registers.

# %% [markdown]
# ## 2. The math and the contract
#
# Per token row `x` of q (length `q_hidden`) and of k (length `k_hidden`), accumulated in float32:
# `y = x * rsqrt(mean(x^2 over the row) + eps) * (w + weight_offset)`. The contract module's
# docstring, printed from the source, says what is accepted (including packed
# `[tokens, heads, head_dim]` views, where the weight's length names the row):

# %%
print(contract.__doc__)

# %% [markdown]
# A tiny example makes the difference from a per-head norm concrete: 2 tokens, q and k of 2 heads
# x 4 (hidden 8). The same `[T, heads, head_dim]` view is a cross-head norm with a
# `[heads * head_dim]` weight and a per-head norm (T * heads rows) with a `[head_dim]` weight.

# %%
EPS = 1e-6
tiny = contract.make_inputs(2, 8, 8, torch.float32, "cpu", seed=0, head_dim=4)
print(f"q {tuple(tiny['q'].shape)}, k {tuple(tiny['k'].shape)}, weights {tuple(tiny['q_weight'].shape)}, "
      f"{tuple(tiny['k_weight'].shape)}")

cross = {name: t.clone() for name, t in tiny.items()}
cookbook.cross_head_norm(**cross, eps=EPS, backend="reference")

per_head = {name: t.clone() for name, t in tiny.items()}
per_head["q_weight"], per_head["k_weight"] = torch.ones(4), torch.ones(4)  # [head_dim] weights: one row per head
cookbook.cross_head_norm(**per_head, eps=EPS, backend="reference")

q0 = tiny["q"][0]
print(f"\ntoken 0 of q, per head:\n{q0}")
print(f"mean(x^2) over the whole row: {q0.square().mean().item():.4f}; per head: {q0.square().mean(-1).tolist()}")
print(f"\ncross-head norm (one rstd per token), token 0:\n{cross['q'][0]}")
print(f"per-head norm (unit weights; one rstd per head), token 0:\n{per_head['q'][0]}")
print(f"mean(y^2 / w^2) over the row after the cross-head norm: "
      f"{(cross['q'][0].flatten() / tiny['q_weight']).square().mean().item():.4f}  (1 up to eps)")

# %% [markdown]
# Bad inputs raise before anything is written, naming the argument and what was expected. Two
# examples on the `[T, hidden]` rows: a weight of the wrong length, and an odd hidden size:

# %%
rows = dict(tiny, q=tiny["q"].flatten(1), k=tiny["k"].flatten(1))  # [2, 8] each
bad_cases = {
    "q_weight of the wrong length": dict(rows, q_weight=torch.ones(6)),
    "odd k_hidden": dict(rows, k=torch.zeros(2, 5), k_weight=torch.ones(5)),
}
for what, args in bad_cases.items():
    before = args["q"].clone()
    try:
        cookbook.cross_head_norm(**args, backend="reference")
        print(f"{what}: accepted (unexpected)")
    except (ValueError, TypeError) as error:
        print(f"{what}: {type(error).__name__}: {error}")
    assert torch.equal(args["q"], before), "nothing may be written on bad input"

# %% [markdown]
# The rounding modes (`"fused"`, `"hf"`) and tolerances are those of `qk_norm` (notebook 01,
# section 2), over a longer row; `cookbook.testing.agreement` checks them below.
#
# ## 3. The reference
#
# The reference is `qk_norm`'s row arithmetic applied over the whole hidden, q and k each in
# turn. The tested source:

# %%
print(inspect.getsource(contract.rms_norm_rows))
print(inspect.getsource(contract.reference))

# %% [markdown]
# ## 4. Napkin math: how fast can it be?
#
# Every implementation must read q and k once and write them once; the weights are read once per
# launch. The contract's `bytes_moved` is that minimum. On the `meta` device (shapes only, no
# memory), for the benchmark's shapes, divided by the bandwidth of a device-to-device copy (the
# practical ceiling of a memory-bound kernel): measured now on a GPU, or else the copy the
# benchmark measured with its recorded sweep.

# %%
def meta_inputs(tokens, q_hidden, k_hidden, dtype=torch.bfloat16):
    """The op's arguments as meta tensors: shapes and dtypes, no memory."""
    empty = lambda *shape: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    return dict(q=empty(tokens, q_hidden), k=empty(tokens, k_hidden), q_weight=empty(q_hidden), k_weight=empty(k_hidden))


copy_tb_per_s, copy_source = walkthrough.copy_ceiling(OP)
print(f"copy ceiling: {copy_tb_per_s:.2f} TB/s ({copy_source})\n" if copy_tb_per_s else f"no copy ceiling: {copy_source}\n")
print(f"{'(tokens, q_hidden, k_hidden[, layout])':<40} {'MB moved':>9} {'us at the copy ceiling':>23}")
for shape in contract.BENCH_SHAPES:
    moved = contract.bytes_moved(**meta_inputs(*shape[:3]))  # a fourth element names q and k's layout
    at_ceiling = f"{moved / (copy_tb_per_s * 1e12) * 1e6:.3f}" if copy_tb_per_s else "-"
    print(f"{str(shape):<40} {moved / 1e6:9.3f} {at_ceiling:>23}")

# %% [markdown]
# At one token the bytes take nanoseconds, far below a kernel launch: latency and launch count
# decide. From a few hundred tokens on, the op is a bandwidth problem. The eager reference moves
# far more than this minimum (float32 intermediates through memory, several kernels per tensor,
# as notebook 01 section 5 counts); a fused kernel reads each row once and writes it once.
#
# ## 5. The Numba kernel
#
# One block per (token, tensor): `blockIdx.x` is the token, `blockIdx.y` picks q or k, so rows of
# different widths share one launch. Threads stride over the row (coalesced; `threads_for` sizes
# the block in whole warps), a block-wide sum gives every thread the row's sum of squares, a
# second pass writes. The module docstring and the kernel factory, from the source:

# %%
import kernels_numba.cross_head_norm as numba_cross_head_norm

print(numba_cross_head_norm.__doc__)
print(inspect.getsource(numba_cross_head_norm.make_cross_head_norm_kernel))

# %% [markdown]
# v1 moves one 2-byte element per load and per store. **numba_v2** keeps the kernel's shape and
# moves bf16 two columns at a time: the row is viewed as int32 words, `bf16x2_decode` splits a
# word into two float32 (a bf16 is the top half of a float32, so this is two shifts and masks)
# and `bf16x2_encode` rounds two results into one word (one `cvt.rn.bf16x2.f32` on a GPU). The
# rounding order is fixed when the kernel is built, so no branch runs per element. Its second
# pass, from the source:

# %%
print(inspect.getsource(numba_cross_head_norm.make_write_row_words))

# %% [markdown]
# ## 6. The CUDA C versions, and the flaw each one fixes
#
# The kernels live in the torch-free header `kernels_cuda/cross_head_norm.cuh`. The registry is
# the list of versions; each lead says what changed and which bottleneck it removes, and a test
# keeps the header's `// vN:` lines identical to these leads:

# %%
cuda_versions = registry.implementations(OP, ("cuda",))
for impl in cuda_versions:
    print(f"v{impl.version} ({impl.name}): {impl.lead}")
print(f"\nbackend='cuda' runs the last one: {registry.latest(OP, 'cuda').name}")

# %% [markdown]
# The whole header is long (`kernels_cuda/cross_head_norm.cuh`, each version in a section that
# opens with its lead); here are the kernels the occupancy lesson turns on. v1, one CTA per token
# for q and k together, keeps two sums and both weights live:

# %%
walkthrough.show_kernel(OP, "cuda_v1")

# %% [markdown]
# v2 splits the tensors over `grid.y` (`locate_row` picks q's or k's row from `blockIdx.y`), so a
# CTA keeps one sum and one weight:

# %%
walkthrough.show_kernel(OP, "cuda_v2")

# %% [markdown]
# v3 holds the row in registers as 16-byte vectors, `kVecsPerThread` of them per thread (v5 to
# v14 launch the same kernel with more template flags set: streaming accesses, a programmatic
# launch, the token-major grid, the weights loaded with the row, rows warmed in L2):

# %%
walkthrough.show_kernel(OP, "cuda_v3")

# %% [markdown]
# Reading them in order:
#
# * **v1** is the obvious fusion: one CTA per token does q and k together, in one loop over the
#   wider row. Each thread keeps two sums, two row pointers, both weights' addresses and both
#   widths live, the block reduction carries two values, and the grid has only one CTA per token.
# * **v2** splits the tensors over `grid.y`: a CTA normalizes one row (q or k) with one sum and
#   one weight. Fewer live registers per thread, so more CTAs fit on an SM, and twice as many CTAs
#   to spread over the SMs. Its loops stream any even width at any alignment, so it is also the
#   general path of v3.
# * **v3** holds the row in registers as 16-byte vectors (8 bf16 elements per load), reads x
#   once and writes it once. The block size is derived from the wider row: the fewest vectors per
#   thread (1, 2, 4 or 8) that fit the row in at most 512 threads. That buys one read, but the
#   row now lives in registers, and a wide row costs occupancy, as the next section shows.
# * **v4** keeps a wide row out of the registers altogether, with a Hopper feature: thread 0 asks
#   the copy engine (TMA) for the whole row in one `cp.async.bulk` instruction into shared
#   memory, and an mbarrier in shared memory counts the bytes in; every thread waits on it, then
#   sums and writes from shared memory. The whole row is in flight at once, at 32 registers per
#   thread. It runs only where v3 would need four or more vectors per thread (rows wider than
#   8192 bf16 elements): measured on the H200, the same kernel lost to v3 on narrower rows at
#   large token counts and by about a microsecond at a few tokens, since its copy and barrier
#   wait come before any arithmetic.
# * **v5** reads and writes x by *streaming* accesses in both kernels (`ld/st.global.cs`,
#   evict-first: `LDG/STG.E.EF` in SASS). Every byte of x is touched once; the weights are what
#   the caches should keep. Measured on the H200 it is worth the most where many CTAs stream at
#   once: 8 % at 1024 tokens x 5120/1024, 4 % at 256 tokens x 8192. Its dispatch also moves: v3
#   keeping its row packed made v3's 8-vector kernel faster than v4's bulk copy at the
#   32768-wide row, so v5 runs v3's kernel up to 32768 bf16 elements and the bulk copy only
#   beyond (24.9 us there, against 30.7 for v4 and 27.3 for `torch.compile`).
# * **v6** is v5 launched as a *programmatic dependent launch* (as qk_norm v6): its CTAs become
#   resident while the previous kernel drains and wait in hardware (`griddepcontrol.wait`) for
#   its writes. Worth about half a microsecond a call: 2.19 -> 1.68 us at one token, 6.35 ->
#   5.79 at 256 tokens.
# * **v7** changes only v3's vectors per thread, and only where a call's rows fill every SM's
#   resident CTAs at least once: four-warp CTAs holding up to eight vectors per thread (at 8192
#   bf16: 128 threads x 8 vectors, 59 registers, eight CTAs and 128 KiB of loads in flight per
#   SM, against v6's four 512-thread CTAs and 64 KiB). Below that a call is a single wave, whose
#   length is one thread's serial loads and stores, and v6's shorter threads stay (128 threads x
#   8 vectors took 2.87 us at one token, against 1.68). On the H200: 141.1 -> 138.3 us at 8192 x
#   8192 and 35.3 -> 33.2 us at 4096 x 6144/1024, where v6 had been a hair behind
#   `torch.compile`.
# * **v8** is for narrow rows: a tensor-parallel shard (MiniMax-M2's q and k at TP=8 are 768 and
#   128 wide) or a small model. A CTA per row there is 96 threads that live for a few hundred
#   cycles, and 16384 tokens make 32768 of them: the GPU runs out of CTA launches before it runs
#   out of bandwidth (v7: 40.5 us, 34 % of copy, slower than `torch.compile`'s 23.4). v8 gives
#   each token one warp, which normalizes q's row and then k's with a warp sum and no block
#   barrier, four tokens to a CTA: 19.3 us, 72 % of copy. It holds fewer warps per SM than v7
#   (40 against 63: the occupancy lesson of v2 runs the other way here, since the cost was never
#   the warps). A warp works through its token's vectors one after another, so with few tokens
#   v7's wide CTAs are faster: v8 takes over from 18 tokens per 16-byte vector of a token (a
#   rule fitted to the crossovers measured on the H200; docs/cross_head_norm.md).
# * **v9** changes only the order of v7's CTAs. The block scheduler hands CTAs out in grid order,
#   so the grid's order is the order in which rows stream through DRAM. On the `(tokens, 2)` grid
#   every q row comes before every k row; when q and k are views of one fused qkv tensor
#   `[T, q + k + v]`, the CTAs in flight then read q's 16 KiB of every 48 KiB token row (at
#   8192 / 8192 / 8192), and later k's. v9 launches v7's kernel on a 1-D grid of (token, tensor)
#   pairs, so a token's q and k rows, which sit side by side, stream together: 32 KiB of every
#   48. On the H200: 37.3 -> 36.6 us at 2048 x 8192 (86 -> 87 % of the copy), 33.3 -> 31.3 us at
#   4096 x 6144/1024 (84 -> 89 %), 24.7 -> 22.8 us at 512 x 32768/4096. It does so only where the
#   call is three waves of CTAs or more (at 1.9 waves with unequal widths, the (tokens, 2) grid's
#   long q CTAs first and short k CTAs last balance the SMs better) and where q and k share a
#   token stride wider than their rows; separate packed tensors keep the (tokens, 2) grid.
# * **v10** shortens each CTA's chain in small calls. From v3 on a CTA loads its row, sums, then
#   loads its weights and stores: two memory round trips one after the other. With many waves of
#   CTAs other CTAs' loads fill the wait; at decode sizes, or one or two waves, every CTA's chain
#   is on the call's critical path. v10 issues each thread's weight loads with its row's, before
#   the block sum, and holds the weights in registers to the store, in calls of fewer than three
#   waves and at most 4 vectors per thread, and below one wave only where the extra registers cost
#   no wave. On the H200: 1.68 -> 1.44 us at one token of 8192 / 8192, 2.30 -> 2.05 at 16 tokens,
#   10.95 -> 10.32 us at 1024 x 4096 (73 -> 78 % of the copy); the other shapes are unchanged.
# * **v11** hides the round trip that every CTA after the first wave starts with. In calls of one
#   to three waves on the (tokens, 2) grid, once a CTA's own row loads are issued, its threads
#   prefetch into L2 the row of the CTA one wave of resident CTAs after it in grid order (one
#   `prefetch.global.L2` per 128-byte line), so that CTA finds its row in L2. On the H200: 10.30
#   -> 9.56 us at 1024 x 4096 (77 -> 83 % of the copy, past a same-size `copy_`'s 81 %), 8.94 ->
#   8.61 at 1024 x 5120/1024. Not at three waves or more: there the CTAs in flight keep the DRAM
#   busy alone, and the second request per line cost 1.5 % on an H100.
# * **v12** compiles v9's token-major kernel for its four-warp CTA. v3-v11 stride a thread's
#   vectors by `blockDim.x`, which the compiler only sees at run time; with the block size a
#   template argument, a thread's eight vectors are its first address plus constant offsets (856
#   SASS instructions instead of 880, 13 fewer integer multiply-adds, 58 registers instead of 59:
#   the same 8 CTAs per SM). At 6144/1024 it also launches 128 threads where v7 sized the block to
#   96. On the H200, side by side with v11 (two runs each): 36.7 -> 36.6 us at 2048 x 8192 (87.3
#   -> 87.8 % of the copy), 136.8 -> 135.8 us at 8192 x 8192 (93.8 -> 94.5 %), 31.5 -> 31.1 us at
#   4096 x 6144/1024 (89 -> 90 %). The gain is small: this kernel's time is the DRAM's, and
#   Section 9's sweep shows how far from the copy it still is at 2048 x 8192.
# * **v13** starts each call's reads before the call may run. A programmatic launch's CTAs become
#   resident while the previous kernel's last CTAs run, and until now they waited in
#   `griddepcontrol.wait` with nothing in flight, then the whole first wave asked for its rows at
#   once. In v13 the first CTAs in grid order (2 MiB of rows) issue one `prefetch.global.L2` per
#   line of their own row before the wait: a hint that returns nothing, so it cannot read stale
#   data whoever writes x, but the bytes are on their way while the previous kernel drains. Only
#   in calls of a wave or more that move at most 192 MiB: on the H200, more than a few MiB of
#   prefetches competed with the previous call's last reads, and the larger calls lost at any
#   budget. Side by side with v12: 70.3 -> 77.2 % of the copy at 1024 x 5120/1024, 85.4 -> 87.3 %
#   at 1024 x 4096, 87.9 -> 88.7 % at 2048 x 8192, 90.4 -> 91.2 % at 4096 x 6144/1024.
# * **v14** gives part of v7 back. v7's four-warp CTAs of eight vectors per thread keep 128 KiB of
#   rows in flight per SM, twice v3's 512-thread CTAs of two vectors, and that won at many waves on
#   the fused layout. In calls of one to a few waves it loses: every CTA of a wave asks for its
#   whole row at once and can store nothing before it is back, so a wave's reads and then its
#   writes come in bursts, twice as long at 128 KiB per SM. v14 launches v3's CTA again (with
#   v13's warm, without v11's warm-ahead) on the (tokens, 2) grid for rows of 4097 to 8192 bf16
#   elements with q and k within 2x of each other in width: at a k row a sixth of q's, most of a
#   k CTA's threads would idle (GQA 6144/1024 lost 5-7 points that way), so GQA keeps v13's
#   kernels, as does v9's token-major grid. On the H200, side by side with v13 (two runs each, %
#   of the copy): 1536 x 8192 74.5 -> 84.8 fused and 75.0 -> 90.4 on separate q and k tensors,
#   1024 x 8192 77 -> 83 and 76 -> 88, 2048 x 8192 on separate tensors 89.2 -> 91.8; unchanged at
#   8192 x 8192, 1024 x 4096 and the GQA shapes.
#
# ## 7. What the compiler says: registers, and the occupancy they allow
#
# `nvcc` alone (no GPU) compiles every kernel of the header; `ptxas -v` reports registers, spills
# and shared memory per instantiation. Registers per thread, threads per CTA and shared memory
# per CTA bound how many CTAs an SM holds at once (theoretical occupancy: resident warps out of
# 64 on sm_90). `tools/docs_versions.py` computes it for the kernel each launcher picks at each
# benchmark row width (the same table is on the docs page):

# %%
sys.path.insert(0, str(session.root / "tools"))
import docs_versions  # noqa: E402

if nvcc_report.nvcc() is None:
    print("nvcc is not on PATH: skipping the compiler's resource report (CI and GPU machines have it).")
else:
    print(f"bf16 kernels, fused rounding, {nvcc_report.DEFAULT_ARCH}:\n")
    # From the mangled names, which read the same whatever demangler a machine has:
    # cross_head_norm_v3_kernelI13__nv_bfloat16Li8ELb0ELb1ELb1ELb0ELb0EE is v3<bf16, 8 vectors per
    # thread, fused rounding, streaming x, programmatic launch, (tokens, 2) grid, weights loaded
    # after the block sum, no row warmed ahead> (an instance v6 and v7 launch); v9's instances on
    # the (token, tensor) grid (fifth flag 1) have the same registers and are left out; v10's
    # instances with the weights loaded with the row (sixth flag 1), v11's that warm the row a
    # wave ahead (seventh flag 1) and v13's that warm their own row before the wait (the flag after
    # the block size) are listed.
    bf16_fused = re.compile(r"cross_head_norm_v(\d+)_kernelI13__nv_bfloat16(?:Li(\d+)E)?Lb0E(?:Lb([01])E)?(?:Lb([01])E)?"
                            r"(?:Lb([01])E)?(?:Lb([01])E)?(?:Lb([01])E)?(?:Li\d+E)?(?:Lb([01])E)?")
    found = sorted(((int(m.group(1)), int(m.group(2) or 0), m.group(3) == "1", m.group(4) == "1", m.group(6) == "1",
                     m.group(7) == "1", m.group(8) == "1"), k.registers, k.spill_bytes)
                   for k in nvcc_report.compile_header(OP) if (m := bf16_fused.search(k.mangled)) and m.group(5) != "1")
    print("| kernel | vectors per thread (v8: per lane) | streaming x (v5 on) | programmatic (v6 on) "
          "| weights with the row (v10) | row a wave ahead warmed (v11) | own row warmed before the wait (v13) "
          "| registers | spill bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    yes_no = {True: "yes", False: "no"}
    for (version, vecs, streaming, programmatic, held, ahead, own), registers, spill_bytes in found:
        if version == 8:  # v8's warp-per-token kernel always streams and launches programmatically
            streaming = programmatic = True
        print(f"| v{version} | {vecs or '-'} | {yes_no[streaming]} | {yes_no[programmatic]} | {yes_no[held]} "
              f"| {yes_no[ahead]} | {yes_no[own]} | {registers} | {spill_bytes} |")

# %% [markdown]
# From those registers, each launcher's block size and shared memory, the theoretical occupancy
# of the kernel each version picks at each benchmark row width:

# %%
if nvcc_report.nvcc() is not None:
    print(docs_versions.occupancy_table(OP))

# %% [markdown]
# Theoretical occupancy is what the resources allow, not what a run achieves: the tail of a
# grid, a grid smaller than the SMs can hold (one token: two CTAs), and stalls at the barriers
# of the block reduction all lower the achieved figure, which Nsight Compute reads from the
# hardware counters. `python -m cookbook.ncu --op cross_head_norm --shape 5` profiles one call of
# every CUDA C version at 2048 tokens x 8192 and records the pages linked here (it needs a GPU
# and `ncu`; their tables of achieved occupancy, DRAM throughput and stall reasons per version
# are what the next paragraph reads):

# %%
ncu_pages = walkthrough.results_pages(OP, "ncu")
for page in ncu_pages:
    walkthrough.results_link(page)
if not ncu_pages:
    print("no Nsight Compute page recorded yet: run `python -m cookbook.ncu --op cross_head_norm --shape 5 "
          "--results-dir docs/results` on a GPU")

# %% [markdown]
# The split over `grid.y` shows in the achieved column as well as in the theoretical one: v2
# keeps nearly every warp slot filled where v1 fills about three quarters, and it finishes
# sooner. v3 holds fewer warps than v2 and is faster still: a thread keeps its vectors of the row
# in registers, so the row is read once and each warp has more bytes in flight; the
# `long_scoreboard` stall (a warp waiting on global memory) drops. Occupancy is a means to bytes
# in flight, not the goal.
#
# The table is the occupancy lesson. v1's two live rows cost it registers (38 vs v2's 29) and a
# quarter of the SM's warps. v3's row in registers is cheap for rows up to 4096 elements (one
# vector per thread), but the widest row of the sweep, q_hidden 32768, needs 8 vectors per thread:
# 64 registers even with the row kept packed, two 512-thread CTAs per SM, half the warps. v4
# stages such rows in shared memory instead (one bulk copy per row); with the packed row v3 beats
# that, so v5 keeps v3's kernel up to its eight-vector limit. The k rows of that launch (4096
# wide) run in the same wide kernel, with most of their threads idle.
#
# ## 8. Does every implementation agree with the contract?
#
# We iterate the registry: every implementation that can run here is run on fresh inputs (q and
# k as column slices of one fused qkv tensor, unequal widths), in float32 and bf16, both rounding
# orders and `weight_offset=1.0`, and checked against the float64 value (fused) or the HF-order
# reference (hf). Skipped implementations say why. Without a GPU the shapes are tiny: every
# simulated GPU thread is a Python thread.

# %%
AGREE_SHAPES = [(1, 8192, 8192), (129, 6144, 1024), (7, 32768, 4096), (5, 1000, 250)]  # 1000/250: v2's general path
walkthrough.agreement_table(OP, AGREE_SHAPES if session.on_gpu else contract.SIM_SHAPES[:1])

# %% [markdown]
# ## 9. Side by side
#
# Every implementation at the benchmark's first, middle and last shapes: on a GPU timed now by
# the benchmark's own machinery (`cookbook.bench`: agreement first, then CUDA-graph replay over
# rotating input sets, percent of a device-to-device copy measured in the same run), else read
# from the sweep the benchmark recorded in `docs/results/`. Then the recorded full sweep against
# tokens (`python -m cookbook bench --ops cross_head_norm --results-dir docs/results` on a GPU
# writes it, with the GPU, date, commit and command on the page).

# %%
QUICK = bench.select_shapes(contract.BENCH_SHAPES, "quick")
measured = walkthrough.measure_or_recall(OP, [impl.name for impl in registry.implementations(OP)], QUICK)
walkthrough.timing_table(measured)

# %%
walkthrough.show_sweep(OP)

# %% [markdown]
# In the plot above (when there is one) we can see the two regimes of the napkin math. At one
# token every implementation is far below the copy line: two CTAs cannot fill a GPU, and the
# time is launch and latency, where v3's single read and small block win. At thousands of tokens
# the versions line up as the resource table predicts: v2 ahead of v1 (more resident CTAs, twice
# as many CTAs), v3 ahead of both (one read, 16-byte loads), v4 equal to v3 up to 8192 and
# behind it at the 32768-wide q row (its bulk copy into shared memory loses to v3's packed
# 8-vector kernel there), and v5 (streaming accesses, v3's kernel up to 32768) a few per cent
# ahead of both, 10 % at the widest row. v6 takes about half a microsecond off every call (the
# launch gap), and v7 pulls ahead where the batch fills the GPU many times over (8192 x 8192, the
# GQA shape, 1024 x 4096). At the two narrow shapes (16384 x 768/128, 8192 x 2048/256) v7 falls
# behind `torch.compile` and v8's warp per token is ahead of both. v9 is v8 except at the wide
# shapes of three waves or more, where pairing a token's q and k CTAs gains 2-8 %; v10 is v9
# except at one and 16 tokens and at 1024 x 4096, where loading the weights with the row takes
# 6-15 % off; v11 is v10 except at 1024 x 4096 and 1024 x 5120/1024, where warming the next
# wave's rows takes another 4-7 % off; v12 is v11 except at the fused shapes of three waves or
# more, where its compile-time block takes 0.3-1.5 % off; v13 is v12 except at the calls of a wave
# or more up to 192 MiB (1024 x 4096, 2048 x 8192, 4096 x 6144/1024, 1024 x 5120/1024 and 512 x
# 32768/4096), where warming the first 2 MiB of rows before the wait takes 0.6-9 % off; v14 is
# v13 except at 1536 x 8192 and at 2048 x 8192 on separate tensors, where v3's 512-thread CTA
# takes 3-12 % off.
# The table above the plot gives, per shape, each implementation's time and share of the copy,
# the eager PyTorch reference and `torch.compile` among them.
#
# ## Where to go next
#
# * [`docs/cross_head_norm.md`](../docs/cross_head_norm.md): the op page (contract, versions,
#   occupancy, results, caveats); the recorded sweep
#   [`docs/results/cross_head_norm_h200.md`](../docs/results/cross_head_norm_h200.md).
# * `python -m cookbook bench --ops cross_head_norm` on a GPU: the full sweep, with CSV/JSON and plots.
# * `python -m pytest tests/test_cross_head_norm.py`: the property tests and negative controls.
