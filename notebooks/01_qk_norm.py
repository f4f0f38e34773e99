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
# # `qk_norm`: per-head RMSNorm of q and k, from the math to a tuned CUDA kernel
#
# This notebook walks one op through every level of the cookbook, in the order of the Triton
# tutorials: why the op exists, its math and precision contract, the PyTorch reference, the
# napkin math that says how fast it *can* be, why fusing wins, the Numba kernel, and then a
# **ladder** of six CUDA C kernels, each a small standalone file that fixes one named bottleneck
# of the one below it, up to the tuned production kernel. For every rung we read its one-line
# lead, the diff against the rung below (nothing else changes), and what that diff buys on a
# GPU. Then the compiler's register report, an agreement check of every implementation, and the
# side-by-side timing.
#
# It runs top to bottom on a laptop: without a GPU the Numba kernels run under Numba's CUDA
# simulator on tiny shapes, and the timing cells show what the benchmark recorded on a GPU
# (`docs/results/`) instead of measuring. Every number printed below is computed here or read
# from a recorded results page (which says which GPU, when and at which commit); the code shown
# is read from the tested sources, never pasted.
#
# **The first cell matters.** Numba reads `NUMBA_ENABLE_CUDASIM` once, when it is first
# imported, and `kernels_numba` picks its helpers (shared-memory instead of warp-shuffle
# reductions, NumPy bit casts instead of libdevice) at import too. So on a machine without a GPU
# the simulator must be switched on *before anything imports Numba*; setting it later does
# nothing (and `kernels_numba.helpers` refuses to run with a mismatched setting).
# `walkthrough.setup()` does that, and leaves an explicit choice of yours alone. The helpers of
# `cookbook/walkthrough.py` are what every notebook here shares: setup, agreement tables,
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
import time

import torch

import cookbook
from cookbook import registry
from cookbook.testing import agreement

OP = "qk_norm"
contract = registry.contract(OP)  # the contract module cookbook/ops/qk_norm.py
EPS = 1e-6
torch.set_printoptions(precision=6, linewidth=120)

# %% [markdown]
# ## 1. Motivation: where per-head QK norm sits in attention
#
# Qwen3 and Gemma3 (and OLMo-style models) normalize the queries and keys **per head** before
# the rotary embedding, which keeps attention logits from growing without bound in long
# training runs. In Hugging Face's Qwen3 attention the forward pass reads, in essence:
#
# ```python
# q = self.q_norm(self.q_proj(x).view(*tokens, -1, head_dim))   # RMSNorm over head_dim, weight [head_dim]
# k = self.k_norm(self.k_proj(x).view(*tokens, -1, head_dim))
# q, k = apply_rotary_pos_emb(q, k, cos, sin)
# out = attention(q, k, v)
# ```
#
# Gemma3 does the same with its `(1 + w)` weight convention (our `weight_offset=1.0`). In an
# inference engine the q, k and v projections are one GEMM, so q and k arrive as **strided
# views into one fused qkv tensor** `[T, (Hq + 2*Hk) * head_dim]`; the norm runs in place on
# those views, for every layer and every step. With grouped-query attention there are fewer kv
# heads than q heads (Qwen3-32B: 64 q heads, 8 kv heads, head_dim 128: the shape we time).
#
# The op does almost no arithmetic: it is a pass over memory. Its cost is bytes and launches,
# which is what the rest of this notebook is about.

# %% [markdown]
# ## 2. The math and the precision contract
#
# Per (token, head) row `x` of length `head_dim`, accumulated in float32:
# `y = x * rsqrt(mean(x^2) + eps) * (w + weight_offset)`. The contract module says exactly where
# the rounding happens (its docstring, printed from the source):

# %%
print(contract.__doc__)

# %% [markdown]
# The two rounding orders differ by about one ulp in a large share of bf16 elements, and that
# difference is the most reported accuracy bug of this op ("my kernel disagrees with Hugging
# Face"). A tiny bf16 example makes it concrete: the same inputs through both orders.

# %%
tiny = contract.make_inputs(4, 2, 1, 16, torch.bfloat16, "cpu", seed=0)  # 4 tokens, 2 q heads, 1 kv head, head_dim 16
outputs = {}
for rounding in ("fused", "hf"):
    run = {name: t.clone() for name, t in tiny.items()}
    cookbook.qk_norm(**run, eps=EPS, rounding=rounding, backend="reference")
    outputs[rounding] = run["q"]

