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
# One op through every level of the cookbook: its math and rounding, the napkin math, why fusing
# wins, the Numba kernel, the helpers every CUDA C kernel uses, then a **ladder** of six
# standalone kernels, each fixing one named bottleneck, up to the tuned kernel and "which kernel
# runs for my call?". Numbers are computed here or read from a recorded results page (GPU, date,
# commit); code is read from the tested sources. Without a GPU the Numba kernels run under
# Numba's CUDA simulator and timings come from the recorded pages; the first cell must run first
# (Numba reads `NUMBA_ENABLE_CUDASIM` once, at its import). Terms in *italics* are in the
# [glossary](../docs/qk_norm.md#glossary).

# %%
import sys
from pathlib import Path

# Run from a checkout (e.g. `notebooks/`): make its packages importable, whether installed or not.
ROOT = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "cookbook" / "walkthrough.py").is_file()), None)
if ROOT is not None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cookbook import walkthrough  # imports neither Numba nor a CUDA extension

session = walkthrough.setup("qk_norm")  # without a GPU: NUMBA_ENABLE_CUDASIM=1, before anything imports Numba

# %%
import time

import torch

import cookbook
from cookbook import figures, registry
from cookbook.testing import agreement

OP = "qk_norm"
contract = registry.contract(OP)  # the contract module cookbook/ops/qk_norm.py
EPS = 1e-6

# %% [markdown]
# ## 1. Where per-head QK norm sits
#
# Qwen3 and Gemma3 normalize queries and keys **per head** before the rotary embedding (it keeps
# attention logits bounded). Hugging Face's Qwen3 attention, in essence:
#
# ```python
# q = self.q_norm(self.q_proj(x).view(*tokens, -1, head_dim))   # RMSNorm over head_dim, weight [head_dim]
# k = self.k_norm(self.k_proj(x).view(*tokens, -1, head_dim))
# q, k = apply_rotary_pos_emb(q, k, cos, sin)
# ```
#
# Gemma3 applies its weight as `(1 + w)` and rounds once; OLMo2 normalizes across heads
# (`cross_head_norm`): [which rounding does my model use](../docs/models.md). In an engine q and k
# are **strided views into one fused qkv tensor**, normalized in place, with fewer kv heads than q
# heads (Qwen3-32B: 64 and 8, head_dim 128, the shape we time).
#
# ## 2. The math and the two rounding orders
#
# Per (token, head) row `x` of length `head_dim`, accumulated in float32:
# `y = x * rsqrt(mean(x^2) + eps) * (w + weight_offset)`. Where the result is rounded to bf16
# matters: `"fused"` rounds once at the end; `"hf"` (Llama's and Qwen3's norm) rounds `x * rstd`
# first, then the product with the weight. On a tiny bf16 input:

# %%
tiny = contract.make_inputs(4, 2, 1, 16, torch.bfloat16, "cpu", seed=0)  # 4 tokens, 2 q heads, 1 kv head, head_dim 16
outputs = {}
for rounding in ("fused", "hf"):
    run = {name: t.clone() for name, t in tiny.items()}
    cookbook.qk_norm(**run, eps=EPS, rounding=rounding, backend="reference")
    outputs[rounding] = run["q"]
differ = outputs["fused"] != outputs["hf"]
print(f"q elements that differ between the two orders: {int(differ.sum())} of {differ.numel()}")
t, h, d = (int(i) for i in differ.nonzero()[0])
x, w = tiny["q"][t, h].double(), tiny["q_weight"][d].double()
rstd = torch.rsqrt(x.square().mean() + EPS)
print(f"q[{t}, {h}, {d}]: exact {(x[d] * rstd * w).item():.8g}; fused {outputs['fused'][t, h, d].item():.8g}; "
      f"hf: round(x * rstd) = {(x[d] * rstd).to(torch.bfloat16).item():.8g}, then {outputs['hf'][t, h, d].item():.8g}")

# %% [markdown]
# They differ by one *ulp*, the most reported accuracy bug of this op ("my kernel disagrees with
# Hugging Face"). `cookbook.testing.agreement`, the check every test and the benchmark use, tells
# the orders apart: each output passes its own contract and fails the other, so the check can fail.

# %%
expected = {rounding: contract.expected(tiny, EPS, 0.0, rounding)["q"] for rounding in ("fused", "hf")}
tol = contract.TOLERANCES[torch.bfloat16]
for produced in ("fused", "hf"):
    for claimed in ("fused", "hf"):
        exact, hf_reference = expected[claimed]
        ok = agreement("q", outputs[produced], exact, hf_reference, claimed, tol).ok
        print(f"{produced} output against the {claimed} contract: {'PASS' if ok else 'REJECT'}")

