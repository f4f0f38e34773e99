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
# # `qk_norm`: per-head RMSNorm of q and k, from the math to a fused CUDA kernel
#
# This notebook walks one op through every level of the cookbook, in the order of the Triton
# tutorials: why the op exists, its math and precision contract, the PyTorch reference, the
# napkin math that says how fast it *can* be, the Numba kernel, the numbered CUDA C versions and
# the flaw each one fixes, the compiler's resource report, an agreement check of every
# implementation, and finally the side-by-side benchmark.
#
# It runs top to bottom on a laptop: without a GPU the Numba kernel runs under Numba's CUDA
# simulator on tiny shapes and the GPU cells say that they were skipped. Every number printed
# below is computed here; the code shown is read from the tested sources, never pasted.
#
# **The first cell matters.** Numba reads `NUMBA_ENABLE_CUDASIM` once, when it is first
# imported, and `kernels_numba` picks its helpers (shared-memory instead of warp-shuffle
# reductions, NumPy bit casts instead of libdevice) at import too. So on a machine without a GPU
# the simulator must be switched on *before anything imports Numba*; setting it later does
# nothing (and `kernels_numba.helpers` refuses to run with a mismatched setting). `setdefault`
# leaves an explicit choice of yours alone.

# %%
import os
import sys
from pathlib import Path

import torch  # torch does not import Numba

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # before anything imports numba
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

# Run from a checkout (e.g. `notebooks/`): make its packages importable, whether installed or not.
ROOT = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "cookbook" / "__init__.py").exists()), None)
if ROOT is not None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

print(f"device: {torch.cuda.get_device_name() if ON_GPU else 'CPU only'}; "
      f"NUMBA_ENABLE_CUDASIM={os.environ.get('NUMBA_ENABLE_CUDASIM', '0')}; torch {torch.__version__}")

# %%
import inspect
import json
import re

import cookbook
from cookbook import bench, nvcc_report, registry
from cookbook.testing import agreement

OP = "qk_norm"
contract = registry.contract(OP)  # the contract module cookbook/ops/qk_norm.py
ROOT = ROOT or bench.REPO_ROOT
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
# heads than q heads (Qwen3-32B: 64 q heads, 8 kv heads, head_dim 128: the shape we benchmark).
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
EPS = 1e-6
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
# float64). This is the tested source:

# %%
print(inspect.getsource(contract.rms_norm_rows))
print(inspect.getsource(contract.reference))

# %% [markdown]
# ## 4. Napkin math: how fast can it be?
#
# Every implementation must read q and k once and write them once; the weights are read once per
# launch. The contract's `bytes_moved` is that minimum. We take the benchmark's headline shape,
# 8192 tokens x (64 q + 8 kv heads) x head_dim 128 in bf16, on the `meta` device (shapes and
# dtypes only, no memory), and divide by a device-to-device copy bandwidth: the practical ceiling
# of a memory-bound kernel. Until the benchmark cell at the end measures one on this machine, we
# use the figures of `TARGETS.md` (copy of 256 MiB, bytes read plus written, CUDA-graph replay).

# %%
COPY_TB_PER_S_TARGETS = {"H100": 3.0, "H200": 4.2}  # the figures of shared/design/TARGETS.md, not measured here


def meta_inputs(tokens, q_heads, kv_heads, head_dim, dtype=torch.bfloat16):
    """The op's arguments as meta tensors: shapes and dtypes, no memory."""
    empty = lambda *shape: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    return dict(q=empty(tokens, q_heads, head_dim), k=empty(tokens, kv_heads, head_dim),
                q_weight=empty(head_dim), k_weight=empty(head_dim))


def napkin(shape, copy_tb_per_s):
    moved = contract.bytes_moved(**meta_inputs(*shape))
    lines = [f"shape (tokens, q heads, kv heads, head_dim) = {shape}: {moved / 1e6:.3f} MB moved"]
    for gpu, tb_per_s in copy_tb_per_s.items():
        lines.append(f"  at {gpu}'s copy bandwidth {tb_per_s:.2f} TB/s: {moved / (tb_per_s * 1e12) * 1e6:.3f} us")
    return moved, "\n".join(lines)


BIG, ONE = (8192, 64, 8, 128), (1, 64, 8, 128)
big_bytes, text = napkin(BIG, COPY_TB_PER_S_TARGETS)
print(text)
print(napkin(ONE, COPY_TB_PER_S_TARGETS)[1])

