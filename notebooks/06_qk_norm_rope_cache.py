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
# # `qk_norm_rope_cache`: QK norm, RoPE and the paged KV-cache write, in one pass
#
# This walkthrough builds on [`04_qk_norm_rope`](04_qk_norm_rope.ipynb): the same per-head norm and
# rotation of q and k, now followed by what a serving engine does next with k and v: store them
# into its *paged KV cache*, in bf16 or in FP8. Its lesson is the *epilogue fusion*: the k row the
# norm + RoPE kernel holds in registers is exactly the row the cache wants, so the kernel that made
# it stores it twice (into k and into the cache) instead of leaving a second kernel to read it
# back. In the Triton tutorials' order: the contract on a tiny example, FP8's rounding, the napkin
# math, the Numba kernel, a ladder of three CUDA C rungs, the tuned kernel and its policy,
# registers, agreement, timing. Without a GPU the Numba kernel runs under the simulator and the
# timings come from the recorded sweep (`docs/results/`), when there is one.

# %%
import sys
from pathlib import Path

# Run from a checkout (e.g. `notebooks/`): make its packages importable, whether installed or not.
ROOT = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "cookbook" / "walkthrough.py").is_file()), None)
if ROOT is not None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cookbook import walkthrough  # imports neither Numba nor a CUDA extension

session = walkthrough.setup("qk_norm_rope_cache")  # without a GPU: NUMBA_ENABLE_CUDASIM=1, before anything imports Numba

# %%
import torch

import cookbook
from cookbook import registry

OP = "qk_norm_rope_cache"
contract = registry.contract(OP)  # the contract module cookbook/ops/qk_norm_rope_cache.py
FP8 = contract.FP8
torch.set_printoptions(precision=4, linewidth=120, sci_mode=False)

# %% [markdown]
# ## 1. Motivation: after the projection, norm, rope, and into the cache
#
# In every attention layer of a Qwen3-style model an engine runs, per step:
#
# ```python
# q, k, v = qkv_proj(x).split(...)                            # views of one fused tensor
# q, k = qk_norm_rope(q, k, ...)                              # cookbook.qk_norm_rope, in place
# reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)     # a second kernel reads k and v again
# ```
#
# The cache is *paged*: blocks of `block_size` token rows handed to sequences as they grow. Token
# `t`'s place is its *slot* `s = slot_mapping[t]`: block `s // block_size`, row `s % block_size`;
# `-1` means "do not store this token" (padding). At decode the whole op is a few dozen kilobytes,
# so the second kernel is a second launch on the critical path; at prefill, k crosses memory twice.
#
# ## 2. The contract, on a tiny example
#
# Three tokens of one q head and one kv head of 8 dims, a cache of 2 blocks of 2 slots, float32
# so the numbers read easily. Token 1 is skipped (slot -1); token 0 goes to slot 3 (block 1, row
# 1) and token 2 to slot 0:

# %%
tiny = contract.make_inputs(3, 1, 1, 8, False, torch.float32, "cpu", seed=0, block_size=2, num_blocks=2)
tiny["slot_mapping"] = torch.tensor([3, -1, 0])
tiny["k_cache"].zero_()
tiny["v_cache"].zero_()
args, rope = {n: t for n, t in tiny.items() if n != "rope"}, tiny["rope"]
cookbook.qk_norm_rope_cache(**args, is_neox=rope.is_neox, rope_dim=rope.rope_dim, validate_slots=True)
print(f"k (normalized and rotated, in place):\n{args['k'][:, 0]}")
print(f"k_cache, block by block (row 1 of block 1 is token 0, row 0 of block 0 is token 2):\n{args['k_cache'][:, :, 0]}")
print(f"v_cache[0, 0] is v[2]: {torch.equal(args['v_cache'][0, 0], args['v'][2])}")

# %% [markdown]
# **k is written back in place as well as into the cache** (a prefill's attention reads it from
# there). A bad call gets a clear error and writes nothing, on every backend: two tokens with one
# slot, checked because we ask (`validate_slots=True`, a host sync: not under a CUDA graph), and a
# cache that shares memory with v, always checked:

# %%
for label, change in (("two tokens, one slot", dict(slot_mapping=torch.tensor([3, 0, 3]), validate_slots=True)),
                      ("v inside v_cache", dict(v=args["v_cache"].view(4, 1, 8)[:3]))):
    try:
        cookbook.qk_norm_rope_cache(**{**args, **change}, is_neox=True, rope_dim=8)
    except ValueError as error:
        print(f"{label}: ValueError: {str(error)[:160]}...")

