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
# The second op, in the order of notebook 01: why it exists, its math, the napkin math, the Numba
# kernel, then a **ladder** of seven standalone CUDA C kernels up to the tuned kernel and the
# question "which kernel runs for my call?". The lesson of this op is **occupancy**: a row is
# thousands of elements, so a CTA owns a row, and what each thread keeps live decides how many
# CTAs an SM holds at once. Every number is computed here or read from a recorded results page.
#
# It runs on a laptop: without a GPU the Numba kernels run under Numba's CUDA simulator on tiny
# shapes and the timings come from the recorded pages. Run the first cell first (it switches the
# simulator on before anything imports Numba). Terms in *italics* are in the
# [glossary](../docs/cross_head_norm.md#glossary).

# %%
import sys
from pathlib import Path

# Run from a checkout (e.g. `notebooks/`): make its packages importable, whether installed or not.
ROOT = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "cookbook" / "walkthrough.py").is_file()), None)
if ROOT is not None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cookbook import walkthrough  # imports neither Numba nor a CUDA extension

session = walkthrough.setup("cross_head_norm")  # without a GPU: NUMBA_ENABLE_CUDASIM=1, before anything imports Numba

# %%
import torch

import cookbook
from cookbook import figures, registry
from cookbook.testing import agreement

OP = "cross_head_norm"
contract = registry.contract(OP)  # the contract module cookbook/ops/cross_head_norm.py
EPS = 1e-6

# %% [markdown]
# ## 1. Normalizing q and k over all heads at once
#
# `qk_norm` normalizes each head. OLMo2, Wan, LTX and MiniMax take the statistic over a token's
# **whole** q row (`heads * head_dim` elements) before the projection output is split into heads
# ([which rounding does my model use](../docs/models.md)). Hugging Face's OLMo2 attention, in essence:
#
# ```python
# q = self.q_norm(self.q_proj(x))          # RMSNorm over q_hidden = heads * head_dim
# k = self.k_norm(self.k_proj(x))          # k_hidden = kv_heads * head_dim (smaller with GQA)
# q, k = q.view(*tokens, -1, head_dim), k.view(*tokens, -1, head_dim)
# ```
#
# In an engine q and k are column slices of one fused qkv tensor, and with grouped-query
# attention their rows have **different widths** (MiniMax-M2: 6144 and 1024).
#
# ## 2. The math, and the per-head mistake
#
# Per token row `x`, accumulated in float32: `y = x * rsqrt(mean(x^2 over the row) + eps) * (w +
# weight_offset)`, rounded as qk_norm's two orders say. The classic mistake is a per-head
# statistic; on 2 tokens of 2 heads x 4, the reference against a per-head norm of the same views,
# both checked against the contract:

# %%
tiny = contract.make_inputs(2, 8, 8, torch.float32, "cpu", seed=0, head_dim=4)  # [2, 2 heads, 4]
cross = {name: t.clone() for name, t in tiny.items()}
cookbook.cross_head_norm(**cross, eps=EPS, backend="reference")
per_head = {name: t.clone() for name, t in tiny.items()}
for name in ("q", "k"):  # the same views, one statistic per head
    x = per_head[name].double()
    per_head[name] = (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * tiny[f"{name}_weight"].view(2, 4)).float()
exact, _ = contract.expected(tiny, EPS, 0.0, "fused")["q"]
tol = contract.TOLERANCES[torch.float32]
for name, out in (("cross-head reference", cross["q"]), ("per-head norm", per_head["q"])):
    print(f"{name:<20} {'PASS' if agreement('q', out, exact, None, 'fused', tol).ok else 'REJECT'} "
          f"(token 0, head 0: {', '.join(f'{v:.4f}' for v in out[0, 0].tolist())})")

# %% [markdown]
# ## 3. Napkin math: how fast can it be?
#
# A kernel must read q and k once and write them once (`bytes_moved`). Divided by a
# device-to-device copy's bandwidth (the ceiling of a memory-bound kernel: measured now on a GPU,
# or recorded with the sweep), at every bench shape:

# %%
copy_tb_per_s, copy_source = walkthrough.copy_ceiling(OP)
print(f"copy ceiling: {copy_tb_per_s:.2f} TB/s ({copy_source})" if copy_tb_per_s else f"no copy ceiling: {copy_source}")
for shape in contract.BENCH_SHAPES:
    t, q_hidden, k_hidden, *layout = shape
    empty = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="meta")  # noqa: E731
    moved = contract.bytes_moved(empty(t, q_hidden), empty(t, k_hidden), empty(q_hidden), empty(k_hidden))
    at_ceiling = f"{moved / (copy_tb_per_s * 1e12) * 1e6:8.2f} us" if copy_tb_per_s else ""
    print(f"{str(shape):<38} {moved / 1e6:9.2f} MB {at_ceiling}")