# %% [markdown]
# At 8192 tokens the op is a bandwidth problem: a kernel that reaches the copy bandwidth takes
# tens of microseconds. At one token the bytes take nanoseconds, far below the few microseconds
# a kernel launch costs, so there the time is launch overhead and latency: fewer launches win.
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


big = contract.check_inputs(**meta_inputs(*BIG), eps=EPS, weight_offset=0.0, rounding="fused")
with OpLog() as log:
    contract.reference(big.q, big.k, big.q_weight, big.k_weight, big.eps, big.weight_offset, big.rounding)

print(f"{'ATen op':<12} {'MB read':>9} {'MB written':>11}")
for name, read, written in log.ops:
    print(f"{name:<12} {read / 1e6:9.1f} {written / 1e6:11.1f}")
eager_bytes = sum(read + written for _, read, written in log.ops)
print(f"\neager reference: {len(log.ops)} ATen ops for q and k together, {eager_bytes / 1e6:.0f} MB moved "
      f"= {eager_bytes / big_bytes:.1f}x the fused minimum of {big_bytes / 1e6:.0f} MB")

# %% [markdown]
# The float32 intermediates (`x.to(float32)`, `x^2`, `x * rstd`, `... * w`) are each as large as
# the activations, twice over because float32 is twice as wide as bf16, and each goes through
# memory. A fused kernel keeps them in registers: it reads each row once, reduces it in a warp,
# and writes the result once, so its floor is the `bytes_moved` line above, and q and k share
# one launch. `torch.compile` fuses too (it is the peer we measure against); the CUDA C versions
# below try to beat it by reaching the copy bandwidth and by being cheaper to launch at small
# token counts.
#
# ## 6. The Numba kernel
#
# The Numba kernel is the same algorithm as a real GPU kernel, written in Python: one warp per
# (token, head) row, q and k rows numbered one after the other so both tensors go in one launch.
# Lane `l` reads elements `l, l + 32, ...`, so the warp's 32 loads are neighbours in memory
# (coalesced); a warp-level sum gives every lane the row's sum of squares; a second pass writes.
# Its module docstring and the kernel factory, from the source:

# %%
import kernels_numba.helpers as numba_helpers
import kernels_numba.qk_norm as numba_qk_norm

print(numba_qk_norm.__doc__)
print(inspect.getsource(numba_qk_norm.make_qk_norm_kernel))

# %% [markdown]
# v1 waits on memory latency: each lane has one narrow load in flight and reads its row twice.
# Numba v2 fixes head_dim when the kernel is built, so the per-lane loop has a constant trip
# count: it unrolls, the row stays in a local array the compiler keeps in registers (one read),
# and all of a lane's loads are in flight together. Head dims that are not a multiple of 32 take
# v1, the general path.

# %%
print(inspect.getsource(numba_qk_norm.make_qk_norm_kernel_v2))

# %% [markdown]
# v2 still gives each row a whole warp and reads one 2-byte element per load. Numba v3 (bf16
# only) views the rows as int32 words, two columns each, and gives a row as many lanes as its
# 16-byte slices (16 at head_dim 128, as the CUDA C kernels from v3 on): a warp holds two rows,
# each lane four words, and the grid is (token, head group), so no division finds a row.

# %%
print(inspect.getsource(numba_qk_norm.make_qk_norm_kernel_v3))

# %% [markdown]
# The warp reduction comes from the shared helpers: `warp_sum` is the lane-group sum over all
# 32 lanes (`lane_group_sum` serves kernels that give a row part of a warp). On a GPU it is a
# butterfly of `shfl_xor_sync`; the simulator has no warp shuffles, so there the lanes meet in
# shared memory. That version contains `syncthreads`, which is why the kernel above never
# returns early: every thread must reach each barrier (good GPU practice anyway).

# %%
print(inspect.getsource(numba_helpers._lane_group_sum_shuffle))
print(inspect.getsource(numba_helpers._lane_group_sum_shared))
print(inspect.getsource(numba_helpers._warp_sum_shuffle))
print(inspect.getsource(numba_helpers._warp_sum_shared))
chosen = "_warp_sum_shared" if numba_helpers.warp_sum is numba_helpers._warp_sum_shared else "_warp_sum_shuffle"
print(f"on this machine warp_sum is {chosen} (simulator: {numba_helpers.SIMULATOR})")