# %% [markdown]
# ## 3. Napkin math: how fast can it be?
#
# A kernel must read q and k once and write them once; the weights are read once per launch. The
# contract's `bytes_moved` is that minimum. Divided by a device-to-device copy's bandwidth (the
# practical ceiling of a memory-bound kernel: measured now on a GPU, or recorded with the sweep):

# %%
def meta_inputs(tokens, q_heads, kv_heads, head_dim, dtype=torch.bfloat16):
    """The op's arguments as meta tensors: shapes and dtypes, no memory."""
    empty = lambda *shape: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    return dict(q=empty(tokens, q_heads, head_dim), k=empty(tokens, kv_heads, head_dim),
                q_weight=empty(head_dim), k_weight=empty(head_dim))


copy_tb_per_s, copy_source = walkthrough.copy_ceiling(OP)
print(f"copy ceiling: {copy_tb_per_s:.2f} TB/s ({copy_source})\n" if copy_tb_per_s else f"no copy ceiling: {copy_source}\n")
print(f"{'(tokens, q heads, kv heads, head_dim)':<38} {'MB moved':>9} {'us at the ceiling':>18}")
for shape in contract.BENCH_SHAPES:
    moved = contract.bytes_moved(**meta_inputs(*shape))
    at_ceiling = f"{moved / (copy_tb_per_s * 1e12) * 1e6:.3f}" if copy_tb_per_s else "-"
    print(f"{str(shape):<38} {moved / 1e6:9.3f} {at_ceiling:>18}")

# %% [markdown]
# At 8192 tokens the op is a bandwidth problem: tens of microseconds at the ceiling. At one token
# the bytes take nanoseconds, far below a kernel launch: there the time is the launch and a chain
# of DRAM round trips, so fewer launches and shorter chains win.
#
# ## 4. Why fusion wins
#
# The eager reference is not one kernel. A `TorchDispatchMode` logs every ATen op it runs on meta
# tensors and charges each the bytes of its tensor arguments read plus its result written (on a
# GPU each is about one kernel launch):

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
eager_bytes = sum(read + written for _, read, written in log.ops)
print(", ".join(name for name, _, _ in log.ops))
print(f"{len(log.ops)} ATen ops for q and k at {BIG}: {eager_bytes / 1e6:.0f} MB moved = "
      f"{eager_bytes / big_bytes:.1f}x the fused minimum of {big_bytes / 1e6:.0f} MB")

# %% [markdown]
# Each float32 intermediate is twice the activations' size and goes through memory. A fused
# kernel keeps them in registers: each row read once and written once, q and k in one launch.
#
# ## 5. The Numba kernel
#
# The same algorithm as a real GPU kernel, in Python: one warp per (token, head) row, q's and k's
# rows numbered one after the other so both go in one launch. Lane `l` reads elements `l, l + 32,
# ...` (neighbours in memory: *coalesced*), a warp sum gives every lane the row's sum of squares,
# a second pass writes:

# %%
walkthrough.excerpt("kernels_numba/qk_norm.py", "def make_qk_norm_kernel(act, weight)", "@functools.cache", max_lines=24)

# %% [markdown]
# Under the simulator there are no warp shuffles: the lanes meet in shared memory behind barriers,
# which is why the kernel never returns early. `numba_v1` on the tiny input, against the contract
# (the wall time of a simulated first call, compile included, means nothing):

# %%
numba_v1 = registry.get(OP, "numba_v1")
run = {name: t.clone().to(session.device) for name, t in tiny.items()}
args = contract.check_inputs(**run, eps=EPS, weight_offset=0.0, rounding="fused")
start = time.perf_counter()
numba_v1.fn(args.q, args.k, args.q_weight, args.k_weight, args.eps, args.weight_offset, args.rounding)
print(f"numba_v1 on {session.device} ({'simulated' if session.simulator else 'a real GPU'}): "
      f"{time.perf_counter() - start:.2f} s; " + agreement("q", run["q"].cpu(), expected["fused"][0], None, "fused", tol).message)