differ = outputs["fused"] != outputs["hf"]
print(f"q elements that differ between the two orders: {int(differ.sum())} of {differ.numel()}")

# One differing element, step by step (float64 for the exact value).
t, h, d = (int(i) for i in differ.nonzero()[0])
x = tiny["q"][t, h].double()
rstd = torch.rsqrt(x.square().mean() + EPS)
w = tiny["q_weight"][d].double()
print(f"element q[{t}, {h}, {d}]: x = {x[d].item():.6g}, rstd = {rstd.item():.6g}, w = {w.item():.6g}")
print(f"  exact x * rstd * w               = {(x[d] * rstd * w).item():.8g}")
print(f"  fused: round once                = {outputs['fused'][t, h, d].item():.8g}")
print(f"  hf:    round(x * rstd) first     = {(x[d] * rstd).to(torch.bfloat16).item():.8g}")
print(f"         then round(that * w)      = {outputs['hf'][t, h, d].item():.8g}")

# %% [markdown]
# `cookbook.testing.agreement` is the check every test, the benchmark and this notebook use. It
# is tight enough to tell the two orders apart: a fused result must be within about half an ulp
# of the exact value, an HF-order result must be bit-identical to the HF-order reference in at
# least 99 % of the elements. Each output checked against each contract:

# %%
expected = {rounding: contract.expected(tiny, EPS, 0.0, rounding)["q"] for rounding in ("fused", "hf")}
tol = contract.TOLERANCES[torch.bfloat16]
for produced in ("fused", "hf"):
    for claimed in ("fused", "hf"):
        exact, hf_reference = expected[claimed]
        verdict = agreement(f"{produced} output vs {claimed} contract", outputs[produced], exact, hf_reference, claimed, tol)
        print(("PASS  " if verdict.ok else "REJECT") + f"  {verdict.message}")

# %% [markdown]
# Each output passes its own contract and is rejected by the other one: the checks can fail,
# so they mean something.
#
# ## 3. The reference
#
# The reference is the math in readable PyTorch and the oracle of every test (it also runs in
# float64). From the tested source:

# %%
walkthrough.excerpt("cookbook/ops/qk_norm.py", "def rms_norm_rows", "def expected")

# %% [markdown]
# ## 4. Napkin math: how fast can it be?
#
# Every implementation must read q and k once and write them once; the weights are read once per
# launch. The contract's `bytes_moved` is that minimum. We take the benchmark's shapes on the
# `meta` device (shapes and dtypes only, no memory) and divide by the bandwidth of a
# device-to-device copy, the practical ceiling of a memory-bound kernel: measured now on a GPU,
# or else the copy the benchmark measured with its recorded sweep.

# %%
def meta_inputs(tokens, q_heads, kv_heads, head_dim, dtype=torch.bfloat16):
    """The op's arguments as meta tensors: shapes and dtypes, no memory."""
    empty = lambda *shape: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    return dict(q=empty(tokens, q_heads, head_dim), k=empty(tokens, kv_heads, head_dim),
                q_weight=empty(head_dim), k_weight=empty(head_dim))


copy_tb_per_s, copy_source = walkthrough.copy_ceiling(OP)
print(f"copy ceiling: {copy_tb_per_s:.2f} TB/s ({copy_source})\n" if copy_tb_per_s else f"no copy ceiling: {copy_source}\n")
print(f"{'(tokens, q heads, kv heads, head_dim)':<40} {'MB moved':>9} {'us at the copy ceiling':>23}")
for shape in contract.BENCH_SHAPES:
    moved = contract.bytes_moved(**meta_inputs(*shape))
    at_ceiling = f"{moved / (copy_tb_per_s * 1e12) * 1e6:.3f}" if copy_tb_per_s else "-"
    print(f"{str(shape):<40} {moved / 1e6:9.3f} {at_ceiling:>23}")

# %% [markdown]
# At 8192 tokens the op is a bandwidth problem: a kernel that reaches the copy bandwidth takes
# tens of microseconds. At one token the bytes take nanoseconds, far below the few microseconds
# a kernel launch costs, so there the time is launch overhead and latency: fewer launches, and
# a shorter chain of dependent memory accesses, win.
#
# ## 5. Why fusion wins
#
# The eager reference is not one kernel. We can watch what it dispatches: a
# `TorchDispatchMode` logs every ATen op the reference runs on the same meta tensors, and a
# simple model charges each op the bytes of its tensor arguments read plus its new result written
# (on a GPU each of these ops is roughly one kernel launch).

# %%
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def nbytes(t):
    return t.numel() * t.element_size()


