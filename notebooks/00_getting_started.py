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
# reference (`cookbook/ops/`), a Numba CUDA kernel (`kernels_numba/`) and numbered CUDA C
# versions (`kernels_cuda/`). The registry, `cookbook/registry.py`, is the only list of them.
#
# **Install** (from a checkout; the test extras include everything the notebooks need):
#
# ```bash
# python -m pip install -e ".[test]"
# ```
#
# Without a GPU everything here still runs: the reference on the CPU, and the Numba kernels under
# Numba's CUDA simulator, which must be switched on *before Numba is first imported* (Numba reads
# `NUMBA_ENABLE_CUDASIM` once). That is what the first cell does.

# %%
import os
import sys
from pathlib import Path

import torch  # torch does not import Numba

if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # before anything imports numba
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

ROOT = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "cookbook" / "__init__.py").exists()), None)
if ROOT is not None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cookbook
from cookbook import registry

print(f"cookbook {cookbook.__version__}, torch {torch.__version__}, device {DEVICE}, "
      f"NUMBA_ENABLE_CUDASIM={os.environ.get('NUMBA_ENABLE_CUDASIM', '0')}")

# %% [markdown]
# ## Calling an op
#
# `cookbook.qk_norm` normalizes q and k per head, in place, and returns them. Here q and k are
# views into one fused qkv tensor, as an engine's QKV projection leaves them; the contract
# module's `make_inputs` builds seeded inputs like that.

# %%
contract = registry.contract("qk_norm")
inputs = contract.make_inputs(3, 4, 2, 64, torch.bfloat16, DEVICE, seed=0, fused_qkv=True)
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
# `backend=` picks the level: `"reference"` (PyTorch, any device), `"numba"`, `"cuda"`, or
# `"auto"` (the fastest available for the tensors' device; on a CPU that is the reference). The
# registry says which implementation each one resolves to here, or why it cannot run:

# %%
for backend in ("auto", "reference", "numba", "cuda"):
    try:
        impl = registry.resolve("qk_norm", backend, DEVICE)
        print(f"backend={backend!r:12} -> {impl.name}")
    except (ValueError, RuntimeError) as error:
        print(f"backend={backend!r:12} -> unavailable: {error}")

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
# registered does not exist. Each entry's lead says what changed from the previous version.

# %%
for op in registry.ops():
    print(f"{op}:")
    for impl in registry.implementations(op):
        reason = impl.unavailable(DEVICE)
        where = "runs here" if reason is None else f"not here ({reason})"
        print(f"  {impl.name:<14} {impl.level:<9} v{impl.version}  {where}\n      {impl.lead}")

# %% [markdown]
# ## Tests, the benchmark, the docs
#
# * **Tests**: `python -m pytest tests` (on a CPU: references, Numba under the simulator, an
#   `nvcc` compile of every CUDA C kernel when nvcc is installed; GPU-only tests skip with a
#   reason). `python -m pytest --nbmake notebooks` runs these notebooks top to bottom.
# * **The main job**: `python -m cookbook bench` on a GPU checks and times every registered
#   implementation side by side with PyTorch eager and `torch.compile`, and writes tables, plots
#   and `docs/results/<op>_<gpu>.md`. `python -m cookbook tour` (the default without a GPU) runs
#   the CPU tour: the reference and the Numba kernels on tiny shapes, checked for agreement.
# * **Docs**: `docs/index.md` lists the op pages (`docs/qk_norm.md`: contract, versions,
#   caveats, results).
# * **Walkthroughs**: `notebooks/01_qk_norm` goes from the math to the fastest CUDA C version.
#
# The tour is quick enough to run here:

# %%
from cookbook import bench

tour_rows = bench.tour(ops=["qk_norm"], dtypes=(torch.bfloat16,))
