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
# The second walkthrough builds on [`01_qk_norm`](01_qk_norm.ipynb): the same per-head RMSNorm,
# now followed by the rotary embedding (RoPE) in the same kernel. The order is the Triton
# tutorials' again: why the op exists, its math and contract on a tiny example (NeoX and
# interleaved pairs, partial rotary), the PyTorch reference, the napkin math, why fusing saves a
# whole read and write of q and k, the Numba kernel, the numbered CUDA C versions, the
# compiler's resource report, an agreement check of every implementation, and the benchmark.
#
# It runs top to bottom on a laptop: without a GPU the Numba kernel runs under Numba's CUDA
# simulator on tiny shapes and the timing cells show what the benchmark recorded on a GPU
# (`docs/results/`) instead of measuring. Every number printed below is computed here (or read
# from a results page the benchmark wrote); the code shown is read from the tested sources, never
# pasted.
#
# **The first cell matters**, as in 01: Numba reads `NUMBA_ENABLE_CUDASIM` once, when it is first
# imported, so on a machine without a GPU `walkthrough.setup()` switches the simulator on before
# anything imports Numba, and leaves an explicit choice of yours alone. `cookbook/walkthrough.py`
# holds what every notebook here shares: setup, agreement tables, timing, plots and short
# excerpts of the sources.

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
from cookbook.testing import agreement

OP = "qk_norm_rope"
contract = registry.contract(OP)  # the contract module cookbook/ops/qk_norm_rope.py
EPS = 1e-6
torch.set_printoptions(precision=4, linewidth=120, sci_mode=False)

# %% [markdown]
# ## 1. Motivation: QK norm, then RoPE, on every attention layer
#
# The diffusion transformers FLUX and Qwen-Image normalize the queries and keys **per head**
# (RMSNorm over `head_dim`, as Qwen3 does) and then apply the rotary embedding, in every
# attention layer of every denoising step. In essence:
#
# ```python
# q = q_norm(q_proj(x).view(T, -1, head_dim))     # per-head RMSNorm, weight [head_dim]
# k = k_norm(k_proj(x).view(T, -1, head_dim))
# q, k = apply_rope(q, k, cos[pos], sin[pos])     # rotate pairs of dims by a position-dependent angle
# out = attention(q, k, v)
# ```
#
# FLUX's dual-stream blocks run text and image tokens with different position ranges (our
# `position_offset`); Qwen-Image and some other models rotate only part of each head (partial
# rotary, our `rope_dim < head_dim`). At 1024x1024 an image is 4096 tokens of 24 (FLUX) or
# 32 (Qwen-Image) heads of 128: each of the two steps is a full pass over q and k, and both are
# memory-bound. Fusing them is the subject of this notebook.
#
# ## 2. The math and the contract
#
# Per (token, head) row `x`: first `qk_norm`'s `n = x * rsqrt(mean(x^2) + eps) * (w + weight_offset)`,
# then each pair `(a, b)` of the first `rope_dim` dims of `n` turns by the angle of the token's
# position. The contract module is the specification (its docstring, from the source):

# %%
print(contract.__doc__)

# %% [markdown]
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
# NaN while its pass-through dims are normalized as usual. `validate_positions=True` checks the
# range on the host first (one sync) and raises, with nothing written.

# %%
at_zero = {n: t.clone() for n, t in tiny.items() if n != "rope"}
at_zero["positions"].fill_(0)
cookbook.qk_norm_rope(**at_zero, eps=EPS, backend="reference")
print(f"position 0 leaves the normalized row unchanged: {torch.allclose(at_zero['q'], normed['q'])}")

out_of_range = {n: t.clone() for n, t in tiny.items() if n != "rope"}
cookbook.qk_norm_rope(**out_of_range, eps=EPS, position_offset=10, backend="reference")  # 1 + 10 >= 4 rows
print(f"position 1 + offset 10 in a 4-row cache: q out = {out_of_range['q'][0, 0]}")

checked = {n: t.clone() for n, t in tiny.items() if n != "rope"}
try:
    cookbook.qk_norm_rope(**checked, eps=EPS, position_offset=10, validate_positions=True, backend="reference")
except ValueError as error:
    print(f"validate_positions=True: ValueError: {error}")
