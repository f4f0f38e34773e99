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
# # Getting started with the Fused Norm Cookbook
#
# The cookbook holds the fused normalization kernels that LLM and diffusion inference engines run
# in every attention layer. Each op exists three times, and the three provably agree: a PyTorch
# reference, Numba CUDA kernels (`kernels_numba/`) and CUDA C kernels (`kernels_cuda/`). Where
# things are:
#
# * `cookbook/api.py`: the public ops (`cookbook.qk_norm`, ...): check the arguments once, pick
#   an implementation, run it in place;
# * `cookbook/ops/<op>.py`: each op's contract (math, checks, reference, inputs, tolerances,
#   bytes moved);
# * `cookbook/registry.py`: the only list of implementations, which tests, the benchmark and the
#   notebooks iterate;
# * `cookbook/bench/`: the benchmark (a package: `sweep` on a GPU, `tour` on a CPU, `timing`,
#   `tables`, `pages`, and `tp` for the collective op);
# * `cookbook/walkthrough.py`: what the notebooks share.
#
# `qk_norm` is laid out as a teaching **ladder**: `kernels_cuda/qk_norm/v1_*.cuh` to `v6_*.cuh`,
# each a standalone kernel that fixes one named bottleneck of the rung below, plus `tuned.cuh`,
# the production kernel. Every other op follows the same layout (`kernels_cuda/<op>/`).
#
# **Install** (from a checkout), to open the notebooks in Jupyter, or to run them (and the tests)
# without it:
#
# ```bash
# python -m pip install -e ".[notebooks]" && jupyter lab     # Jupyter and what the notebooks import
# python -m pip install -e ".[test]"                         # then: jupyter execute 00_getting_started.ipynb
# ```
#
# Without a GPU everything here still runs: the reference on the CPU, and the Numba kernels under
# Numba's CUDA simulator, which must be switched on *before Numba is first imported* (Numba reads
# `NUMBA_ENABLE_CUDASIM` once). That is what `walkthrough.setup()` in the first cell does.

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
import torch

import cookbook
from cookbook import registry

print(f"cookbook {cookbook.__version__}: {', '.join(cookbook.__all__)}")

# %% [markdown]
# ## Calling an op
#
# `cookbook.qk_norm` normalizes q and k per head, in place, and returns them. Here q and k are
# views into one fused qkv tensor, as an engine's QKV projection leaves them; the contract
# module's `make_inputs` builds seeded inputs like that.

# %%
contract = registry.contract("qk_norm")
inputs = contract.make_inputs(3, 4, 2, 64, torch.bfloat16, session.device, seed=0, fused_qkv=True)
q, k = inputs["q"], inputs["k"]
print("q", tuple(q.shape), "stride", q.stride(), q.dtype, "| k", tuple(k.shape), "stride", k.stride())

before = q.clone()
out_q, out_k = cookbook.qk_norm(**inputs, eps=1e-6)  # backend="auto"
print("returned the same tensors:", out_q is q and out_k is k)
print("rms of each q row, before:", before.float().square().mean(-1).sqrt()[0])
print("rms of each q row, after: ", q.float().square().mean(-1).sqrt()[0], "(about the rms of the weight)")

# %% [markdown]
# ## Backends
#
# `backend=` picks the level: `"reference"` (PyTorch, any device), `"numba"` (the last Numba
# kernel), `"cuda"` (the op's tuned CUDA C kernel where it has one, `cuda_tuned`, else its last
# numbered CUDA C version), or `"auto"`: on CUDA tensors the same CUDA C kernel, on CPU tensors
# the reference. The registry says what each one resolves to here, or why it cannot run:

# %%
for backend in ("auto", "reference", "numba", "cuda"):
    try:
        impl = registry.resolve("qk_norm", backend, session.device)
        print(f"backend={backend!r:12} -> {impl.name}")
    except (ValueError, RuntimeError) as error:
        print(f"backend={backend!r:12} -> unavailable: {error}")
print()
for op in registry.ops():
    print(f"backend='cuda' runs {registry.fastest(op).name:<10} for {op}")

# %% [markdown]
# Every backend checks its inputs the same way before writing anything, and names the argument,
# its shape, stride and dtype in the error:

# %%
bad = contract.make_inputs(2, 4, 1, 64, torch.bfloat16, "cpu")
try:
    cookbook.qk_norm(bad["q"], bad["k"][..., :32], bad["q_weight"], bad["k_weight"])
except ValueError as error:
    print("ValueError:", error)

# %% [markdown]
# ## The registry: every implementation of every op
#
# Tests, the benchmark and the notebooks iterate this list; an implementation that is not
# registered does not exist. Its levels: `reference`, `numba`, `cuda` (the numbered CUDA C
# kernels: for qk_norm the rungs of its ladder), `tuned` (the production CUDA C kernel) and
# `peer` (what a user would run instead, e.g. `torch.compile` of the reference). Each entry has
# a one-line lead saying what it changes and which bottleneck it removes (notebook 01 reads them
# rung by rung).

# %%
for op in registry.ops():
    print(f"{op}:")
    for level in registry.LEVELS:
        impls = registry.implementations(op, (level,))
        if impls:
            reason = impls[0].unavailable(session.device)
            where = "runs here" if reason is None else f"not here: {reason}"
            print(f"  {level:<9} {walkthrough.names_text([impl.name for impl in impls]):<32} ({where})")
print(f"\nqk_norm's tuned kernel, kernels_cuda/{registry.get('qk_norm', 'cuda_tuned').kernel}:\n"
      f"  {registry.get('qk_norm', 'cuda_tuned').lead}")

# %% [markdown]
# ## Tests, the benchmark, the docs
#
# * **Tests**: `python -m pytest tests` (on a CPU: references, Numba under the simulator, an
#   `nvcc` compile of every CUDA C kernel when nvcc is installed; GPU-only tests skip with a
#   reason). `python -m pytest --nbmake notebooks` runs these notebooks top to bottom.
# * **The main job**: `python -m cookbook bench` on a GPU (`cookbook/bench/sweep.py`) checks and
#   times every registered implementation side by side with PyTorch eager and `torch.compile`,
#   and writes tables, plots and `bench_out/pages/<op>_<gpu>.md` (the pages of record in
#   `docs/results/` with `--results-dir docs/results`). `python -m cookbook tour` (the
#   default without a GPU, `cookbook/bench/tour.py`) runs the reference and the Numba kernels on
#   tiny shapes, checked for agreement.
# * **Docs**: [`docs/index.md`](../docs/index.md) lists the op pages
#   ([`docs/qk_norm.md`](../docs/qk_norm.md): contract, the ladder, the tuned kernel, results).
# * **Walkthroughs**: [`01_qk_norm`](01_qk_norm.ipynb) goes from the math up the ladder to the
#   tuned kernel; [`02_cross_head_norm`](02_cross_head_norm.ipynb),
#   [`03_tp_qk_norm`](03_tp_qk_norm.ipynb) and [`04_qk_norm_rope`](04_qk_norm_rope.ipynb) take
#   the other ops.
#
# The tour is quick enough to run here:

# %%
from cookbook import bench

tour_rows = bench.tour(ops=["qk_norm"], dtypes=(torch.bfloat16,))