# %% [markdown]
# Torch tensors reach the kernel without copies on a GPU (through `__cuda_array_interface__`,
# on torch's current stream; bf16 travels as its int16 bits). Under the simulator the wrapper
# passes NumPy copies instead, with bf16 upcast to float32 and rounded back to bf16 values by the
# kernel's storage codec:

# %%
print(inspect.getsource(numba_qk_norm._launch))
print(inspect.getsource(numba_helpers._launch_gpu))
print(inspect.getsource(numba_helpers._launch_simulated))

# %% [markdown]
# ## 7. The CUDA C versions, and the flaw each one fixes
#
# The CUDA C kernels live in the torch-free header `kernels_cuda/qk_norm.cuh` as numbered
# versions. The registry is the list; each version's lead says what changed and which bottleneck
# it removes, and a test keeps the header's `// vN:` lines identical to these leads:

# %%
cuda_versions = registry.implementations(OP, ("cuda",))
for impl in cuda_versions:
    print(f"v{impl.version} ({impl.name}): {impl.lead}")
print(f"\nbackend='cuda' runs the last one: {registry.latest(OP, 'cuda').name}")

# %% [markdown]
# The kernels themselves, sliced out of the header at the `// vN:` marker that precedes each one
# (the header's version list at the top repeats the markers; the last occurrence is the kernel's):

# %%
HEADER = (nvcc_report.KERNEL_DIR / f"{OP}.cuh").read_text()
RULE = re.compile(r"^// -{20,}$", re.MULTILINE)


def version_source(version):
    """The header text from the `// vN:` line above version N's kernel to the next section rule
    after its code (the next version's section, or the launchers)."""
    start = [m.start() for m in re.finditer(rf"^// v{version}: ", HEADER, re.MULTILINE)][-1]
    rules = [m.start() for m in RULE.finditer(HEADER, start)]
    end = rules[1] if len(rules) > 1 else len(HEADER)  # rules[0] closes the version's comment block
    return HEADER[start:end].rstrip()


for impl in cuda_versions:
    print(f"{'=' * 100}\n{version_source(impl.version)}\n")

