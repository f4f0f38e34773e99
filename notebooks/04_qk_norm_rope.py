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
# # `qk_norm_rope`: per-head RMSNorm then rotary embedding of q and k, in one pass
#
# This walkthrough builds on [`01_qk_norm`](01_qk_norm.ipynb): the same per-head RMSNorm, now
# followed by the rotary embedding (RoPE). Its lesson is the fusion itself: a norm kernel and a
# rope kernel move every element of q and k through memory twice; one kernel that keeps the
# normalized row in registers and rotates it there moves it once. In the Triton tutorials' order:
# the contract on a tiny example, the reference, the napkin math, why fusing wins, the Numba
# kernel, a **ladder** of seven CUDA C rungs, the tuned kernel and its policy, registers,
# agreement, timing. Without a GPU the Numba kernels run under the simulator (switched on by the
# first cell, as in 01) and the timings come from the recorded sweep (`docs/results/`).

# %%
import sys
from pathlib import Path

# Run from a checkout (e.g. `notebooks/`): make its packages importable, whether installed or not.
ROOT = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "cookbook" / "walkthrough.py").is_file()), None)
if ROOT is not None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cookbook import walkthrough  # imports neither Numba nor a CUDA extension

session = walkthrough.setup("qk_norm_rope")  # without a GPU: NUMBA_ENABLE_CUDASIM=1, before anything imports Numba

# %%
import torch

import cookbook
from cookbook import nvcc_report, registry
from cookbook.testing import agreement

OP = "qk_norm_rope"
contract = registry.contract(OP)  # the contract module cookbook/ops/qk_norm_rope.py
EPS = 1e-6
torch.set_printoptions(precision=4, linewidth=120, sci_mode=False)

# %% [markdown]
# ## 1. Motivation: QK norm, then RoPE, in every attention layer
#
# The diffusion transformers FLUX, Qwen-Image and Z-Image, and Qwen3's language models, normalize
# the queries and keys **per head** (RMSNorm over `head_dim`) and then rotate them by the token's
# position, in every attention layer of every step:
#
# ```python
# q = q_norm(q_proj(x).view(T, -1, head_dim))     # per-head RMSNorm, weight [head_dim]
# k = k_norm(k_proj(x).view(T, -1, head_dim))
# q, k = apply_rope(q, k, cos[pos], sin[pos])     # rotate pairs of dims by a position-dependent angle
# ```
#
# At 1024x1024 an image is 4096 tokens of 24 (FLUX), 30 (Z-Image) or 32 (Qwen-Image) heads of
# 128, and each step alone is a full pass over q and k.
#
# ## 2. The math and the contract
#
# Per (token, head) row `x`: `qk_norm`'s `n = x * rsqrt(mean(x^2) + eps) * (w + weight_offset)`,
# then each pair `(a, b)` of the first `rope_dim` dims of `n` turns by the angle of the token's
# position: `a' = a cos - b sin`, `b' = b cos + a sin`, with `cos_i, sin_i` from the token's row of
# `cos_sin_cache` (`cookbook/ops/qk_norm_rope.py` is the specification; `docs/qk_norm_rope.md`
# has it as a table).
#
# **Which dims pair up.** `contract.pair_slices` is what the reference uses. For a head of 12
# dims with `rope_dim = 8` (partial rotary), pair i uses `cos_i, sin_i` of the token's cache row;
# dims 8 to 11 are not rotated:

# %%
HEAD_DIM, ROPE_DIM = 12, 8
for is_neox in (True, False):
    a_dims, b_dims = contract.pair_slices(ROPE_DIM, is_neox)
    dims = torch.arange(HEAD_DIM)
    pairs = ", ".join(f"({a}, {b})" for a, b in zip(dims[a_dims].tolist(), dims[b_dims].tolist()))
    print(f"{'NeoX (is_neox=True)' if is_neox else 'interleaved (is_neox=False)':<28} pairs i = 0..3: {pairs}; "
          f"pass-through: {dims[ROPE_DIM:].tolist()}")