# %% [markdown]
# `numba_v2` fixes head_dim at build time so the row stays in registers (one read); `numba_v3`
# reads bf16 rows as 32-bit words by lanes sized to the head, as the CUDA C kernels do from rung 3.
#
# ## 6. The helpers every CUDA C rung is built from
#
# The rungs share a few device helpers (`kernels_cuda/include/common.cuh`): a 16-byte vector load
# and store, `unpack` / `pack` between a vector of bf16 and float32 (two elements per
# instruction), `warp_sum` (a shuffle butterfly over a lane group), and `rstd_from` (the rsqrt
# with the contract's zero-row and NaN rules):

# %%
for start, end in (("__device__ __forceinline__ Vec<T> load_vec(const T* p)", "// The elements of a vector as float32"),
                   ("template <int kWidth = kWarpSize>", "// Sums of kValues floats"),
                   ("__device__ __forceinline__ float rstd_from(", "// The effective weight")):
    walkthrough.excerpt("kernels_cuda/include/common.cuh", start, end)

# %% [markdown]
# A row of 128 bf16 is sixteen 16-byte vectors. From rung 3 on a *lane group* holds it: 16 lanes
# with one vector each, or 8 lanes with two (rung 6). Slot `i` of lane `l` is vector
# `i * lanes + l`, so each load instruction of the group reads contiguous memory:

# %%
figures.lane_group(128, 2);

# %% [markdown]
# ## 7. The ladder: six CUDA C kernels
#
# `kernels_cuda/qk_norm/`: one file per rung, each its own small extension; a file's first line
# is its lead (the registry's), and the diff from rung n-1 to n shows only what the lead says. Each
# rung is timed at three Qwen3-32B shapes by the benchmark's machinery (agreement first, CUDA-graph
# replay over rotating inputs, percent of a copy in the same run), or recalled without a GPU.

# %%
LADDER = registry.implementations(OP, ("cuda",))  # the rungs; their leads: the page's ladder table
HEADLINE = [(1, 64, 8, 128), (1024, 64, 8, 128), (8192, 64, 8, 128)]
measured = walkthrough.measure_or_recall(OP, [impl.name for impl in registry.implementations(OP)], HEADLINE)

# %% [markdown]
# ### Rung 1: one thread per row
#
# Each thread owns a row, sums its squares, loops again to write. Neighbouring threads work on rows
# `head_dim` elements apart, so each warp-wide load touches 32 segments (not coalesced).

# %%
walkthrough.show_kernel(OP, "cuda_v1")
walkthrough.effect(measured, "reference", "cuda_v1")

# %% [markdown]
# ### Rung 2: one warp per row
#
# Lane `l` reads elements `l, l + 32, ...`: one load instruction reads 32 neighbouring elements,
# and `warp_sum` gives every lane the sum. Still one 2-byte load per element and two passes. Rung 2
# takes any even head_dim at any alignment: the later rungs fall back to it.

# %%
walkthrough.show_kernel(OP, "cuda_v2")
walkthrough.effect(measured, "cuda_v1", "cuda_v2")

# %% [markdown]
# ### Rung 3: 16-byte vectors held in registers
#
# A lane group per row, one vector per lane, loaded once into registers (`packed`), summed,
# normalized and stored from there: x read once, in the widest loads there are. head_dim is a
# template parameter (64 to 1024); other rows take rung 2. The grid is *persistent*: each block
# walks a share of the rows, so a lane loads its columns of both weights once.

# %%
walkthrough.show_kernel(OP, "cuda_v3")
walkthrough.effect(measured, "cuda_v2", "cuda_v3")

# %% [markdown]
# ### Rung 4: a grid of all rows
#
# A persistent grid gives every SM the same share up front, and a call lasts as long as its
# slowest SM. Rung 4 launches a block per 16 rows and the block scheduler hands each freed slot the
# next one. The weights are no longer held: each group loads its row's weight right after the row.

# %%
walkthrough.show_kernel(OP, "cuda_v4")
walkthrough.effect(measured, "cuda_v3", "cuda_v4")

# %% [markdown]
# ### Rung 5: a programmatic launch, the weights warmed while waiting
#
# With a *programmatic launch* the blocks become resident while the previous kernel drains, then
# wait in hardware (`after_prior_grids`) until its writes are visible. Before that nothing may be
# read, but a line may be warmed into L2 (`warm_l2`: L2 is where every store lands, so a later load
# still sees the latest value): block 0 warms both weights. The diff, code only (the comments
# explain the same):

# %%
figures.programmatic_launch();
walkthrough.diff_rungs(OP, 5, code_only=True)
walkthrough.effect(measured, "cuda_v4", "cuda_v5")

