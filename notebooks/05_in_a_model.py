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
# # The fused norms inside real models: Qwen3, Gemma3, OLMo2 and FLUX
#
# Notebooks 01 to 04 show each op on synthetic tensors. This one puts them where they live: in
# the attention of a Hugging Face transformers model and of the FLUX transformer of diffusers.
# One call patches a loaded model in place; the model then gives the same answers, and its q/k
# norms (and, where RoPE follows right away, the rotary embedding) run as one fused op.
#
# Everything here runs on a CPU in seconds, with **tiny randomly initialized models** built from
# configs (no downloads): on a CPU `backend="auto"` is the PyTorch reference, which follows each
# model's rounding order exactly. The speed at real sizes is measured on a GPU by
# `python -m cookbook.integrations.bench`; the last cell points to its results.
#
# **Install**: `python -m pip install -e ".[test]"` brings transformers; FLUX needs diffusers
# (`pip install -e ".[integrations]"`), and its cells say so when it is missing.

# %%
import json
import os
import sys
from pathlib import Path

import torch  # torch does not import Numba

if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # before anything imports numba
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tiny models from configs: nothing to download
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

ROOT = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "cookbook" / "__init__.py").exists()), None)
if ROOT is not None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import transformers

import cookbook
from cookbook import walkthrough
from cookbook.integrations import bench, compare, output_parity

walkthrough.quiet()  # the warnings a learner can do nothing about
print(walkthrough.provenance(["qk_norm", "cross_head_norm", "qk_norm_rope"]))  # the ops the models run
print(f"cookbook {cookbook.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, device {DEVICE}")

# %% [markdown]
# ## 1. Two lines
#
# A Qwen3 model with Qwen3-style dims, only tiny (2 layers, 4 query heads and 2 key/value heads
# of 32 dims), random weights. Its q/k norm weights are random too (a fresh model's are all
# ones), so that a wrong weight would show.

# %%
model = bench.causal_lm("qwen3", bench.TINY_LM_DIMS, device=DEVICE)
ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
with torch.inference_mode():
    logits_before = model(ids).logits
    tokens_before = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)

# %% [markdown]
# The use is two lines: import, patch. `patch` returns a report of what it changed:

# %%
from cookbook.integrations import transformers as fused

report = fused.patch(model)
print(report)

# %% [markdown]
# Same model object, same calls. The logits are compared by the op contracts' rule (at least
# 99 % bit-identical, the rest within 4 ulp); greedy generation must give the same 16 tokens:

# %%
with torch.inference_mode():
    logits_after = model(ids).logits
    tokens_after = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
print(f"logits: {compare(logits_after, logits_before)}")
print(f"greedy tokens the same: {torch.equal(tokens_after, tokens_before)}")

# %% [markdown]
# ## 2. What the patch changed
#
# Qwen3's attention forward projects q and k, normalizes each head with `q_norm` and `k_norm`
# (RMSNorm modules), then calls the module-level function `apply_rotary_pos_emb(q, k, cos, sin)`.
# The patch keeps **the model's own forward** and rebinds three names for that module only:
# `q_norm` and `k_norm` pass their input through, and `apply_rotary_pos_emb` becomes the fused
# section, the first place where q and k are both at hand (still views of the projection
# outputs). Everything else (KV cache, masks, attention backend) is the installed transformers'
# code:

# %%
import inspect

attn = model.model.layers[0].self_attn
patched_code = inspect.unwrap(attn.forward.__func__)  # the copy bound to this module, under its decorators
section = patched_code.__globals__[fused.ROPE_FUNCTION]
print(f"{type(attn).__name__}.forward runs the model's own code: {patched_code.__code__ is inspect.unwrap(type(attn).forward).__code__}")
print(f"q_norm and k_norm pass their input through: {attn.q_norm.forward is attn.k_norm.forward is fused.pass_through}")
print(f"{fused.ROPE_FUNCTION}, for this module only, is: cookbook.{section.spec.op}"
      f"(rounding={section.spec.rounding!r}, weight_offset={section.spec.weight_offset})")
print(f"the module-level function is untouched: {inspect.unwrap(type(attn).forward).__globals__[fused.ROPE_FUNCTION].__name__}")

# %% [markdown]
# **Which rounding.** Each model keeps its own norm's rounding order, read in its source:
#
# | model | its norm, per row `x` (float32 inside) | cookbook op |
# |---|---|---|
# | Qwen3 | `w * round(x * rstd)`: rounds before the weight, then RoPE in the activation dtype | `qk_norm_rope(rounding="hf")` on the model's cos/sin |
# | Gemma3 | `round(x * rstd * (1 + w))`: the weight applied in float32, stored as `w` | `qk_norm(rounding="fused", weight_offset=1.0)`, then the model's RoPE |
# | OLMo2 | `round(w * x * rstd)` over the **whole** q (and k) row | `cross_head_norm(rounding="fused")`, then the model's RoPE |
#
# This table is not trusted blindly: at patch time, a small random input goes through the model's
# own norm modules and rope function and through the replacement, and the patch refuses unless
# they agree. Here is that check catching a deliberately wrong table entry (Qwen3 with the fused
# rounding order):

# %%
import dataclasses

fused.unpatch(model)
right = fused.SPECS["Qwen3Attention"]
fused.SPECS["Qwen3Attention"] = dataclasses.replace(right, rounding="fused")
try:
    fused.patch(model)