# %% [markdown]
# From a few hundred tokens the op is a bandwidth problem; at one token the bytes take
# nanoseconds, and the time is a launch and a chain of DRAM round trips. The eager reference runs
# several kernels with float32 intermediates through memory (notebook 01, section 4); every
# kernel below reads a row once (from rung 3 on) and writes it once, q and k in one launch.
#
# ## 4. The Numba kernel, and the block sum
#
# One block per (token, tensor): threads stride over the row, a **block-wide** sum of squares
# (a warp sum per warp, the warps' partials through shared memory), then a second pass writes. q
# and k are two rows of the grid's `blockIdx.y`, the split rung 2 makes in CUDA C:

# %%
walkthrough.excerpt("kernels_numba/cross_head_norm.py", "def make_cross_head_norm_kernel(act, q_weight, k_weight)",
                    "return cross_head_norm_kernel", max_lines=24)
numba_v1 = registry.get(OP, "numba_v1")
run = {name: t.clone().to(session.device) for name, t in tiny.items()}
args = contract.check_inputs(**run, eps=EPS, weight_offset=0.0, rounding="fused")
numba_v1.fn(args.q, args.k, args.q_weight, args.k_weight, args.eps, args.weight_offset, args.rounding)
print(f"numba_v1 on {session.device}: " + agreement("q", run["q"].cpu(), exact, None, "fused", tol).message)

# %% [markdown]
# ## 5. The helpers every CUDA C rung is built from
#
# Besides notebook 01's (16-byte vectors, `pack`/`unpack`, `warp_sum`, `rstd_from`), the rungs of
# this op share two: `block_sum` (include/common.cuh) and a thread's share of a row as vectors
# held in registers, `load_row_vectors` (cross_head_norm/rows.cuh; `store_row_vectors` writes them
# back the same way):

# %%
walkthrough.excerpt("kernels_cuda/include/common.cuh", "template <int kValues>", "__device__ __forceinline__ float block_sum(float v)")
walkthrough.excerpt("kernels_cuda/cross_head_norm/rows.cuh", "template <typename T, int kVecs, bool kStreaming>",
                    "// The same vectors normalized")

# %% [markdown]
# ## 6. The ladder: seven CUDA C kernels
#
# `kernels_cuda/cross_head_norm/`: one standalone file per rung, each its own small extension. A
# file's first line is its lead (the registry repeats it), and the diff from rung n-1 to rung n
# shows only what the lead says. Each is timed at three shapes (one token; 2048 x 8192; the narrow
# rows 16384 x 768/128) by the benchmark's machinery, or recalled from the recorded sweep.

# %%
LADDER = registry.implementations(OP, ("cuda",))
for impl in [*LADDER, registry.get(OP, "cuda_tuned")]:
    print(f"{impl.name:<11} {impl.lead}")
HEADLINE = [(1, 8192, 8192), (2048, 8192, 8192), (16384, 768, 128)]
measured = walkthrough.measure_or_recall(OP, [impl.name for impl in registry.implementations(OP)], HEADLINE)

# %% [markdown]
# ### Rung 1: one CTA per token
#
# A CTA takes its token's q row and k row in one loop: two sums of squares, both rows' pointers
# and widths and both weights live in every thread, a two-value block reduction, a second pass.

# %%
walkthrough.show_kernel(OP, "cuda_v1")
walkthrough.effect(measured, "reference", "cuda_v1")

# %% [markdown]
# ### Rung 2: q and k on `grid.y`, the occupancy lesson
#
# The same loop over one row: `blockIdx.y` picks q or k. A thread keeps half of rung 1's state,
# and the registers are what bound rung 1's CTAs per SM: 64K registers per SM, allocated per warp
# in units of 256, at most 64 warps. From nvcc's report and that arithmetic, at 256 threads:

# %%
walkthrough.show_kernel(OP, "cuda_v2")
try:
    rows, _ = walkthrough.register_rows(OP, ["cuda_v1", "cuda_v2"], lambda k: "__nv_bfloat16, (cookbook::Rounding)0>" in k.kernel)
except RuntimeError as error:  # nvcc is needed for the report
    rows = []
    print(f"no resource report here: {error}")
for name, kernel, registers, _, warps in rows:
    ctas = warps // (256 // walkthrough.WARP_SIZE)  # whole CTAs of 8 warps
    print(f"{name}: {registers} registers -> {ctas} CTAs of 256 threads per SM = {ctas * 8} of 64 warps "
          f"({ctas * 8 / 64:.0%} theoretical occupancy)")
walkthrough.effect(measured, "cuda_v1", "cuda_v2")