# %% [markdown]
# The same tiny head through the op, in float32 with unit weights so the numbers are easy to
# read: one token of one q head and one k head, at position 1 of a 4-row cache. The
# normalized row (from `qk_norm`) and the two layouts:

# %%
tiny = contract.make_inputs(1, 1, 1, HEAD_DIM, ROPE_DIM, True, torch.float32, "cpu", seed=0, max_position=4)
tiny["q_weight"].fill_(1.0)
tiny["k_weight"].fill_(1.0)
tiny["positions"].fill_(1)
print(f"cos_sin_cache row 1 (cos_0..3 | sin_0..3): {tiny['cos_sin_cache'][1]}")

normed = {n: t.clone() for n, t in tiny.items() if n not in ("cos_sin_cache", "positions", "rope")}
cookbook.qk_norm(**normed, eps=EPS, backend="reference")
print(f"normalized q (qk_norm): {normed['q'][0, 0]}")
for is_neox in (True, False):
    run = {n: t.clone() for n, t in tiny.items() if n != "rope"}
    cookbook.qk_norm_rope(**run, eps=EPS, is_neox=is_neox, backend="reference")
    y = run["q"][0, 0]
    untouched = torch.equal(y[ROPE_DIM:], normed["q"][0, 0, ROPE_DIM:])
    print(f"{'NeoX' if is_neox else 'interleaved':<12} q out: {y}  (dims >= rope_dim equal to the normalized row: {untouched})")

# %% [markdown]
# Two properties the tests check, visible here: **position 0 is the identity** (cos 1, sin 0:
# the output is the normalized row), and **an out-of-range position never reads outside the
# cache**: the kernels cannot raise without a host sync, so such a token's rotated dims come out
# NaN while its pass-through dims are normalized as usual (`validate_positions=True` raises
# instead, after a host sync).

# %%
at_zero = {n: t.clone() for n, t in tiny.items() if n != "rope"}
at_zero["positions"].fill_(0)
cookbook.qk_norm_rope(**at_zero, eps=EPS, backend="reference")
print(f"position 0 leaves the normalized row unchanged: {torch.allclose(at_zero['q'], normed['q'])}")

out_of_range = {n: t.clone() for n, t in tiny.items() if n != "rope"}
cookbook.qk_norm_rope(**out_of_range, eps=EPS, position_offset=10, backend="reference")  # 1 + 10 >= 4 rows
print(f"position 1 + offset 10 in a 4-row cache: q out = {out_of_range['q'][0, 0]}")

# %% [markdown]
# **Rounding.** `rounding="fused"` keeps the normalized value in float32 registers, rotates it in
# float32 and rounds once; `rounding="hf"` rounds where Hugging Face does (the norm output, cos
# and sin, each product and sum, in the activation dtype). In bf16 the two differ in a share of
# the elements, and `cookbook.testing.agreement` tells them apart: each output passes its own
# contract and is rejected by the other's.

# %%
small = contract.make_inputs(4, 2, 1, 64, 64, True, torch.bfloat16, "cpu", seed=0)
outputs = {}
for rounding in ("fused", "hf"):
    run = {n: t.clone() for n, t in small.items()}
    cookbook.qk_norm_rope(**{n: t for n, t in run.items() if n != "rope"}, eps=EPS, rounding=rounding, backend="reference")
    outputs[rounding] = run["q"]
differ = outputs["fused"] != outputs["hf"]
print(f"bf16 q elements that differ between the two orders: {int(differ.sum())} of {differ.numel()}")

expected = {rounding: contract.expected(small, EPS, 0.0, rounding)["q"] for rounding in ("fused", "hf")}
tol = contract.TOLERANCES[torch.bfloat16]
for produced in ("fused", "hf"):
    for claimed in ("fused", "hf"):
        exact, hf_reference = expected[claimed]
        verdict = agreement(f"{produced} output vs {claimed} contract", outputs[produced], exact, hf_reference, claimed, tol)
        print(f"{produced} output against the {claimed} contract: {'PASS' if verdict.ok else 'REJECT'} "
              f"(max {verdict.max_ulp:.2f} ulp)")