# %% [markdown]
# Reading them in order:
#
# * **v1** is the naive port: one thread owns a whole row. Neighbouring threads of a warp work on
#   rows `head_dim` elements apart, so each warp-wide load touches 32 different memory segments,
#   and each row is read twice (sum, then write).
# * **v2** gives each row a warp: lanes read neighbouring elements (coalesced) and a shuffle
#   reduction combines their partial sums. The second read of the row is usually served by
#   L1/L2, but it is still a second pass of narrow loads. v2 handles any head_dim and any
#   alignment, so it is also the general path that v3 falls back to.
# * **v3** holds the row in registers as 16-byte vectors (8 bf16 elements per load), sizes the
#   lane group to the head (`kThreadsPerHead`), reads x once and writes it once, and runs q and
#   k on a persistent grid sized from occupancy, loading each lane's slice of both weights once.
#   The head_dim is a template parameter, so the fast path exists for 64, 128, 256, 512 and 1024;
#   other head_dims or rows not aligned to 16 bytes take the v2 path.
# * **v4** is v3 with a 32-bit row -> (token, head) division (where rows < 2^32). At 8192 tokens a
#   lane spends roughly 200 instructions per 16-byte vector, and a 64-bit division is a good share
#   of them: the SMs issue for about as long as DRAM needs to move the bytes, so removing
#   instructions shows up in the time. (A v4 that instead kept two rows in flight per lane group,
#   to double the bytes in flight, measured slower and was reverted: see `docs/qk_norm.md`.)
# * **v5** is v4 with x read and written by *streaming* accesses (`ld/st.global.cs`, evict-first
#   in SASS: `LDG/STG.E.EF`). Each byte of x is touched exactly once, so there is nothing to gain
#   from keeping it in the caches, while the weights and the rows still to come are. The same
#   helper serves qk_norm_rope v5 and cross_head_norm v5; here it is worth a few per cent at
#   1024 tokens and at the GQA and 256-dim shapes, and almost nothing at 8192 tokens x 72 heads.
# * **v6** is v5's kernel launched as a *programmatic dependent launch* (a launch attribute,
#   sm_90+): its CTAs may become resident while the previous kernel in the stream is still
#   finishing, and their first instruction, `griddepcontrol.wait`, holds them until that kernel
#   has completed and its writes are visible; then `griddepcontrol.launch_dependents` lets the
#   next launch do the same. The arithmetic and the registers are v5's; what goes is the gap
#   between two kernels, a quarter of a one-token call on the H200 (1.82 -> 1.37 us).
# * **v7** counts trips. v6's persistent grid holds a fixed number of lane groups (12672 rows at
#   head_dim 128 on an H200); a call with a little more (256 tokens x 72 heads = 18432 rows)
#   makes some groups take a second row after the first: two DRAM round trips in series. Where
#   the rows need one to two trips, v7 gives every group two rows and loads both before reducing
#   either, so the call waits once (4.76 -> 4.42 us at 256 tokens); elsewhere it is v6.
# * **v8** divides the row number by the head count with a multiply-high and a shift, the magic
#   number computed once on the host (`FastDivisor` in `include/common.cuh`), instead of a
#   ~20-instruction division in every lane for every row: 88.7 -> 90.2 % of the copy at 8192
#   tokens x 72 heads.
# * **v9** is for decode. A persistent lane keeps both weights in registers because its rows
#   alternate between q and k; at one token no lane sees a second row, and loading the weight it
#   does not need cost 0.2 us (measured by taking the kernel apart in probes). Where the rows fit
#   in one trip, v9 runs a kernel with no loop: the row first, then only that row's weight as
#   16-byte loads. 1.31 -> 1.17 us at one token.
# * **v10** widens the vector path. Up to v9 a lane group is sized to the head's 16-byte vectors,
#   which must tile a warp: 8 lanes at head_dim 64, 16 at 128. A head of 96 bf16 elements is 12
#   vectors, so v3 to v9 send it to v2 (a warp per row, one element per load), and there
#   `torch.compile` was faster. v10 gives such a head the next power of two of lanes (16) and lets
#   the lanes past its last vector sit out: they load, weigh and store nothing and add zero to the
#   group's sum. It compiles head_dims 80, 96, 160 and 192 (the cell below prints head_dim 128).
# * **v11** drops the persistent grid. v3 to v10 launch at most as many blocks as the GPU holds
#   at once and let every lane group walk its share of the rows; v11 launches v9's one-trip
#   kernel at every size, a block for every 16 rows, and the hardware's block scheduler gives
#   each freed slot the next block. A bare streaming kernel measured the difference first
#   (`tools/grid_probe.py`): in place over 151 MB, 79.3 us on a persistent grid against 72.9 us
#   on a grid of all vectors. For qk_norm: 90 -> 95 % of the copy at 8192 tokens x 72 heads,
#   74 -> 80 % at 1024 tokens. The price, each group loading its row's weight, is an L1 hit.
# * **v12** uses the time a programmatic launch spends parked at `griddepcontrol.wait`. Before
#   the wait nothing the previous kernel may write can be *read*, but a line can be *warmed*:
#   `prefetch.global.L2` brings it into L2 and returns nothing, and L2 is where every store
#   lands, so a later load still sees the latest value. Two lane groups of block 0 warm q's and
#   k's weights, and by the time any block reads them they are L2 hits: 1.15 -> 0.95 us at one
#   token, 1.98 -> 1.76 at 64. (Warming per lane group instead, thousands of prefetches of the
#   same two lines, was 2-3x slower from 64 tokens up.)
# * **v13** warms rows, not weights. In a call of a few waves of blocks (8192 tokens x 8/1 heads
#   is 4.4 waves), every block after the first wave starts by waiting one DRAM round trip for its
#   row. Once a lane group's own loads are issued, v13 has it prefetch into L2 the row one wave of
#   blocks further on, one `prefetch.global.L2` per 128-byte line: the row a block of the next
#   wave will take, which then finds it in L2. On the H200: 8192 x 8/1 11.02 -> 10.60 us (81 ->
#   85 % of the copy), 1024 x 64/8 10.98 -> 10.56. Only at two to eight waves: at many waves the
#   blocks in flight keep the DRAM busy alone, and the second request per line costs.
# * **v14** halves the lanes per row. Every lane of a row's group repeats the row's fixed work
#   (its address, the weight's, predicates, the shuffle sum's steps, `rsqrt`), and with one
#   16-byte vector per lane that is most of the lane's code: about 250 PTX instructions against
#   about 60 for its 8 elements, with the SMs' issue slots 70-74 % busy (Nsight Compute) in a
#   kernel that should be waiting on memory. v14 gives each lane two vectors (8 lanes per row of
#   128): 47 registers instead of 29, five blocks per SM instead of eight, but 32 rows per block.
#   In calls of at least one wave of v13's blocks: 8192 x 8/1 10.69 -> 10.38 us (84.5 -> 87.0 % of
#   the copy), 8192 x 32/8 heads of 64 22.47 -> 21.62, 256 tokens 3.86 -> 3.59. Below that the
#   lanes' serial work is the time, and one vector per lane stays (one token: 0.92 against 1.11
#   us with two).
#
# ## 8. What the compiler says: registers per kernel
#
# `nvcc` alone (no GPU) compiles every kernel of the header; `ptxas -v` reports registers and
# spills per instantiation. Registers per thread bound how many warps an SM can hold, and a
# memory-bound kernel needs many warps in flight to hide memory latency. Here: the bf16 kernels
# at head_dim 128 (v1 and v2 are not specialized on head_dim).