# %% [markdown]
# ## 3. FP8: `x / scale`, saturated, rounded to the nearest e4m3
#
# An FP8 cache (`torch.float8_e4m3fn`: 4 exponent bits, 3 mantissa bits, largest value 448, no
# infinity) stores `e4m3(clamp(float32(x) / scale, -448, 448))` with a per-tensor `k_scale` and
# `v_scale`, as vLLM's FP8 cache does. The contract pins the bytes down exactly: torch's
# conversion, nearest with ties to even, of the division (a multiply by a reciprocal alone rounds
# differently in a few values; the tuned kernel corrects it with one fused multiply-add, which
# gives the division's float32). The values between the e4m3 neighbours 1.0 and 1.125, and past
# the largest:

# %%
x = torch.tensor([1.0, 1.03, 1.0625, 1.07, 1.125, 1.1875, 460.0, 1e9])
print("x / 1.0       :", x.tolist())
print("stored (e4m3) :", contract.to_fp8(x, torch.tensor([1.0])).float().tolist())
print("(1.0625 is halfway between 1.0 and 1.125: it goes to the even mantissa, 1.0; 1.1875 to 1.25)")

# %% [markdown]
# The kernels convert with CUDA's `__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3)`
# (one `cvt.rn.satfinite` instruction on Hopper), the Numba kernel with a readable encoder; the
# tests check both against torch on every bf16 value below 1024 and every tie. The reference:

# %%
walkthrough.excerpt("cookbook/ops/qk_norm_rope_cache.py", "def to_fp8(", "@torch.no_grad()")

# %% [markdown]
# ## 4. Napkin math
#
# `bytes_moved` counts what the op must move: q and k read and written, v read, k and v written
# into the caches in the cache's dtype, per token its position, slot and cos/sin row. The split
# path (norm + rope, then a cache write) reads k once more:

# %%
copy_tb_per_s, copy_source = walkthrough.copy_ceiling(OP)
print(f"copy ceiling: {copy_tb_per_s:.2f} TB/s ({copy_source})\n" if copy_tb_per_s else f"no copy ceiling: {copy_source}\n")
for shape in contract.BENCH_SHAPES:
    inputs, label = contract.bench_case(shape, torch.bfloat16, "meta")
    a = contract.check_inputs(**inputs, eps=1e-6, weight_offset=0.0, rounding="fused")
    moved = contract.bytes_moved(a.q, a.k, a.v, a.q_weight, a.k_weight, a.cos_sin_cache, a.positions, a.k_cache,
                                 a.slot_mapping)
    extra = contract.split_extra_bytes(a.k)
    at_ceiling = f", {moved / (copy_tb_per_s * 1e12) * 1e6:.2f} us at the copy ceiling" if copy_tb_per_s else ""
    print(f"{label:<40} {moved / 1e6:9.3f} MB (split path: +{100 * extra / moved:.1f} %){at_ceiling}")

# %% [markdown]
# At decode the op is tens of kilobytes: time is launches and dependent round trips, and the split
# path adds a whole launch. At prefill it is bandwidth: fusing saves k's second read, 7.5 % of the
# bytes with a bf16 cache and 8.2 % with an FP8 one.
#
# ## 5. The Numba kernel
#
# `kernels_numba/qk_norm_rope_cache.py` is the split path in Numba, the readable algorithm of the
# cache write: qk_norm_rope's Numba kernel, then a copy kernel, a warp per (token, kv head). Its
# FP8 encoder builds the byte from the exponent and a rounded mantissa:

# %%
walkthrough.excerpt("kernels_numba/qk_norm_rope_cache.py", "def e4m3_bits(", "@functools.cache")

# %% [markdown]
# ## 6. Climbing the ladder: three CUDA C kernels
#
# Each rung is one file, readable alone, its first line its lead; the page's ladder table has them
# with their registers and bytes. The timings below are measured now on a GPU, or recalled from
# the recorded sweep:

# %%
LADDER = registry.implementations(OP, ("cuda",))
TUNED = registry.get(OP, "cuda_tuned")
HEADLINE = [(1, 32, 8, 128, 0), (256, 32, 8, 128, 0), (8192, 32, 8, 128, 0), (1, 32, 8, 128, 1), (8192, 32, 8, 128, 1)]
TIMED = ["reference", *(impl.name for impl in LADDER), TUNED.name, "torch_compile", "ours_then_index_copy"]
measured = walkthrough.measure_or_recall(OP, TIMED, HEADLINE)

# %% [markdown]
# ### Rungs 1 and 2: the split path, then one pass
#
# Rung 1 is what engines run: qk_norm_rope's tuned kernel, then a copy kernel that reads k back.
# Rung 2 is one kernel over every q, k and v row of a token, a lane group per row: a k row is
# stored twice from the same registers, a v row goes straight to its slot (before the group's
# sum, which it only joins, so its vectors are not held across it):