# %% [markdown]
# ## 3. The reference
#
# The reference is the math in readable PyTorch and the oracle of every test (it also runs in
# float64 for the exact value). The rotation and the row function, from the tested source:

# %%
walkthrough.excerpt("cookbook/ops/qk_norm_rope.py", "def rotate(", "@torch.no_grad()")

# %% [markdown]
# ## 4. Napkin math: how fast can it be?
#
# A fused kernel must read q and k once and write them once; per token it also reads its
# position and one cache row, and the weights once per launch: `contract.bytes_moved`. The
# shapes are the benchmark's (`contract.BENCH_SHAPES`), on the `meta` device (shapes and dtypes,
# no memory), divided by a device-to-device copy bandwidth: the practical ceiling of a
# memory-bound kernel, measured now on a GPU, or else the copy the benchmark recorded.

# %%
NAMED_SHAPES = {  # bench shapes by the names models give them
    "decode (Qwen3-8B, 64 sequences)": (64, 32, 8, 128, 128, True),
    "prefill (Qwen3-8B)": (4096, 32, 8, 128, 128, True),
    "flux_1024": (4096, 24, 24, 128, 128, True),
    "qwen_image_partial": (4096, 32, 32, 128, 64, True),
    "zimage_1024": (4096, 30, 30, 128, 128, False),
    "batch2_medium": (4096, 24, 24, 128, 128, False, 2),
}
assert all(shape in contract.BENCH_SHAPES for shape in NAMED_SHAPES.values())


def meta_case(shape, dtype=torch.bfloat16):
    """The op's tensors for a benchmark shape, on the meta device, and the shape's label."""
    inputs, label = contract.bench_case(shape, dtype, "meta")
    return {n: t for n, t in inputs.items() if n != "rope"}, label


copy_tb_per_s, copy_source = walkthrough.copy_ceiling(OP)
print(f"copy ceiling: {copy_tb_per_s:.2f} TB/s ({copy_source})\n" if copy_tb_per_s else f"no copy ceiling: {copy_source}\n")
for name, shape in NAMED_SHAPES.items():
    tensors, label = meta_case(shape)
    moved = contract.bytes_moved(**tensors)
    at_ceiling = f", {moved / (copy_tb_per_s * 1e12) * 1e6:.2f} us at the copy ceiling" if copy_tb_per_s else ""
    print(f"{name}: {moved / 1e6:.1f} MB{at_ceiling}")

# %% [markdown]
# At the image shapes the op is a bandwidth problem: tens of microseconds at the copy bandwidth.
# At decode the bytes take well under a microsecond, and the time is the launch and a chain of
# DRAM round trips (the row and the token's position, then the cos/sin row the position points
# at, then the weights): latency, not bandwidth.
#
# ## 5. Why fusing wins
#
# The split path every model runs without a fused op is two passes: a norm kernel reads q and k
# and writes them, then a rope kernel reads them again with the cache rows and writes them again.
# Rung 1 below is that split path, its intermediate in float32 so that the fused order's single
# rounding survives the split. Counting bytes:

# %%
print(f"{'shape':<34} {'fused MB':>9} {'norm + rope in bf16':>20} {'rung 1 (float32 rows)':>22}")
for name, shape in NAMED_SHAPES.items():
    tensors, _ = meta_case(shape)
    q, k = tensors["q"], tensors["k"]
    fused = contract.bytes_moved(**tensors)
    bf16_pair = fused + 2 * (q.numel() + k.numel()) * q.element_size()  # the rows written and read back once more
    rung1 = fused + contract.split_scratch_bytes(q, k)
    print(f"{name:<34} {fused / 1e6:9.1f} {bf16_pair / 1e6:14.1f} ({bf16_pair / fused:.1f}x) "
          f"{rung1 / 1e6:15.1f} ({rung1 / fused:.1f}x)")