# %%
REGISTERS_PER_SM = 65536  # sm_90 (H100, H200): 64K 32-bit registers per SM
MAX_WARPS_PER_SM = 64  # sm_90: 2048 threads per SM
REGISTER_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256

if nvcc_report.nvcc() is None:
    print("nvcc is not on PATH: skipping the compiler's resource report (CI and GPU machines have it).")
else:
    kernels = nvcc_report.compile_header(OP)
    # From the mangled names, which read the same whatever demangler a machine has:
    # qk_norm_v3_kernelI13__nv_bfloat16Li128ELb0ElLb0ELb0ELi1ELb0EE is v3<bf16, head_dim 128,
    # fused, int64 rows (l), no streaming, no programmatic launch, 1 row per lane group, no fast
    # division>; with 32-bit rows (j) the flags say which version launches it; v9's decode kernel
    # is qk_norm_one_trip_kernel (its 16-byte-weight instance, the fourth flag 1), which v11 runs at
    # every size, v12 with its fifth flag (the weights warmed before the wait) set, v13 with its
    # sixth (the row a wave ahead warmed) set too, and v14 with its last argument (the fewest
    # vectors per lane) 2.
    name = re.compile(r"qk_norm_v(\d+)_kernelI13__nv_bfloat16(?:Li(\d+)E)?Lb([01])E"
                      r"(?:([jl])Lb([01])ELb([01])ELi(\d)ELb([01])E)?")
    one_trip = re.compile(r"qk_norm_one_trip_kernelI13__nv_bfloat16Li(\d+)ELb([01])ELb1ELb([01])E(?:Lb([01])E)?"
                          r"(?:Li(\d)E)?")
    # (streaming, programmatic, rows per lane group, fast division) of the 32-bit-row kernels
    versions = {("0", "0", "1", "0"): "v4", ("1", "0", "1", "0"): "v5", ("1", "1", "1", "0"): "v6",
                ("1", "1", "2", "0"): "v7 (two rows per group)", ("1", "1", "1", "1"): "v8",
                ("1", "1", "2", "1"): "v8 (two rows per group)"}
    print(f"{OP}.cuh compiled for {nvcc_report.DEFAULT_ARCH}: {len(kernels)} kernels; bf16, head_dim 128:\n")
    table = []
    for k in kernels:
        m, m_one = name.search(k.mangled), one_trip.search(k.mangled)
        if m and m.group(2) in (None, "128"):
            version = versions[m.group(5, 6, 7, 8)] if m.group(4) == "j" else f"v{m.group(1)}"
            hf = m.group(3) == "1"
        elif m_one and m_one.group(1) == "128":
            warmed = "v12 (weights warmed)" if m_one.group(3) == "1" else "v9 (one trip), v11"
            version = "v13 (row a wave ahead warmed)" if m_one.group(4) == "1" else warmed
            if m_one.group(5) == "2":
                version = "v14 (two vectors per lane" + (", row a wave ahead warmed)" if m_one.group(4) == "1" else ")")
            hf = m_one.group(2) == "1"
        else:
            continue
        per_warp = -(-k.registers * 32 // REGISTER_ALLOC_UNIT) * REGISTER_ALLOC_UNIT
        warps = min(MAX_WARPS_PER_SM, REGISTERS_PER_SM // per_warp)
        table.append((version, "hf" if hf else "fused", k.registers, k.spill_bytes, warps))
    print("| version | rounding | registers | spill bytes | warps/SM the registers allow |")
    print("|---|---|---|---|---|")
    number = lambda version: int(re.match(r"v(\d+)", version).group(1))
    for version, rounding, registers, spills, warps in sorted(table, key=lambda row: (number(row[0]), row[0], row[1])):
        print(f"| {version} | {rounding} | {registers} | {spills} | {warps} |")

# %% [markdown]
# (The last column counts registers only; block size and shared memory can lower it further.
# The benchmark on a GPU measures what actually happens.)
#
# ## 9. Does every implementation agree with the contract?
#
# We iterate the registry: every implementation that can run on this machine is run on fresh
# inputs (q and k as strided views into one fused qkv tensor, as an engine leaves them), in
# float32 and bf16, both rounding orders, and Gemma's `weight_offset=1.0`, and checked against
# the float64 value (fused) or the HF-order reference (hf). Skipped implementations say why.
# Without a GPU the shapes are tiny: every simulated GPU thread is a Python thread.

# %%
if ON_GPU:
    AGREE_SHAPES = [(1, 64, 8, 128), (129, 8, 1, 128), (7, 4, 2, 96)]  # fast path, GQA kv=1, 96: v2 to v9, padded in v10
else:
    AGREE_SHAPES = list(contract.SIM_SHAPES)
AGREE_CASES = [(dtype, rounding, 0.0) for dtype in (torch.float32, torch.bfloat16) for rounding in ("fused", "hf")]
AGREE_CASES += [(torch.bfloat16, rounding, 1.0) for rounding in ("fused", "hf")]  # Gemma's (1 + w)


def check(impl, shape, dtype, rounding, weight_offset):
    inputs = contract.make_inputs(*shape, dtype=dtype, device=DEVICE, seed=1, fused_qkv=True)
    want = contract.expected({n: t.clone() for n, t in inputs.items()}, EPS, weight_offset, rounding)
    args = contract.check_inputs(**inputs, eps=EPS, weight_offset=weight_offset, rounding=rounding)
    impl.fn(args.q, args.k, args.q_weight, args.k_weight, args.eps, args.weight_offset, args.rounding)
    results = [agreement(n, inputs[n], exact, hf, rounding, contract.TOLERANCES[dtype]) for n, (exact, hf) in want.items()]
    return all(r.ok for r in results), max(r.max_ulp for r in results), "; ".join(r.message for r in results if not r.ok)


failures = 0
for impl in registry.implementations(OP, ("reference", "numba", "cuda")):  # the peer is timed below
    reason = impl.unavailable(DEVICE)
    if reason:
        print(f"{impl.name:<14} skipped: {reason}")
        continue
    verdicts = [(case, check(impl, shape, *case)) for shape in AGREE_SHAPES for case in AGREE_CASES]
    bad = [(case, v) for case, v in verdicts if not v[0]]
    failures += len(bad)
    worst = {dtype: max(v[1] for (d, _, _), v in verdicts if d == dtype) for dtype in (torch.float32, torch.bfloat16)}
    print(f"{impl.name:<14} {len(verdicts) - len(bad)} of {len(verdicts)} cases agree; worst error "
          + ", ".join(f"{str(d).removeprefix('torch.')} {u:.3g} ulp" for d, u in worst.items()))
    for case, (_, _, message) in bad:
        print(f"   FAIL {case}: {message}")
print("\nall runnable implementations agree" if failures == 0 else f"\n{failures} FAILING cases above")

# %% [markdown]
# ## 10. Side by side: the benchmark
#
# On a GPU the next cell calls the cookbook's benchmark (`cookbook.bench.run`, the same code as
# `python -m cookbook bench`): for every implementation in the registry plus the peers it checks
# agreement first, then times each by CUDA-graph replay over rotating input sets (median and
# p20-p80), and reports GB/s from `bytes_moved` and percent of a device-to-device copy measured
# in the same run. Set `COOKBOOK_BENCH_SHAPES=full` for the whole sweep (the default here,
# `quick`, times the first, middle and last shapes, too few token counts for a line, so the plot
# then draws this GPU's recorded full sweep from `docs/results/`). Without a GPU it shows the
# recorded results of the last GPU run in `docs/results/`, if there are any.

# %%
import matplotlib.pyplot as plt


def plot_rows(rows, title):
    """Latency and percent of copy against tokens, one line per implementation (the shape family
    with the most token counts)."""
    family = bench.largest_family([r for r in rows if r["op"] == OP and r["median_us"] is not None])
    if not family:
        print("no timed rows to plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    for ax, (column, label) in zip(axes, bench.PLOTS.values()):
        bench.draw_lines(ax, family, column, label)  # a colour per implementation, a marker per level
    axes[1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    tail = ", ".join(map(str, family[0]["shape"][1:]))
    fig.suptitle(f"{OP}, shape (tokens, {tail}): {title}")
    fig.tight_layout()


def summarize_rows(rows):
    """Per shape: the fastest implementation and its % of copy; the last CUDA C version vs the peers."""
    last_cuda = registry.latest(OP, "cuda").name
    for label in dict.fromkeys(r["label"] for r in rows):
        timed = [r for r in rows if r["label"] == label and r["median_us"] is not None]
        if not timed:
            continue
        best = min(timed, key=lambda r: r["median_us"])
        line = f"{label}: fastest {best['impl']} {best['median_us']:.2f} us ({best['pct_of_copy']:.0f} % of copy)"
        ours = next((r for r in timed if r["impl"] == last_cuda), None)
        if ours is not None:
            line += f"; {last_cuda} {ours['pct_of_copy']:.0f} % of copy, " + ", ".join(
                f"{ours[col]:.2f}x {what}" for col, what in (("x_vs_eager", "vs eager"), ("x_vs_compile", "vs torch.compile"))
                if ours[col] is not None)
        print(line)


SHAPES = os.environ.get("COOKBOOK_BENCH_SHAPES", "quick")
RESULTS = ROOT / "docs" / "results"  # what `python -m cookbook bench` records
if ON_GPU:
    BENCH_OUT = ROOT / "bench_out" / "notebook_01"
    bench_rows = bench.run(ops=[OP], shapes=SHAPES, out=BENCH_OUT, write_results=False,
                           command=f"notebooks/01_qk_norm (cookbook.bench.run, shapes={SHAPES!r})")
    meta = json.loads((BENCH_OUT / "results.json").read_text())["metadata"]
    print()
    print(napkin(BIG, {f"this {meta['gpu']} (measured above)": meta["copy_tb_per_s"]})[1])
    summarize_rows(bench_rows)
    # A quick run times one or two token counts per shape: draw this GPU's recorded (full) sweep.
    recorded = bench.recorded_sweeps(OP, RESULTS, meta["gpu_slug"]) if SHAPES == "quick" else []
    for sweep in recorded:
        plot_rows(sweep.rows, sweep.title)
    if not recorded:
        plot_rows(bench_rows, meta["gpu"])
else:
    print("No CUDA GPU: the benchmark cells were skipped (timings under the simulator mean nothing).")
    recorded = bench.recorded_sweeps(OP, RESULTS)
    if not recorded:
        print("No recorded GPU results in docs/results/ yet: `python -m cookbook bench` on a GPU writes them.")
    for sweep in recorded:
        print(f"\nRecorded GPU results, {sweep.page.relative_to(ROOT)}:\n")
        print(sweep.page.read_text())
        summarize_rows(sweep.rows)
        plot_rows(sweep.rows, sweep.title)

# %% [markdown]
# In the plot above (when there is one) we can see the two regimes the napkin math predicted.
# At few tokens every implementation is far below the copy line: the time is launch overhead and
# latency, not bytes, so what counts is how few launches an implementation needs (the eager
# reference launches one kernel per ATen op of section 5; the fused kernels launch once). As the
# token count grows the fused kernels become bandwidth-bound and climb towards the dashed copy
# line, while the eager reference stays well below it because it moves several times the minimum
# bytes. If each CUDA C version fixes its flaw, their latency lines are ordered v1, v2, v3, v4 from
# slowest to fastest at large token counts; the summary printed above the plot says, for each
# shape, which implementation was fastest on this GPU and how the final version compares with
# eager PyTorch and `torch.compile`.
#
# ## Where to go next
#
# * `docs/qk_norm.md`: the op page (contract, versions, caveats, results).
# * `python -m cookbook bench --ops qk_norm` on a GPU: the full sweep, with CSV/JSON and plots.
# * `python -m pytest tests/test_qk_norm.py`: the property tests and negative controls.