# %% [markdown]
# More resident warps keep more loads in flight while others wait on DRAM; Nsight Compute's
# *achieved* occupancy of every rung is in the page's ladder table. Occupancy is a means: the
# later rungs trade some of it for bytes in flight per thread.
#
# ### Rung 3: 16-byte vectors held in registers
#
# Thread `t` holds vectors `t, t + blockDim.x, ...` of the row, packed, across the block sum; the
# block is the fewest vectors per thread (1, 2, 4, 8) that fit the wider row in 512 threads. x is
# read once, in the widest loads there are. Rows off the 16-byte path take rung 2.

# %%
walkthrough.show_kernel(OP, "cuda_v3")
walkthrough.effect(measured, "cuda_v2", "cuda_v3")

# %% [markdown]
# ### Rungs 4 and 5: streaming accesses, a programmatic launch
#
# Each byte of x is touched once: rung 4 loads and stores it evict-first. Rung 5 is a
# *programmatic launch*: its CTAs become resident while the previous kernel drains and wait in
# hardware for its writes. The diffs, code only:

# %%
walkthrough.diff_rungs(OP, 4, code_only=True)
walkthrough.diff_rungs(OP, 5, code_only=True)
figures.programmatic_launch();
walkthrough.effect(measured, "cuda_v3", "cuda_v5")

# %% [markdown]
# ### Rung 6: the weights with the row
#
# Rungs 3-5 load a vector's weight after the block sum: a DRAM round trip on every CTA's critical
# path. Rung 6 issues the weight loads just before the row's and holds them through the sum. It
# costs registers (fewer resident CTAs), which a call of many waves feels.

# %%
walkthrough.diff_rungs(OP, 6, code_only=True)
walkthrough.effect(measured, "cuda_v5", "cuda_v6")

# %% [markdown]
# ### Rung 7: a warp per token at narrow rows
#
# At 768 + 128 bf16 a CTA lives a few hundred cycles, and the SMs run out of CTA launches before
# the bytes run out of bandwidth. Rung 7 gives a token one warp, its q row then its k row, four
# tokens per CTA and no block barrier; wider rows run rung 6.

# %%
walkthrough.show_kernel(OP, "cuda_v7")
walkthrough.effect(measured, "cuda_v6", "cuda_v7")

# %% [markdown]
# ## 7. The tuned kernel, and which kernel runs for a call
#
# `tuned.cuh` is rung 6's CTA per row with four choices as template arguments, made per call by
# `plan` in `policy.h` from the call's size in *waves* of four-warp CTAs: rung 6's 512-thread CTA
# below a wave, four warps of up to eight vectors per thread from there (more bytes in flight, less
# occupancy), the weights held only below three waves, the first rows and the next wave *warmed*
# into L2, and for q and k views of one tensor at three waves or more a token-major grid:

# %%
figures.grid_orders();

# %% [markdown]
# The same plan sends narrow rows at many tokens to rung 7's kernel and rows past the registers to
# a row staged in shared memory. `cookbook.explain` runs that policy (on a GPU through the
# launcher, without one compiled for the host) and says what a call gets:

# %%
for shape in ((1, 8192, 8192), (2048, 8192, 8192)):
    try:
        print(cookbook.explain(OP, shape=shape), end="\n\n")
    except RuntimeError as error:  # without a GPU the host policy needs nvcc
        print(f"explain {shape}: {error}")
walkthrough.effect(measured, "cuda_v7", "cuda_tuned")

# %% [markdown]
# ## 8. Does every implementation agree with the contract?
#
# Every implementation that runs here, on fresh inputs (q and k as views into one fused qkv
# tensor), float32 and bf16, both rounding orders and `weight_offset=1.0`, checked against the
# float64 value (fused) or the HF-order reference (hf). On a GPU: GQA widths, a width off the
# 16-byte path (rung 2's kernel) and narrow rows at many tokens.

# %%
AGREE_SHAPES = [(129, 4096, 1024), (7, 1030, 66), (2100, 256, 64)] if session.on_gpu else contract.SIM_SHAPES[:1]
walkthrough.agreement_table(OP, AGREE_SHAPES)

# %% [markdown]
# ## 9. Side by side
#
# The recorded sweep of every bench shape, every implementation and `torch.compile` (`python -m
# cookbook bench --ops cross_head_norm --results-dir docs/results` writes it):

# %%
walkthrough.show_sweep(OP)

# %% [markdown]
# At few tokens the time is launches and latency, so one launch and a short chain of round trips
# win; as tokens grow the fused kernels climb towards the copy line, and the eager reference
# stays far below it.
#
# ## Where to go next
#
# * [`docs/cross_head_norm.md`](../docs/cross_head_norm.md): the tuned kernel's choices and their
#   measurements, results, pitfalls, tried and dropped, the glossary.
# * [`03_tp_qk_norm`](03_tp_qk_norm.ipynb): the same norm over tensor-parallel shards.
# * `python -m cookbook explain cross_head_norm --shape 1024,5120,1024`: the kernel of any call.