# %% [markdown]
# Twice the minimum for the split path in bf16 (and an extra rounding), three times with float32
# rows; the eager reference, one kernel per ATen op with float32 intermediates, moves more still.
# A fused kernel's floor is the first column.
#
# ## 6. The Numba kernels
#
# One warp per (token, head) row, q's rows then k's in one launch. In `numba_v1` a lane reads
# its elements once into a local array, a warp sum gives the row's sum of squares, and the
# rotation's partner, held by another lane, comes over a warp shuffle (the simulator has no
# shuffles: there the lanes meet in shared memory). `numba_v2` gives a lane whole pairs (both
# members and one cos/sin read), as the CUDA C kernels do from rung 2 on; `numba_v3` moves bf16 as
# 32-bit words, two columns per load (`kernels_numba/qk_norm_rope.py`; section 10 runs all three).

# %% [markdown]
# ## 7. Climbing the ladder: seven CUDA C kernels
#
# The kernels live in `kernels_cuda/qk_norm_rope/`, one standalone file per rung, each built as
# its own small extension, sharing only `rows.cuh` (where a row lives, the rotation's
# arithmetic, how lanes split a row into 16-byte vectors, the tables' loads), `params.h` and the
# torch glue. A file's first line is its lead, which the registry repeats, and the diff from rung
# n-1 to rung n shows only what the lead says (`walkthrough.diff_rungs`). Every implementation is
# timed at four headline shapes: one token and 64 tokens of Qwen3-8B (decode), FLUX at 1024x1024
# and Qwen3-32B's prefill (on a GPU now, else from the recorded sweep).

# %%
LADDER = registry.implementations(OP, ("cuda",))
TUNED = registry.get(OP, "cuda_tuned")  # the rungs' leads: the page's ladder table

HEADLINE = [(1, 32, 8, 128, 128, True), (64, 32, 8, 128, 128, True), (4096, 24, 24, 128, 128, True),
            (8192, 64, 8, 128, 128, True)]
TIMED = ["reference", *(impl.name for impl in LADDER), TUNED.name, "torch_compile"]
measured = walkthrough.measure_or_recall(OP, TIMED, HEADLINE)

# %% [markdown]
# ### Rungs 1 and 2: the split path, then one pass
#
# Rung 1 is two kernels: a warp per row sums the squares and writes the normalized row to float32
# scratch (memory the binding lends from torch's allocator); a thread per element then reads its
# element and its partner back with the token's cos and sin, and writes x. Rung 2 fuses them:
# one warp per row, each lane owning whole pairs (for NeoX it reads one member from each half,
# each read coalesced across the warp), so nothing waits for another lane. Its row is still read
# twice (the second read hits L1/L2) with 2-byte loads. Rung 2 takes any shape and alignment: the
# later rungs and the tuned kernel fall back to it. Its kernel:

# %%
walkthrough.show_kernel(OP, "cuda_v2")
print()
walkthrough.effect(measured, "cuda_v1", "cuda_v2")

# %% [markdown]
# ### Rung 3: the row in registers, a lane exchange for NeoX
#
# A row of 128 bf16 is sixteen 16-byte vectors: a lane group of sixteen lanes holds it, one
# vector each, read once and kept in registers through the sum, the normalization and the
# rotation. An interleaved pair sits inside one vector. A NeoX pair spans two vectors
# `rope_dim / 2` apart, held by two lanes: each lane fetches its partner's normalized values with a
# shuffle, and both lanes read the pair's cos and sin.

# %%
walkthrough.effect(measured, "cuda_v2", "cuda_v3")

# %% [markdown]
# ### Rung 4: the pair in one lane
#
# Group the row's vectors in units of two that hold the same pairs (NeoX: vector u and its
# partner in the second half; interleaved: neighbours) and give each lane a unit: it rotates its
# pairs in its own registers, reads each cos/sin once, and has 32 bytes in flight instead of 16.
# The diff from rung 3 (first part):