class OpLog(TorchDispatchMode):
    """Records (op, bytes read, bytes written) of every ATen op dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and not any(t is i for i in ins)]
        self.ops.append((func.overloadpacket.__name__, sum(map(nbytes, ins)), sum(map(nbytes, outs))))
        return out


BIG = (8192, 64, 8, 128)
big_bytes = contract.bytes_moved(**meta_inputs(*BIG))
big = contract.check_inputs(**meta_inputs(*BIG), eps=EPS, weight_offset=0.0, rounding="fused")
with OpLog() as log:
    contract.reference(big.q, big.k, big.q_weight, big.k_weight, big.eps, big.weight_offset, big.rounding)

print(f"{'ATen op':<12} {'MB read':>9} {'MB written':>11}")
for name, read, written in log.ops:
    print(f"{name:<12} {read / 1e6:9.1f} {written / 1e6:11.1f}")
eager_bytes = sum(read + written for _, read, written in log.ops)
print(f"\neager reference at {BIG}: {len(log.ops)} ATen ops for q and k together, {eager_bytes / 1e6:.0f} MB moved "
      f"= {eager_bytes / big_bytes:.1f}x the fused minimum of {big_bytes / 1e6:.0f} MB")

# %% [markdown]
# The float32 intermediates (`x.to(float32)`, `x^2`, `x * rstd`, `... * w`) are each as large as
# the activations, twice over because float32 is twice as wide as bf16, and each goes through
# memory. A fused kernel keeps them in registers: it reads each row once, reduces it across the
# lanes that hold it, and writes the result once, so its floor is the `bytes_moved` line above,
# and q and k share one launch. `torch.compile` fuses too (it is the peer we measure against);
# the CUDA C kernels below try to beat it by reaching the copy bandwidth and by being cheaper to
# launch at small token counts.
#
# ## 6. The Numba kernel
#
# The Numba kernel is the same algorithm as a real GPU kernel, written in Python: one warp per
# (token, head) row, q and k rows numbered one after the other so both tensors go in one launch.
# Lane `l` reads elements `l, l + 32, ...`, so the warp's 32 loads are neighbours in memory
# (coalesced); a warp-level sum gives every lane the row's sum of squares; a second pass writes.
# The kernel factory of `numba_v1`, from the source:

# %%
walkthrough.excerpt("kernels_numba/qk_norm.py", "def make_qk_norm_kernel(act, weight)", "@functools.cache")

# %% [markdown]
# `warp_sum` is a butterfly of `shfl_xor_sync` on a GPU. The simulator has no warp shuffles, so
# there the lanes meet in shared memory behind barriers (`kernels_numba/helpers.py`), which is
# why the kernel never returns early: every thread must reach each barrier, good GPU practice
# anyway. Here is `numba_v1` running on the tiny bf16 example of section 2 (on this machine's
# device: under the simulator without a GPU, where every GPU thread is a Python thread, so the
# wall time means nothing), checked against the same contract:

# %%
numba_v1 = registry.get(OP, "numba_v1")
run = {name: t.clone().to(session.device) for name, t in tiny.items()}
args = contract.check_inputs(**run, eps=EPS, weight_offset=0.0, rounding="fused")
start = time.perf_counter()
numba_v1.fn(args.q, args.k, args.q_weight, args.k_weight, args.eps, args.weight_offset, args.rounding)
seconds = time.perf_counter() - start
exact, _ = expected["fused"]
print(f"numba_v1 on {session.device} ({'simulated' if session.simulator else 'a real GPU'}): {seconds:.2f} s wall "
      "for a first call, Numba's compile included")
print(agreement("numba_v1:q", run["q"].cpu(), exact, None, "fused", tol).message)
print(f"elements equal to the reference's fused output: {int((run['q'].cpu() == outputs['fused']).sum())} of {differ.numel()}")

# %% [markdown]
# v1 waits on memory latency: each lane has one narrow load in flight and reads its row twice.
# `numba_v2` fixes head_dim when the kernel is built, so the per-lane loop has a constant trip
# count: it unrolls, the row stays in a local array the compiler keeps in registers (one read),
# and all of a lane's loads are in flight together. `numba_v3` (bf16) views the rows as 32-bit
# words, two columns each, and gives a row as many lanes as its 16-byte slices, as the CUDA C
# kernels do from rung 3 on. Both are in `kernels_numba/qk_norm.py`; the agreement table of
# section 10 runs all three.
#
# ## 7. Climbing the ladder: six CUDA C kernels
#
# The CUDA C kernels live in `kernels_cuda/qk_norm/`, one standalone file per rung
# (`v1_thread_per_row.cuh` ... `v6_two_vectors_per_lane.cuh`), each built as its own small
# extension, sharing only the row geometry (`rows.cuh`), the launch arguments (`params.h`) and
# the torch glue (`binding.h`). A file's first line is its lead, which the registry repeats (a
# test keeps them identical), and **the diff from rung n-1 to rung n shows only what the lead
# says**. That makes `walkthrough.diff_rungs(op, n)` the way to read the ladder.
#
# Every implementation is timed once here, at three headline shapes of Qwen3-32B's heads (one
# token: decode; 1024 and 8192 tokens: prefill), by the benchmark's own machinery
# (`cookbook.bench`: agreement first, then CUDA-graph replay over rotating input sets, percent
# of a device-to-device copy measured in the same run). Without a GPU the numbers come from the
# sweep recorded in `docs/results/`, by implementation name; what it does not hold is said so.

# %%
LADDER = registry.implementations(OP, ("cuda",))
TUNED = registry.get(OP, "cuda_tuned")
for impl in [*LADDER, TUNED]:
    print(f"{impl.name:<11} kernels_cuda/{impl.kernel}\n            {impl.lead}")
print(f"backend='cuda' and 'auto' (on a GPU) run: {registry.fastest(OP).name}\n")

HEADLINE = [(1, 64, 8, 128), (1024, 64, 8, 128), (8192, 64, 8, 128)]
measured = walkthrough.measure_or_recall(OP, [impl.name for impl in registry.implementations(OP)], HEADLINE)

# %% [markdown]
# ### Rung 1: one thread per row
#
# The naive port of the reference: each thread owns a whole (token, head) row, sums its squares
# in a loop, then loops again to write. It is correct, and it moves the minimum bytes on paper,
# but neighbouring threads of a warp work on rows `head_dim` elements apart: each warp-wide load
# touches 32 different memory segments (uncoalesced), and each row is read twice. The kernel:

# %%
print(registry.get(OP, "cuda_v1").lead, "\n")
walkthrough.show_kernel(OP, "cuda_v1")
print()
walkthrough.effect(measured, "reference", "cuda_v1")

# %% [markdown]
# ### Rung 2: one warp per row
#
# Give each row a warp: lane `l` reads elements `l, l + 32, ...`, so one load instruction of the
# warp reads 32 neighbouring elements, and a shuffle reduction (`warp_sum`) gives every lane the
# row's sum. The row is still read twice (the second read usually hits L1/L2) with one narrow
# load per element. Rung 2 takes any even head_dim at any alignment, so it is also the general
# path that the later rungs and the tuned kernel fall back to.

# %%
print(registry.get(OP, "cuda_v2").lead, "\n")
walkthrough.diff_rungs(OP, 2)

# %%
walkthrough.diff_rungs(OP, 2, part=2)
print()
walkthrough.effect(measured, "cuda_v1", "cuda_v2")

# %% [markdown]
# ### Rung 3: 16-byte vectors held in registers
#
# A row of 128 bf16 elements is sixteen 16-byte vectors. Rung 3 gives a row a *lane group* of
# as many lanes as it has vectors (`LaneGroup` in `rows.cuh`: 16 lanes at head_dim 128, two rows
# per warp), each lane loads its vector once into registers, the group's shuffle sum gives the
# rstd, and the lane writes the vector back: x is read once and written once, in the widest
# loads the hardware has. head_dim becomes a template parameter (compiled for 64 to 1024), and
# rows that are not whole aligned vectors take rung 2's kernel. The grid is *persistent*: as
# many blocks as the GPU holds at once, each walking a share of the rows, so a lane loads its
# columns of both weights once, before the walk.

# %%
print(registry.get(OP, "cuda_v3").lead, "\n")
walkthrough.diff_rungs(OP, 3)

# %%
walkthrough.diff_rungs(OP, 3, part=2)

# %%
walkthrough.diff_rungs(OP, 3, part=3)
print()
walkthrough.effect(measured, "cuda_v2", "cuda_v3")

# %% [markdown]
# ### Rung 4: a grid of all rows
#
# A persistent grid hands every SM the same share of rows up front, and a call lasts as long as
# its slowest SM. Rung 4 launches a block for every `kRowsPerBlock` rows instead, and the
# hardware's block scheduler gives each freed slot the next block: the load balances itself.
# The price is rung 3's weights held for a whole walk: each lane group now loads its row's
# weight right after the row, while the row is in flight.

# %%
print(registry.get(OP, "cuda_v4").lead, "\n")
walkthrough.diff_rungs(OP, 4)

# %%
walkthrough.diff_rungs(OP, 4, part=2)

# %%
walkthrough.diff_rungs(OP, 4, part=3)
print()
walkthrough.effect(measured, "cuda_v3", "cuda_v4")

# %% [markdown]
# ### Rung 5: a programmatic dependent launch, and the weights warmed while waiting
#
# Back-to-back kernels in a stream normally leave a gap: the next kernel's blocks are launched
# only once the previous kernel has finished. A *programmatic dependent launch* (a launch
# attribute from sm_90 on, `launch_kernel` in `include/common.cuh`) lets this kernel's blocks
# become resident while the previous one drains; each block then waits in hardware
# (`griddepcontrol.wait`, our `after_prior_grids`) until the previous kernel's writes are
# visible. Before the wait nothing it may write can be *read*, but a line can be *warmed*:
# `prefetch.global.L2` brings it into L2 and returns nothing, and L2 is where every store lands,
# so a later load still sees the latest value. Two lane groups of block 0 warm q's and k's
# weights, and every other group's weight loads after the wait hit L2.

# %%
print(registry.get(OP, "cuda_v5").lead, "\n")
walkthrough.diff_rungs(OP, 5)
print()
walkthrough.effect(measured, "cuda_v4", "cuda_v5")

# %% [markdown]
# ### Rung 6: two vectors per lane
#
# Every lane of a row's group repeats the row's fixed work: the row's and the weight's
# addresses, the predicates, log2(lanes) shuffle steps, the rsqrt, the stores' addresses. With
# one 16-byte vector per lane that is most of a lane's instructions, and a memory-bound kernel
# runs short of issue slots. Rung 6 gives each lane two vectors (8 lanes per row of 128 bf16):
# half as many lanes repeat each row's fixed work, and each lane has 32 bytes in flight instead
# of 16. The whole change is one template argument of `LaneGroup`. It costs registers, and in
# small calls, where a lane's serial work *is* the time, one vector per lane is faster; the
# tuned kernel picks per call.

# %%
print(registry.get(OP, "cuda_v6").lead, "\n")
walkthrough.diff_rungs(OP, 6)
print()
walkthrough.effect(measured, "cuda_v5", "cuda_v6")

# %% [markdown]
# ## 8. The tuned kernel: rung 6, plus what teaches nothing new, chosen per call
#
# `tuned.cuh` is what `backend="cuda"` (and `"auto"` on a GPU) runs. Its kernel is rung 6's;
# what it adds, its header says:

# %%
walkthrough.excerpt("kernels_cuda/qk_norm/tuned.cuh", "// tuned:", "#pragma once")

# %% [markdown]
# The choices that depend on the call are made on the host by one named function,
# `choose_policy`, from the call's rows and the rows one *wave* of blocks covers (the blocks
# resident at once on this GPU times the rows per block, which the CUDA occupancy API gives):

# %%
walkthrough.excerpt("kernels_cuda/qk_norm/tuned.cuh", "// ---- the policy (host)", "// The rows one wave of blocks")

# %% [markdown]
# What each choice buys:
#
# * **vectors per lane**: below one wave of one-vector blocks every lane's serial work is on
#   the critical path and rung 6's shorter groups do not pay; from a wave up, two vectors per
#   lane halve the per-row work each lane repeats (rung 6's trade);
# * **warm the next wave**: in calls of two to `kMaxWarmWaves` waves, every block after the
#   first wave would start by waiting one DRAM round trip for its row; each lane group, once its
#   own loads are issued, prefetches into L2 the row one wave ahead, which the block that takes
#   it then finds in L2. At many waves the blocks in flight keep DRAM busy on their own, and a
#   second request per line costs more than it saves;
# * **weight vectors**: both weights 16-byte aligned, so one load per vector instead of one per
#   element;
# * and, whatever the call: x read and written *streaming* (evict-first: each byte is touched
#   once, and L2 is better kept for the weights and the rows warmed ahead), the row -> (token,
#   head) division as a multiply-high by a magic number computed once on the host (every lane of
#   a group repeats that division), and heads of 80, 96, 160 or 192 elements on the vector path
#   in padded lane groups instead of rung 2's warp per row.
#
# `docs/qk_norm.md` gives the measurements behind each choice. Against rung 6, at the headline
# shapes:

# %%
walkthrough.effect(measured, "cuda_v6", "cuda_tuned")

# %% [markdown]
# ## 9. What the compiler says: registers per kernel
#
# `nvcc` alone (no GPU) compiles every extension; `ptxas -v` reports registers and spills per
# kernel. Registers per thread bound how many warps an SM can hold (64K 32-bit registers and at
# most 64 warps per SM on sm_90), and a memory-bound kernel needs many warps, or many bytes per
# warp, in flight to hide DRAM latency. The bf16 kernels at head_dim 128, fused rounding: rung 1
# and 2 are compiled here if needed (10-15 s each on a 2-core CPU); the larger extensions are
# listed when an earlier compile left their report in the cache (the test suite compiles every
# extension), since each of them takes from half a minute to a few minutes there.

# %%
BF16_FUSED = "I13__nv_bfloat16LNS_8RoundingE0E"  # mangled template arguments <__nv_bfloat16, Rounding::kFused


def bf16_fused_head_dim_128(kernel):
    """The bf16, fused-rounding kernels at head_dim 128, or with no head_dim argument (rungs 1-2)."""
    return BF16_FUSED + "Li128E" in kernel.mangled or BF16_FUSED + "EEv" in kernel.mangled


walkthrough.register_table(OP, [impl.name for impl in [*LADDER, TUNED]], bf16_fused_head_dim_128,
                           compile_names=("cuda_v1", "cuda_v2"))

# %% [markdown]
# (The last column counts registers only; block size and shared memory can lower it further.)
# Rung 3's vectors and weights held in registers raise its count over rung 2's; rung 4 gives
# the held weights back; rung 6's two vectors per lane cost registers again. The tuned kernel's
# template arguments after 128 are its vectors per lane, what it warms (0: the weights, 1: also
# the next wave's rows) and how it loads the weights (0: per element, 1: per vector).
#
# ## 10. Does every implementation agree with the contract?
#
# Every implementation that can run here runs on fresh inputs (q and k as strided views into one
# fused qkv tensor, as an engine leaves them), in float32 and bf16, both rounding orders, and
# Gemma's `weight_offset=1.0`, and is checked against the float64 value (fused) or the HF-order
# reference (hf). Without a GPU the input is tiny (every simulated GPU thread is a Python
# thread); on a GPU three shapes cover the vector path, GQA with one kv head, and head_dim 96
# (rung 2's general path, the tuned kernel's padded lane groups).

# %%
AGREE_SHAPES = [(1, 64, 8, 128), (129, 8, 1, 128), (7, 4, 2, 96)] if session.on_gpu else contract.SIM_SHAPES[:1]
walkthrough.agreement_table(OP, AGREE_SHAPES)

# %% [markdown]
# ## 11. Side by side
#
# Every implementation at the headline shapes (the timings of section 7), then the lines against
# tokens: on a GPU those just measured, and in any case the benchmark's full sweep recorded in
# `docs/results/` (`python -m cookbook bench --ops qk_norm --results-dir docs/results` on a GPU
# writes it, with the GPU, date, commit and command on the page).

# %%
walkthrough.timing_table(measured)
if session.on_gpu:
    walkthrough.plot_rows(measured.rows, measured.source)

# %%
walkthrough.show_sweep(OP)

# %% [markdown]
# In the plots we can see the two regimes the napkin math predicted. At few tokens every
# implementation is far below the copy line: the time is launch overhead and latency, not bytes,
# so what counts is how few launches an implementation needs (the eager reference launches one
# kernel per ATen op of section 5; the fused kernels launch once) and how short each block's
# chain of memory round trips is. As the token count grows the fused kernels become
# bandwidth-bound and climb towards the dashed copy line, while the eager reference stays far
# below it because it moves several times the minimum bytes.
#
# ## Where to go next
#
# * [`docs/qk_norm.md`](../docs/qk_norm.md): the op page (contract, the ladder, the tuned
#   kernel's measurements, caveats).
# * [`docs/results/qk_norm_h200.md`](../docs/results/qk_norm_h200.md): the full recorded sweep
#   (every implementation, every benchmark shape), and
#   [`docs/results/qk_norm_h200_builds.md`](../docs/results/qk_norm_h200_builds.md): how long the
#   extensions take to build from an empty cache.
# * [`04_qk_norm_rope`](04_qk_norm_rope.ipynb): the same norm fused with the rotary embedding.
# * `python -m pytest tests/test_qk_norm.py`: the property tests and negative controls.