print(f"nothing written: {torch.equal(checked['q'], tiny['q'])}")

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
        print(("PASS  " if verdict.ok else "REJECT") + f"  {verdict.message}")

# %% [markdown]
# **Bad input** raises before anything is written, with a message that names the argument, its
# shape, stride and dtype, and what was expected. Two examples (a cache whose width is not
# `rope_dim`, float positions):

# %%
bad_cases = {
    "rope_dim=6 with an 8-wide cache": dict(rope_dim=6),
    "float32 positions": dict(positions=tiny["positions"].float()),
}
for what, change in bad_cases.items():
    run = {n: t.clone() for n, t in tiny.items() if n != "rope"}
    run.update({n: v for n, v in change.items() if n == "positions"})
    try:
        cookbook.qk_norm_rope(**run, eps=EPS, **{n: v for n, v in change.items() if n != "positions"})
    except (TypeError, ValueError) as error:
        print(f"{what}: {type(error).__name__}: {error}")
    print(f"  q unchanged: {torch.equal(run['q'], tiny['q'])}")

# %% [markdown]
# ## 3. The reference
#
# The reference is the math in readable PyTorch and the oracle of every test (it also runs in
# float64 for the exact value). This is the tested source:

# %%
for fn in (contract.cos_sin_rows, contract.pair_slices, contract.rotate, contract.qk_norm_rope_rows, contract.reference):
    print(inspect.getsource(fn))

# %% [markdown]
# ## 4. Napkin math: how fast can it be?
#
# A fused kernel must read q and k once and write them once; per token it also reads its
# position and one cache row, and the weights once per launch. `contract.bytes_moved` is that
# minimum. The shapes are the benchmark's (`contract.BENCH_SHAPES`), built on the `meta` device
# (shapes and dtypes only, no memory), divided by a device-to-device copy bandwidth: the
# practical ceiling of a memory-bound kernel, measured now on a GPU, or else the copy the
# benchmark measured with its recorded sweep.