# %%
walkthrough.diff_rungs(OP, 4, max_lines=28)
print()
walkthrough.effect(measured, "cuda_v3", "cuda_v4")

# %% [markdown]
# ### Rung 5: the layout at compile time
#
# NeoX or interleaved, and each table's storage (the activation dtype or float32), are the same
# for the whole call; rung 4 decides them per element, and the compiler keeps both rotations and
# can issue the loads of both storage types. Rung 5's launcher picks a kernel compiled for the
# call's kind (`with_call_kind`); in the kernel, `p.is_neox` becomes `kNeox` and the tables'
# loads `load_table<WeightT>` and `load_table<CacheT>` (`diff_rungs(OP, 5)` shows it all).

# %%
walkthrough.effect(measured, "cuda_v4", "cuda_v5")

# %% [markdown]
# ### Rung 6: a programmatic launch, the tables warmed while it waits
#
# A programmatic dependent launch lets the kernel's blocks become resident while the previous
# kernel still runs; each waits in hardware for that kernel's writes. Before the wait nothing it
# may write can be read, but a line can be warmed: `prefetch.global.L2` returns nothing, and L2 is
# where every store lands. Block 0 warms the weights; the lane group of each token's first head
# warms the token's cos/sin run, aimed by a speculative L2-only read of its position. After the
# wait, a lane reads its tables right behind its row. At decode this shortens the chain of round
# trips to the row's own.

# %%
walkthrough.effect(measured, "cuda_v5", "cuda_v6")

# %% [markdown]
# ### Rung 7: a persistent walk of whole tokens
#
# Instead of a block per 32 rows, as many blocks as are resident at once, cut to a whole number
# of tokens' rows, each lane group walking rows `r, r + grid rows, ...`: a step moves it to the
# same head of a later token, so its (token, head) is divided out once and its weight read once,
# before the walk. The loop, from the diff against rung 6:

# %%
walkthrough.diff_rungs(OP, 7, max_lines=40, part=2)
print()
walkthrough.effect(measured, "cuda_v6", "cuda_v7")

# %% [markdown]
# ## 8. The tuned kernel: the rungs' kernels, chosen per call
#
# `tuned.cuh` is what `backend="cuda"` (and `"auto"` on a GPU) runs: one kernel template in three
# walks (rung 6's one row per lane group at decode, rung 7's whole-token walk at prefill, a walk
# by the launcher's steps where no whole-token grid fits), with streaming accesses, a
# multiply-high division and a one-fma scale. Its policy is plain C++ in `policy.h`: the
# launcher builds a `Call`, runs `plan` with each kernel's resident blocks per SM and launches what
# the `Plan` says. The choice of the walk, from the source:

# %%
walkthrough.excerpt("kernels_cuda/qk_norm_rope/policy.h", "  // Whole tokens: where the rows need", "// ---- the plan in words")

# %% [markdown]
# The plan for each named shape: on a GPU the tuned extension's `explain` op answers (the
# launcher's own code, the driver's occupancy); without one, the same policy compiled for the host
# answers for an H100 (132 SMs), with each kernel's registers from nvcc's report (a compile of a
# minute on a small CPU, cached).

# %%
for name, shape in NAMED_SHAPES.items():  # the tuned kernel's own policy: `cookbook.explain`
    try:
        plan = cookbook.explain(OP, shape=shape[:6]).plan
    except RuntimeError as error:  # without a GPU the policy compiled for the host needs nvcc
        print(error)
        break
    print(f"{name:<34} {plan.get('walk', 'rung 2'):<20} grid {int(plan['grid']):>5} x {plan['block']}")

# %% [markdown]
# Decode fits in one trip of the resident blocks: one row per lane group, tables warmed. The
# image shapes walk whole tokens. `docs/qk_norm_rope.md` gives the measurement behind each
# choice. Against rung 7, at the headline shapes:

# %%
walkthrough.effect(measured, "cuda_v7", "cuda_tuned")