# %%
walkthrough.show_kernel(OP, "cuda_v2")
print()
walkthrough.effect(measured, "cuda_v1", "cuda_v2")

# %% [markdown]
# ### Rung 3: a programmatic launch, the tables warmed while it waits
#
# The kernel's blocks become resident while the previous kernel drains; during the wait they warm
# the weights, each token's position, slot and cos/sin run into L2, and after it read them with
# the row (qk_norm_rope's rung 6 idea). The diff against rung 2:

# %%
walkthrough.diff_rungs(OP, 3, max_lines=40)
print()
walkthrough.effect(measured, "cuda_v2", "cuda_v3")

# %% [markdown]
# ## 7. The tuned kernel and its policy
#
# Rung 3's kernel in fewer registers: the weights held as loaded (bf16 pairs) and widened at their
# use, rows and slots divided by multiply-high in 32 bits; 61 registers instead of 76 let four
# blocks of 256 threads share an SM instead of three, a third more rows in flight at prefill. A v
# unit (two neighbouring vectors) goes to an FP8 cache as one 16-byte store, its `x / scale` with
# no division (the inverse's product, corrected). With a bf16 cache the
# grid is cut to the resident blocks and each lane group walks rows a grid apart, prefetching its
# next row into L2 while the current one is in flight (`waves` below). One host policy: the
# one-pass kernel where every tensor is whole 16-byte vectors and head_dim is compiled, the split
# path otherwise (qk_norm_rope's warp per row, then rung 1's copy kernel). `cookbook.explain` asks it:

# %%
for shape in HEADLINE:
    try:
        answer = cookbook.explain(OP, shape=shape)
    except RuntimeError as error:  # without a GPU the policy compiled for the host needs nvcc
        print(error)
        break
    plan = answer.plan
    print(f"{shape}: {plan['path']}, {plan['kernel'].rsplit('::', 1)[1]}, grid {int(plan['grid']):,} x {plan['block']}, "
          f"waves {plan.get('waves', '-')}")
walkthrough.effect(measured, "cuda_v3", "cuda_tuned")

# %% [markdown]
# ## 8. What the compiler says: registers per kernel
#
# bf16, fused rounding, head_dim 128, NeoX, the benchmark's tables, both caches:

# %%
def bench_kernel(kernel):
    name = kernel.kernel
    if "copy_kernel<__nv_bfloat16" in name:
        return True
    return "__nv_bfloat16, (cookbook::Rounding)0, 128, " in name and ("true, __nv_bfloat16, float," in name or
                                                                     "Layout)1, (cookbook::qk_norm_rope::tuned::TableDtype)0, (cookbook::qk_norm_rope::tuned::TableDtype)1" in name)


walkthrough.register_table(OP, [impl.name for impl in [*LADDER, TUNED]], bench_kernel)

# %% [markdown]
# ## 9. Does every implementation agree with the contract?
#
# q and k within the contract's tolerances, the caches within them too (an FP8 cache in e4m3
# ulps); the tests go further and compare the caches' bytes with torch's conversion of the k each
# kernel wrote, bit for bit. Shapes are (tokens, q heads, kv heads, head_dim, fp8):

# %%
AGREE_SHAPES = [(129, 8, 1, 128, 1), (7, 4, 2, 128, 0), (5, 4, 2, 96, 1)]
AGREE_CASES = [dict(dtype=dtype, rounding=rounding) for dtype in (torch.float32, torch.bfloat16) for rounding in ("fused", "hf")]
walkthrough.agreement_table(OP, AGREE_SHAPES if session.on_gpu else contract.SIM_SHAPES, AGREE_CASES)

# %% [markdown]
# ## 10. Side by side
#
# The tuned kernel against the split paths (ours then torch's `index_copy_`; with the peers
# installed, ours then FlashInfer's `append_paged_kv_cache`, SGLang's norm + RoPE then its cache
# store) is the results page's, written by `python -m cookbook bench --ops qk_norm_rope_cache`:

# %%
walkthrough.timing_table(measured)
for page in walkthrough.results_pages(OP):
    walkthrough.results_link(page)

# %% [markdown]
# ## Where to go next
#
# - [`docs/qk_norm_rope_cache.md`](../docs/qk_norm_rope_cache.md): the contract as a table, the
#   generated ladder and which-kernel tables, the results against the peers once measured.
# - `python -m cookbook explain qk_norm_rope_cache --shape T,HQ,HK,D,FP8 --gpu h100`: the policy's
#   answer for any call.