except fused.LayoutError as error:
    print(f"LayoutError: {error}")
finally:
    fused.SPECS["Qwen3Attention"] = right
print(f"the model is left unpatched: {'forward' not in attn.__dict__}")

# %% [markdown]
# ## 3. Gemma3 and OLMo2
#
# The same two lines, the same checks, on tiny Gemma3 (per-head norms with `1 + w`; one sliding
# and one global layer) and OLMo2 (a norm over each token's whole q row and whole k row) models.
# A batch of two sequences, the second left-padded, exercises the attention mask too:

# %%
mask = torch.ones_like(ids)
mask[1, :3] = 0
for family in ("gemma3", "olmo2"):
    lm = bench.causal_lm(family, bench.TINY_LM_DIMS, device=DEVICE)
    with torch.inference_mode():
        before = lm(ids, attention_mask=mask).logits[mask.bool()]
        greedy_before = lm.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        print(str(fused.patch(lm)).splitlines()[1].strip())
        after = lm(ids, attention_mask=mask).logits[mask.bool()]
        greedy_after = lm.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    print(f"  logits: {compare(after, before)}; greedy tokens the same: {torch.equal(greedy_after, greedy_before)}")

# %% [markdown]
# ## 4. torch.compile
#
# The fused ops are torch custom ops: `torch.compile` traces the patched forward in one graph
# with each op inside as one opaque node (it mutates q and k in place). On a GPU the default
# backend (inductor) applies; on a CPU the `aot_eager` backend shows the same trace without
# building C++:

# %%
fused.patch(model)
compiled = torch.compile(model, backend="inductor" if DEVICE.type == "cuda" else "aot_eager", fullgraph=True)
with torch.inference_mode():
    logits_compiled = compiled(ids).logits
print(f"compiled patched model vs the unpatched model: {compare(logits_compiled, logits_before)}")

# %% [markdown]
# ## 5. FLUX (diffusers)
#
# FLUX normalizes four tensors per double-stream block (image q and k, text q and k, each pair
# with its own weights), joins text and image into one sequence `[text | image]` and rotates q
# and k with one cos/sin row per token. The patch gives each FLUX attention a processor that
# runs `cookbook.qk_norm_rope` on each stream before joining them: the text with rows
# `0 .. text_len - 1`, the image with `position_offset=text_len`.
#
# FLUX rounds the normalized q and k to the activation dtype before rotating in float32; the fused
# op has no such middle rounding (`rounding="fused"`), so the output is not bit-identical. It is
# judged by accuracy: against the same weights run in float32, the patched transformer's error
# must stay within 1.1x the model's own bf16 error.

# %%
try:
    import diffusers
except ImportError:
    diffusers = None
    print("diffusers is not installed: pip install -e '.[integrations]' to run this part")

if diffusers is not None:
    import copy

    from cookbook.integrations import diffusers as fused_flux

    flux = bench.flux_transformer(bench.TINY_FLUX_DIMS, device=DEVICE)
    inputs = bench.flux_inputs(bench.TINY_FLUX_DIMS, image_side=4, text_tokens=5, batch=2, device=DEVICE)
    with torch.inference_mode():
        exact = copy.deepcopy(flux).float()(**{n: t.float() for n, t in inputs.items()}).sample
        before = flux(**inputs).sample
        print(fused_flux.patch(flux))
        after = flux(**inputs).sample
    print(f"diffusers {diffusers.__version__}: {output_parity(after, before, exact)}")

# %% [markdown]
# ## 6. Undo, and the numbers at real sizes
#
# `unpatch(model)` puts the original forwards back (and returns the report of the patch it
# undid); patching twice, or a model with no supported attention, raises a clear error:

# %%
fused.unpatch(model)
try:
    fused.unpatch(model)
except RuntimeError as error:
    print(f"RuntimeError: {error}")
llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
try:
    fused.patch(llama)
except ValueError as error:
    print(f"ValueError: {error}")

# %% [markdown]
# The GPU benchmark, `python -m cookbook.integrations.bench`, repeats this parity at Qwen3-8B,
# Gemma3-12B, OLMo2-7B and FLUX.1 dims (random weights, two layers) and times one attention block
# and one decoder layer, patched against unpatched, at a decode and a prefill size. It writes
# `docs/results/in_a_model_<gpu>.md`; `docs/integrations.md` explains the table.

# %%
results = sorted((ROOT / "docs" / "results").glob("in_a_model_*.md")) if ROOT is not None else []
results = [path for path in results if not path.stem.endswith("_tiny")]
if not results:
    print("not measured yet: run `python -m cookbook.integrations.bench` on a GPU")
for path in results:
    print(f"{path.relative_to(ROOT)}: {path.read_text().splitlines()[0].lstrip('# ')}")
    report = json.loads(path.with_suffix(".json").read_text())
    print(f"  commit {report['meta']['commit']}; speedup = unpatched / patched time per call")
    for row in report["timing"]:
        if "patched_graph_median_us" in row:
            graph = f"{row['unpatched_graph_median_us'] / row['patched_graph_median_us']:.2f}x"
        else:
            graph = "not captured"
        eager = (f"{row['unpatched_eager_median_us'] / row['patched_eager_median_us']:.2f}x"
                 if "patched_eager_median_us" in row else "not timed")
        print(f"  {row['family']:7s} {row['size']:10s} {row['module']:24s} graph {graph:>12s}   eager {eager:>9s}")