# %% [markdown]
# ### Rung 6: two vectors per lane
#
# Every lane of a group repeats the row's fixed work (addresses, predicates, shuffle steps,
# rsqrt). Two vectors per lane halve the lanes per row, so that work, and put 32 bytes in flight
# per lane; it costs registers, and in small calls one vector per lane is faster.

# %%
walkthrough.diff_rungs(OP, 6, code_only=True)
walkthrough.effect(measured, "cuda_v5", "cuda_v6")

# %% [markdown]
# ## 8. The tuned kernel, and which kernel runs for a call
#
# `tuned.cuh` is rung 6's kernel plus what teaches nothing new (streaming loads and stores, a
# *multiply-high division* for row -> (token, head), padded lane groups for heads of 80, 96, 160
# and 192), and one host policy, `plan` in `policy.h`: vectors per lane from the call's size in
# *waves*, the next wave *warmed* into L2 in calls of more than 1 and at most 8 waves, 16-byte
# weight loads where both weights are aligned. `cookbook.explain` runs that same policy (on a GPU
# through the launcher, without one compiled for the host) and says what a call gets:

# %%
for shape in ((1, 64, 8, 128), (8192, 8, 1, 128)):
    try:
        answer = str(cookbook.explain(OP, shape=shape))
        print(answer if shape[0] == 1 else answer[answer.index("kernel:"):], end="\n\n")  # the second: its plan
    except RuntimeError as error:  # without a GPU the host policy needs nvcc
        print(f"explain {shape}: {error}")

# %% [markdown]
# At one token the call is far below a wave: one vector per lane, nothing to warm. At 8192 x 9
# heads it is about three waves of two-vector blocks: while a wave computes, each lane group warms
# the row its successor in the next wave will read:

# %%
figures.warm_ahead();
walkthrough.effect(measured, "cuda_v6", "cuda_tuned")

# %% [markdown]
# Registers per thread bound the blocks an SM holds, and so the wave (64K registers and at most
# 64 warps per SM on sm_90). From nvcc's report, bf16, fused rounding, head_dim 128:

# %%
BF16_FUSED = "I13__nv_bfloat16LNS_8RoundingE0E"  # mangled template arguments <__nv_bfloat16, Rounding::kFused


PER_VECTOR = "ELNS1_10WeightLoadE1E"  # the tuned kernel's 16-byte weight loads


def bf16_fused_head_dim_128(kernel):
    """The bf16, fused-rounding kernels at head_dim 128 (the tuned kernel's with 16-byte weight
    loads), or with no head_dim argument (rungs 1-2)."""
    if "tuned" in kernel.kernel and PER_VECTOR not in kernel.mangled:
        return False
    return BF16_FUSED + "Li128E" in kernel.mangled or BF16_FUSED + "EEv" in kernel.mangled


names = [impl.name for impl in [*LADDER, registry.get(OP, "cuda_tuned")]]
walkthrough.register_table(OP, names, bf16_fused_head_dim_128, compile_names=names)

# %% [markdown]
# ## 9. Does every implementation agree with the contract?
#
# Every implementation that runs here, on fresh inputs (q and k as views into one fused qkv
# tensor), float32 and bf16, both rounding orders and Gemma's `weight_offset=1.0`, checked against
# the float64 value (fused) or the HF-order reference (hf). On a GPU two shapes cover the vector
# path with GQA and head_dim 96 (rung 2's path, the tuned kernel's padded groups).

# %%
AGREE_SHAPES = [(129, 8, 1, 128), (7, 4, 2, 96)] if session.on_gpu else contract.SIM_SHAPES[:1]
walkthrough.agreement_table(OP, AGREE_SHAPES)

# %% [markdown]
# ## 10. Side by side
#
# Every bench shape, with the peers: [`docs/results/qk_norm_h200.md`](../docs/results/qk_norm_h200.md)
# (H200; recorded before rungs 4-6 loaded their row's weight element by element, so their rows
# there are the former rungs'; section 7's timings are this run's). At few tokens the time is
# launches and latency: one launch and a short chain of round trips win. As tokens grow the fused
# kernels climb towards the copy line; the eager reference, moving several times the minimum
# bytes, stays far below it.
#
# ## Where to go next
#
# * [`docs/qk_norm.md`](../docs/qk_norm.md): the tuned kernel's choices and their measurements,
#   results against the peers, pitfalls, tried and dropped, the glossary.
# * [`04_qk_norm_rope`](04_qk_norm_rope.ipynb): the same norm fused with the rotary embedding.
# * `python -m cookbook explain qk_norm --shape 8192,8,1,128`: the kernel of any call.