# %% [markdown]
# ## 9. What the compiler says: registers per kernel
#
# `nvcc` alone (no GPU) compiles every extension; `ptxas -v` reports registers per kernel.
# Registers per thread bound how many warps an SM holds (64K registers, at most 64 warps), and a
# memory-bound kernel needs bytes in flight. The bf16 kernels at head_dim 128, fused rounding, for
# the benchmark's tables (bf16 weights, a float32 cache); the tuned kernel is listed when the
# tests' compile left its report in the cache.

# %%
def bench_kernel(kernel):
    """bf16, fused rounding, head_dim 128 (rungs 1-2 have none), the benchmark's table storage."""
    name = kernel.kernel
    if "__nv_bfloat16, (cookbook::Rounding)0" not in name:
        return False
    if "_v1_" in name or "_v2_" in name:
        return True
    if ", 128" not in name:
        return False
    if "tuned" in name:
        return "TableDtype)0, (cookbook::qk_norm_rope::tuned::TableDtype)1" in name
    return "_v5_" not in name and "_v6_" not in name and "_v7_" not in name or ", __nv_bfloat16, float>" in name


walkthrough.register_table(OP, [impl.name for impl in [*LADDER, TUNED]], bench_kernel,
                           compile_names=[impl.name for impl in LADDER])

# %% [markdown]
# Rung 3 holds the row, its normalized values and their partners; rung 4 holds two vectors a lane
# and their cos/sin; rungs 6 and 7 hold the row's tables across the sum (64 registers: four
# 256-thread blocks per SM). In the tuned kernel the walk that reads its tables after the sum
# (`Walk::kSteps`) keeps fewer registers, so more blocks per SM.
#
# ## 10. Does every implementation agree with the contract?
#
# Every implementation that can run here, on fresh inputs (q and k as strided views into one
# fused qkv tensor), float32 and bf16, both rounding orders, and a case with int32 positions, a
# `position_offset`, Gemma's `weight_offset=1.0` and a bf16 cache, checked against the float64
# value (fused) or the HF-order reference (hf). On a GPU: the vector path, partial rotary and a
# head_dim the vector kernels do not compile; without one, tiny shapes under the simulator.

# %%
AGREE_SHAPES = [(129, 8, 1, 128, 128, True), (7, 4, 2, 128, 64, False), (5, 4, 2, 96, 40, True)]
AGREE_CASES = [dict(dtype=dtype, rounding=rounding) for dtype in (torch.float32, torch.bfloat16) for rounding in ("fused", "hf")]
AGREE_CASES += [dict(dtype=torch.bfloat16, rounding="fused", weight_offset=1.0, position_dtype=torch.int32,
                     position_offset=5, cache_dtype=torch.bfloat16, label="bf16 fused w+1 int32 pos+5 bf16 cache")]
walkthrough.agreement_table(OP, AGREE_SHAPES if session.on_gpu else contract.SIM_SHAPES, AGREE_CASES)

# %% [markdown]
# ## 11. Side by side
#
# Every implementation at the headline shapes (the timings of section 7), time per call and
# percent of the copy:

# %%
walkthrough.timing_table(measured)
for page in walkthrough.results_pages(OP):
    walkthrough.results_link(page)

# %% [markdown]
# At one token every implementation is far from the copy line: the time is launch and latency,
# so one launch beats rung 1's two and the eager reference's many, and rung 6's warmed tables
# shorten what is left. At the image shapes the fused kernels are bandwidth-bound: rung 1 pays
# its float32 round trip, rungs 3 and 4 the width and number of their loads, and from rung 5 on
# the kernels climb towards the copy line.
#
# ## Where to go next
#
# * [`docs/qk_norm_rope.md`](../docs/qk_norm_rope.md): the op page (contract, the ladder, the
#   tuned kernel's policy and the measurements behind it, results against the peers).
# * [`docs/results/qk_norm_rope_h200_history.md`](../docs/results/qk_norm_rope_h200_history.md):
#   how the former versions were measured.
# * `python -m pytest tests/test_qk_norm_rope.py`: the property tests, negative controls and the
#   policy compiled for the host.