# %%
NAMED_SHAPES = {  # the named shapes of the op page, all in contract.BENCH_SHAPES
    "decode": (64, 32, 8, 128, 128, True),
    "flux_1024": (4096, 24, 24, 128, 128, True),
    "qwen_image_1024": (4096, 32, 32, 128, 128, True),
    "qwen_image_partial": (4096, 32, 32, 128, 64, True),
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
    at_ceiling = f", {moved / (copy_tb_per_s * 1e12) * 1e6:.3f} us at the copy ceiling" if copy_tb_per_s else ""
    print(f"{name} ({label}): {moved / 1e6:.3f} MB moved{at_ceiling}")

# %% [markdown]
# At the diffusion shapes the op is a bandwidth problem (tens of microseconds at the copy
# bandwidth); at the decode shape the bytes take well under a microsecond, so there launch
# overhead and latency decide.
#
# ## 5. Why fusing saves a full read and write of q and k
#
# The unfused pipeline every engine started from is two passes: a norm kernel reads q and k and
# writes them, then a rope kernel reads them again, reads the cache rows, and writes them
# again. The fused op does the rotation while the normalized row is still in registers. Counting
# bytes for the unfused pair (the rope pass reading the same cache rows and positions), and for
# our CUDA C v1, whose norm kernel writes float32 rows to a scratch buffer so that the rotation
# does not add a rounding the fused contract forbids:

# %%
def unfused_bytes(shape):
    tensors, _ = meta_case(shape)
    q, k = tensors["q"], tensors["k"]
    act = (q.numel() + k.numel()) * q.element_size()  # q and k once, in the activation dtype
    scratch = (q.numel() + k.numel()) * 4  # float32 rows
    fused = contract.bytes_moved(**tensors)  # includes positions, cache rows and weights, read once
    return fused, fused + 2 * act, fused + 2 * scratch  # + the norm's write and the rope's read of q and k


print(f"{'shape':<20} {'fused MB':>9} {'norm + rope MB':>15} {'v1 (fp32 scratch) MB':>21}")
for name, shape in NAMED_SHAPES.items():
    fused, pair, v1 = unfused_bytes(shape)
    print(f"{name:<20} {fused / 1e6:9.1f} {pair / 1e6:15.1f} {v1 / 1e6:21.1f}   "
          f"(pair {pair / fused:.2f}x, v1 {v1 / fused:.2f}x the fused minimum)")

# %% [markdown]
# The unfused pair moves about twice the minimum (q and k written and read back once more), and
# v1's float32 scratch makes the round trip twice as wide in bf16: about three times the
# minimum. The eager reference is worse still: a `TorchDispatchMode` logs every ATen op it runs
# on the same meta tensors, charging each op the bytes of its tensor arguments read plus its new
# result written (on a GPU each is roughly one kernel launch):

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


FLUX = NAMED_SHAPES["flux_1024"]
flux_tensors, flux_label = meta_case(FLUX)
flux = contract.check_inputs(**flux_tensors, eps=EPS, weight_offset=0.0, rounding="fused",
                             rope=contract.Rope(*FLUX[5:], FLUX[4]))
with OpLog() as log:
    contract.reference(flux.q, flux.k, flux.q_weight, flux.k_weight, flux.cos_sin_cache, flux.positions, flux.eps,
                       flux.weight_offset, flux.rounding, flux.is_neox, flux.rope_dim, flux.position_offset)
eager_bytes = sum(read + written for _, read, written in log.ops)
flux_bytes = contract.bytes_moved(**flux_tensors)
print(f"{flux_label}: the eager reference dispatches {len(log.ops)} ATen ops, {eager_bytes / 1e6:.0f} MB moved "
      f"= {eager_bytes / flux_bytes:.1f}x the fused minimum of {flux_bytes / 1e6:.0f} MB")

# %% [markdown]
# ## 6. The Numba kernels
#
# One warp per (token, head) row, q and k rows numbered one after the other so both go in one
# launch. In v1 each lane reads its elements once into a local array, a warp-level sum gives the
# row's sum of squares, and the rotation's partner element, which another lane holds, comes over
# a warp shuffle: for interleaved pairs the neighbouring lane, for NeoX pairs the lane
# `rope_dim/2` columns away (possibly in another slot). Its docstring, then the kernel (the
# inner function of its factory, `make_qk_norm_rope_kernel`), from the source:

# %%
import kernels_numba.helpers as numba_helpers
import kernels_numba.qk_norm_rope as numba_qk_norm_rope

print(numba_qk_norm_rope.__doc__)

# %%
walkthrough.excerpt("kernels_numba/qk_norm_rope.py", "def qk_norm_rope_kernel(q, k", "return qk_norm_rope_kernel")

# %% [markdown]
# The shuffle comes from the shared helpers. On a GPU it is `shfl_sync`; the simulator has no
# warp shuffles, so there the lanes exchange values through shared memory, with barriers, which
# is why the kernel never returns early and every lane makes every shuffle:

# %%
print(inspect.getsource(numba_helpers._warp_shfl_shuffle))
print(inspect.getsource(numba_helpers._warp_shfl_shared))
chosen = "_warp_shfl_shared" if numba_helpers.warp_shfl is numba_helpers._warp_shfl_shared else "_warp_shfl_shuffle"
print(f"on this machine warp_shfl is {chosen} (simulator: {numba_helpers.SIMULATOR})")

# %% [markdown]
# v2 applies to Numba what the CUDA C kernels learned from v2 on: a lane owns whole rotation
# pairs. Pair i = lane + 32 j is columns (i, i + rope_dim/2) for NeoX or (2i, 2i + 1)
# interleaved; the lane reads both members and cos_i, sin_i once, so no shuffle fetches a
# partner (the only shuffle left is the sum of squares) and each cos/sin element is read once
# per row instead of once per member. The slot counts are fixed when the kernel is built, from a
# head_dim bucket (the next power of two), so every loop has a constant trip count and the
# local arrays live in registers. On the H200 that is 2.3x faster than v1 at the diffusion shapes
# (docs/qk_norm_rope.md); the gap left to CUDA C is instruction issue, section 9 of the docs
# page has the counters.

# %%
walkthrough.excerpt("kernels_numba/qk_norm_rope.py", "def qk_norm_rope_kernel_v2(q, k", "return qk_norm_rope_kernel_v2")

# %% [markdown]
# v3 (`make_qk_norm_rope_kernel_v3` in `kernels_numba/qk_norm_rope.py`) keeps v2's algorithm and
# takes instructions out, each cut checked by counting the PTX Numba emits (`tools/numba_ptx.py`,
# no GPU needed). A bf16 row is viewed as int32 words, two columns per load and store, widened
# by a shift and a mask and narrowed by one `cvt.rn.bf16x2.f32`; a row runs on 16 lanes at
# head_dim 128, the grid is (tokens, head groups) so no division finds a row, and unsigned ids
# let Numba drop Python's negative-index wraparound. Where the word path cannot apply (fp16 or
# float32 activations, NeoX with rope_dim not a multiple of 4, an odd offset) it runs v2. On the
# H200 that is 3.3x to 3.8x faster than v2, 1.2x to 1.6x behind the CUDA C kernel
# (docs/qk_norm_rope.md); the bench below runs it beside the others.

# %% [markdown]
# ## 7. The CUDA C versions, and the flaw each one fixes
#
# The kernels live in the torch-free header `kernels_cuda/qk_norm_rope.cuh` as numbered
# versions. The registry is the list; each version's lead says what changed and which bottleneck
# it removes, and a test keeps the header's `// vN:` lines identical to these leads:

# %%
cuda_versions = registry.implementations(OP, ("cuda",))
for impl in cuda_versions:
    print(f"v{impl.version} ({impl.name}): {impl.lead}")
print(f"\nbackend='cuda' runs the last one: {registry.latest(OP, 'cuda').name}")

# %% [markdown]
# The header is long (`kernels_cuda/qk_norm_rope.cuh`, each version in a section that opens with
# its lead). Two kernels carry the lessons below. v2 fuses the norm and the rotation in one warp
# per row, a lane owning whole (a, b) pairs:

# %%
walkthrough.show_kernel(OP, "cuda_v2")

# %% [markdown]
# v4 holds a row as pairs of 16-byte vectors, the a and b members of the same rotation pairs in
# one lane (its launch geometry, `V4Traits`, derives the units per lane and asserts that a head
# is a whole number of them); its first 60 lines, up to the loads of a row:

# %%
walkthrough.show_kernel(OP, "cuda_v4")

# %% [markdown]
# Reading them in order:
#
# * **v1** is the unfused pair: a warp-per-row norm kernel writes float32 rows to a scratch
#   buffer, then a thread-per-element rope kernel reads them back, rotates and writes the output.
#   Two launches and, in bf16, a round trip through memory twice as wide as the activations.
# * **v2** fuses the two into one warp per (token, head): a lane owns whole (a, b) pairs (for
#   NeoX it reads both halves, each coalesced across the warp), so no partner exchange is needed.
#   It reads the row twice (a sum-of-squares pass, then the rotate-and-write pass) with narrow
#   loads, and every head re-reads its token's cos/sin. It works for any even head_dim and
#   rope_dim and any alignment, so it is also v3's general path.
# * **v3** holds the row in registers as 16-byte vectors (qk_norm v3's geometry), fetches the NeoX
#   partner vector by a shuffle (or from another of the lane's own vectors), reads a token's
#   cos/sin once for a run of its heads, and runs on a persistent grid. It needs head_dim 64, 128,
#   256 or 512, 16-byte aligned rows and `rope_dim` a multiple of two vectors (16 elements in
#   bf16), so that a vector is wholly rotated or wholly passed through; anything else runs v2.
# * **v4** changes which lane holds what. A row's vectors are taken two at a time: for NeoX a
#   lane holds vector u of the first half *and* its partner u + h of the second half, so the a
#   and b members of the same pairs sit in one thread. No shuffle fetches a partner, one run of
#   cos and one of sin serve both vectors (interleaved: two neighbouring vectors, whose pairs
#   are inside each), and the lane keeps only the row it works on: the weights and cos/sin are
#   re-read per row and hit L1, because a token's heads are neighbouring rows handled by
#   neighbouring groups at the same moment. Same preconditions as v3 (its traits, `V4Traits`,
#   assert that a head is a whole number of two-vector units).
# * **v5** keeps v4's geometry and removes instructions. v4's SASS showed, per row and lane, the
#   NeoX/interleaved choice evaluated inside the rotation; loads for *both* storage types of the
#   weights and of the cos/sin cache (a runtime flag the compiler turned into predication, so
#   both paths issue); every bf16 moved into its own register before being widened; and x read
#   by generic `LD` (the row pointer is chosen at run time between q and k). v5 makes the layout
#   a template parameter, compiles the row walk once per (weight dtype, cache dtype) and branches
#   into the right one once per kernel, unpacks and packs bf16 two per instruction (a shift and
#   a mask; one `F2FP` per pair), computes the fused-order scale as `x * fma(w, rstd, rstd *
#   offset)`, and reads and writes x with streaming global accesses (tables through the
#   read-only path). Registers drop from 64 to 57 (NeoX) and 48 (interleaved).
# * **v6** is v5's kernel launched as a *programmatic dependent launch* (a launch attribute,
#   sm_90+): its CTAs may become resident while the previous kernel in the stream is still
#   finishing, and their first instruction, `griddepcontrol.wait`, holds them until that kernel
#   has completed and its writes are visible; then `griddepcontrol.launch_dependents` lets the
#   next launch do the same. Nothing changes in the arithmetic or the registers; what goes is
#   the gap between two kernels, which at decode sizes is a large part of a call.
# * **v7** takes the divisions off the device. v4's walk starts by splitting the group's first
#   row and the grid's stride into (token, head) with 64-bit `/` and `%`: two calls into the
#   64-bit division routine in the SASS, before the first load. v7's launcher computes the
#   stride's tokens and heads once, and the first row is split by a multiply-high with a magic
#   number (`FastDivisor`, as qk_norm v8). Where the rows fit in one trip of the grid (decode),
#   each lane group takes exactly one row, `block * groups + group`, with no loop at all:
#   2.40 -> 1.99 us at 64 tokens, 1.90 -> 1.49 at one token.
# * **v8** warms the decode kernel's tables before the wait. A decode row waited for two DRAM
#   round trips in a row: its position, then the cos/sin run that position picks. While the
#   previous kernel still runs, v8 prefetches into L2 (`prefetch.global.L2`, which returns
#   nothing and cannot make a later read stale) the weights, by block 0, and each token's
#   position and cos/sin run, by the lane group of its first head; the cos/sin run is aimed by a
#   speculative read of the position that is used for nothing else and read again after the
#   wait. After the wait they are L2 hits, loaded with the row: 1.99 -> 1.75 us at 64 tokens,
#   1.53 -> 1.24 at one token.
# * **v9** holds the walk's weights. A row's weight is q's or k's, the same for every head of its
#   tensor, yet v5-v8's walk read its two weight vectors per lane for every row, between the sum
#   and the store. v9's launcher cuts the persistent grid to a whole number of tokens' rows, so
#   a step of the walk is whole tokens and every lane group stays on one head: it reads that
#   head's weight once, after the wait, and holds it as floats. Where the cut would leave more
#   than 1/32 of the resident blocks out or lengthen a walk, v9 runs v8. The kernel is compiled
#   per (weight, cache) storage pair rather than branching into one of four loops, so its
#   registers are that pair's own. On the H200: 85.1 -> 85.9 % of the copy at `flux_1024`
#   NeoX, 85.9 -> 86.9 % at `qwen_image_partial`.
#
# ## 8. What the compiler says: registers per kernel
#
# `nvcc` alone (no GPU) compiles every kernel of the header; `ptxas -v` reports registers and
# spills per instantiation. A memory-bound kernel needs many warps in flight to hide DRAM
# latency, and registers per thread bound how many an SM can hold (`walkthrough.warps_allowed`:
# 64K 32-bit registers and at most 64 warps per SM on sm_90). The bf16 kernels at head_dim 128
# (v1 and v2 are not specialized on head_dim; the other head_dims v3 to v9 compile, 64, 256 and
# 512, are in the same report):

# %%
if nvcc_report.nvcc() is None:
    print("nvcc is not on PATH: skipping the compiler's resource report (CI and GPU machines have it).")
else:
    kernels = nvcc_report.compile_header(OP)
    # From the mangled names, which read the same whatever demangler a machine has:
    # qk_norm_rope_v3_kernelI13__nv_bfloat16Li128ELb0E is v3<bf16, head_dim 128, fused>;
    # v1 has two kernels, qk_norm_rope_v1_norm_kernel and qk_norm_rope_v1_rope_kernel; v5 one per
    # layout (its next flag: 1 NeoX, 0 interleaved); v6 is v5's kernel with its programmatic flag
    # set, v7 the same with its walk (last argument) 1: the launcher's steps, or 2: one row; v8's
    # walk 3 is the one-row kernel with its tables warmed before the wait. v9's kernel is compiled
    # per storage pair of the weights and the cache (the mangled types after its layout flag:
    # S2_ repeats the activation dtype, f is float32); the table keeps the benchmark's pair, bf16
    # weights and a float32 cache (S2_f).
    name = re.compile(r"qk_norm_rope_v(\d+)_(norm_|rope_)?kernelI13__nv_bfloat16(?:Li(\d+)E)?Lb([01])E(?:Lb([01])E)?"
                      r"(?:Lb([01])E)?(?:Li(\d)E)?((?:S\d+_|f){2})?")
    print(f"{OP}.cuh compiled for {nvcc_report.DEFAULT_ARCH}: {len(kernels)} kernels; bf16:\n")
    table = []
    for k in kernels:
        m = name.search(k.mangled)
        if not m or (m.group(1) == "9" and m.group(8) != "S2_f") or m.group(3) not in (None, "128"):
            continue
        part = (m.group(2) or "").rstrip("_") or {"1": "NeoX", "0": "interleaved"}.get(m.group(5), "single")
        walk = m.group(7) or "0"
        version = 8 if walk == "3" else 7 if walk != "0" else 6 if m.group(6) == "1" else int(m.group(1))
        part += {"1": ", walk", "2": ", one row", "3": ", one row, warmed"}.get(walk, "")
        table.append((version, part, int(m.group(3) or 0), "hf" if m.group(4) == "1" else "fused",
                      k.registers, k.spill_bytes, walkthrough.warps_allowed(k.registers)))
    print("| version | kernel | head_dim | rounding | registers | spill bytes | warps/SM the registers allow |")
    print("|---|---|---|---|---|---|---|")
    for version, part, head_dim, rounding, registers, spills, warps in sorted(table):
        print(f"| v{version} | {part} | {head_dim or 'any'} | {rounding} | {registers} | {spills} | {warps} |")

# %% [markdown]
# (The last column counts registers only; block size and shared memory can lower it further.)
# v3 holds the whole row as vectors *and* both weight vectors and its cos/sin in registers, so it
# needs far more registers than v2 and fits fewer warps per SM: fewer bytes in flight. v4 gives
# some of them back (it re-reads the weights and cos/sin from L1 per row instead of keeping
# them), and each of its lanes has two 16-byte vectors of x in flight instead of one: that, and
# the shuffles and half the cos/sin loads it no longer issues, is what the benchmark below
# measures. v5 gives back more (57 NeoX, 48 interleaved) by issuing fewer instructions. The Nsight Compute counters of every version (achieved occupancy, issue slots,
# stall reasons) are recorded in `docs/results/qk_norm_rope_h200_ncu.md`.
#
# ## 9. Does every implementation agree with the contract?
#
# We iterate the registry: every implementation that can run on this machine runs on fresh
# inputs (q and k as strided views into one fused qkv tensor) in float32 and bf16, both rounding
# orders, and a case with int32 positions, a `position_offset`, Gemma's `weight_offset=1.0` and
# a bf16 cache; each is checked against the float64 value (fused) or the HF-order reference
# (hf). Peers are timed below, not checked here; skipped implementations say why. Without a GPU
# the shapes are tiny (`contract.SIM_SHAPES`: NeoX, and partial interleaved with a rope_dim that
# is not a power of two): every simulated GPU thread is a Python thread.

# %%
AGREE_SHAPES = [(129, 8, 1, 128, 128, True), (7, 4, 2, 128, 64, False), (5, 4, 2, 96, 40, True)]  # v3, partial, general
AGREE_CASES = [dict(dtype=dtype, rounding=rounding) for dtype in (torch.float32, torch.bfloat16) for rounding in ("fused", "hf")]
AGREE_CASES += [dict(dtype=torch.bfloat16, rounding="fused", weight_offset=1.0, position_dtype=torch.int32,
                     position_offset=5, cache_dtype=torch.bfloat16, label="bf16 fused w+1 int32 pos+5 bf16 cache")]
walkthrough.agreement_table(OP, AGREE_SHAPES if session.on_gpu else contract.SIM_SHAPES, AGREE_CASES)

# %% [markdown]
# ## 10. Side by side
#
# Every implementation at the named shapes: on a GPU timed now by the benchmark's own machinery
# (`cookbook.bench`: agreement first, then CUDA-graph replay over rotating input sets, percent of
# a device-to-device copy measured in the same run), else read from the sweep the benchmark
# recorded in `docs/results/` (`python -m cookbook bench --ops qk_norm_rope --results-dir
# docs/results` on a GPU writes it, with the GPU, date, commit and command on the page).
#
# The named shapes differ in heads and rope_dim, not in tokens, so instead of lines against
# tokens we draw one bar per implementation and shape.

# %%
import matplotlib.pyplot as plt


def plot_rows(rows, title):
    """Percent of copy and latency per shape, one bar per implementation."""
    timed = [r for r in rows if r["op"] == OP and r["median_us"] is not None]
    if not timed:
        print("no timed rows to plot")
        return
    labels = list(dict.fromkeys(r["label"] for r in timed))
    impls = list(dict.fromkeys(r["impl"] for r in timed))
    width = 0.8 / len(impls)
    fig, axes = plt.subplots(1, 2, figsize=(14, 1.2 + 0.9 * len(labels)))
    for ax, (column, label) in zip(axes, reversed(bench.PLOTS.values())):
        for i, impl in enumerate(impls):
            values = [next((r[column] for r in timed if r["label"] == s and r["impl"] == impl), 0) for s in labels]
            ax.barh([y + i * width for y in range(len(labels))], values, height=width, label=impl)
        if column == "pct_of_copy":
            ax.axvline(100, color="gray", linestyle="--", linewidth=1, label="device copy")
        else:
            ax.set_xscale("log")
        ax.set_yticks([y + 0.4 - width / 2 for y in range(len(labels))], labels, fontsize="small")
        ax.invert_yaxis()
        ax.set_xlabel(label)
        ax.grid(True, axis="x", which="both", alpha=0.3)
    axes[0].legend(fontsize="small")
    axes[1].set_yticklabels([])
    fig.suptitle(f"{OP}: {title}")
    fig.tight_layout()


measured = walkthrough.measure_or_recall(OP, [impl.name for impl in registry.implementations(OP)],
                                         list(NAMED_SHAPES.values()))
walkthrough.timing_table(measured)
plot_rows(measured.rows, measured.source.splitlines()[0])
for page in walkthrough.results_pages(OP):
    walkthrough.results_link(page)

# %% [markdown]
# In the plot above (when there is one) we can see the two regimes the napkin math predicted. At
# one token every implementation is far below the copy line: the time is launch and latency, so
# one fused launch beats v1's two and the eager reference's many. At the large shapes the fused
# kernels pull ahead of `torch.compile` and of v1, which pays its float32 scratch round trip,
# and v4 pulls well ahead of v3 (section 7: pair-owning lanes, no partner shuffles). v4 was
# still short of the copy line with its schedulers busy in about two thirds of the cycles: it
# was issuing instructions about as fast as it could. v5 issues fewer per element (section 7):
# on the H200 that took the diffusion shapes from 62-63 % to 83-86 % of the copy bandwidth.
# The table above the plot gives, per shape, each implementation's time and share of the copy,
# the eager PyTorch reference and `torch.compile` among them.
#
# ## Where to go next
#
# * [`docs/qk_norm_rope.md`](../docs/qk_norm_rope.md): the op page (contract, versions, caveats,
#   results, what to try next); the recorded sweep
#   [`docs/results/qk_norm_rope_h200.md`](../docs/results/qk_norm_rope_h200.md).
# * `python -m cookbook bench --ops qk_norm_rope --shapes full` on a GPU: the whole sweep,
#   including the decode shape and every named diffusion shape.
# * `python -m pytest tests/test_qk_norm_rope.py`: the property tests and negative controls.
