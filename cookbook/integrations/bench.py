"""Parity and per-layer timing of patched models at real sizes (random weights, a few layers).

    python -m cookbook.integrations.bench           # GPU: writes docs/results/in_a_model_<gpu>.md and .json
    python -m cookbook.integrations.bench --tiny    # tiny dims, any machine (a smoke run; on a CPU no timing)

For each model family (Qwen3-8B-like, Gemma3-12B-like, OLMo2-7B-like and, where diffusers is
installed, FLUX.1-like):

* **parity of the replaced section**: the model's own q/k norms (and rope) against the patched
  section on the model's device, by the op contracts' rule (`cookbook.integrations.compare`);
* **parity of the model**: bf16 logits (FLUX: the transformer's output) patched against
  unpatched, judged against the model's own bf16 error (the same weights run in float32): the
  patch must move the output less than bf16 rounding already does; and greedy generation of 16
  tokens, patched and unpatched;
* **timing** of one attention block and one decoder layer (FLUX: one double-stream and one
  single-stream block), patched against unpatched, with exactly the arguments the model passes
  them (captured by a forward pre-hook during `generate` with a static cache, or during one
  FLUX forward), at a decode and a prefill size: CUDA graph replays timed with CUDA events,
  warm-up first, unpatched and patched replays alternating in blocks, medians reported.

The model builders (`causal_lm`, `flux_transformer`) are what the tests and notebook 05 use with
tiny dims.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import cookbook
from cookbook.bench.pages import git_commit, gpu_slug
from cookbook.integrations import compare, output_parity

REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPE = torch.bfloat16
NORM_WEIGHT_SPREAD = 0.25  # random q/k norm weights: (w + weight_offset) = 1 + 0.25 * N(0, 1)
GREEDY_TOKENS = 16
PARITY_BATCH, PARITY_TOKENS = 2, 64
WARMUP_REPLAYS = 10
TIMING_BLOCKS, REPLAYS_PER_BLOCK = 5, 40  # per variant: 5 blocks of 40 replays, A/B alternating
LOW_PERCENTILE, HIGH_PERCENTILE = 20, 80
# The attention kernels the parity and repeat checks allow: each returns the same bits for the same
# call. PyTorch's default choice among its SDPA kernels did not on an H200 (the same decode call of
# Gemma3's and OLMo2's attention, masked, gave outputs up to 0.004 and 1.5e-5 apart), which would
# fake or hide a difference the patch makes. Timing keeps the default choice.
REPEATABLE_SDPA = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def repeatable_attention():
    """A context in which scaled_dot_product_attention runs only the REPEATABLE_SDPA kernels."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in REPEATABLE_SDPA])


# --------------------------------------------------------------------------------------------
# Model builders (random weights, no downloads).
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LMDims:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


@dataclass(frozen=True)
class LMFamily:
    like: str  # the released model whose layer dims these are
    config: str  # transformers class names
    model: str
    dims: LMDims
    extra: dict


# The layers are the real models' layers; the vocabulary is cut (the embedding and lm_head are
# not what is timed) and there are two layers (one sliding and one global in Gemma3).
LM_FAMILIES = {
    "qwen3": LMFamily("Qwen3-8B", "Qwen3Config", "Qwen3ForCausalLM", LMDims(2, 4096, 32, 8, 128, 12288, 32768), {}),
    "gemma3": LMFamily("Gemma3-12B", "Gemma3TextConfig", "Gemma3ForCausalLM", LMDims(2, 3840, 16, 8, 256, 15360, 32768),
                       dict(query_pre_attn_scalar=256, sliding_window=1024,
                            layer_types=["sliding_attention", "full_attention"])),
    "olmo2": LMFamily("OLMo2-7B", "Olmo2Config", "Olmo2ForCausalLM", LMDims(2, 4096, 32, 32, 128, 11008, 32768), {}),
    "qwen3_moe": LMFamily("Qwen3-30B-A3B", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", LMDims(2, 2048, 32, 4, 128, 6144, 32768),
                          dict(moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)),
}
# What `python -m cookbook.integrations.bench` runs by default (Qwen3-MoE's attention is Qwen3's:
# the tests cover it, the GPU run leaves out its slow eager expert loop).
DEFAULT_FAMILIES = ("qwen3", "gemma3", "olmo2", "flux")
TINY_LM_DIMS = LMDims(2, 64, 4, 2, 32, 128, 128)
TINY_EXTRA = {"gemma3": dict(query_pre_attn_scalar=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
              "qwen3_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)}


def causal_lm(family: str, dims: LMDims | None = None, *, dtype=DTYPE, device="cpu", seed: int = 0):
    """A randomly initialized causal LM of `family` (a key of LM_FAMILIES), in eval mode.

    Its q/k norm weights are random too (a fresh model's are all ones, or zeros for Gemma's
    ``1 + w``), so that a wrong weight or weight offset shows in its output."""
    import transformers

    spec = LM_FAMILIES[family]
    dims = dims or spec.dims
    extra = TINY_EXTRA.get(family, {}) if dims == TINY_LM_DIMS else spec.extra
    config = getattr(transformers, spec.config)(
        vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.intermediate,
        num_hidden_layers=dims.layers, num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
        head_dim=dims.head_dim, max_position_embeddings=8192, pad_token_id=0, eos_token_id=None, bos_token_id=None,
        **extra,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, spec.model)(config)
    model = model.to(dtype).eval()
    randomize_norm_weights(model, ("q_norm", "k_norm"), offset=1.0 if family == "gemma3" else 0.0, seed=seed)
    return model


@dataclass(frozen=True)
class FluxDims:
    double_blocks: int
    single_blocks: int
    heads: int
    head_dim: int
    axes: tuple
    text_dim: int
    pooled_dim: int
    channels: int


FLUX_DIMS = FluxDims(1, 1, 24, 128, (16, 56, 56), 4096, 768, 64)  # FLUX.1's blocks
TINY_FLUX_DIMS = FluxDims(1, 1, 2, 16, (4, 6, 6), 32, 16, 16)


def flux_transformer(dims: FluxDims = FLUX_DIMS, *, dtype=DTYPE, device="cpu", seed: int = 0):
    """A randomly initialized FLUX transformer (random q/k norm weights too), in eval mode."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in `dtype` (diffusers' `to(dtype)` would log a warning)
    try:
        with torch.device(device):
            model = FluxTransformer2DModel(
                patch_size=1, in_channels=dims.channels, num_layers=dims.double_blocks,
                num_single_layers=dims.single_blocks, attention_head_dim=dims.head_dim, num_attention_heads=dims.heads,
                joint_attention_dim=dims.text_dim, pooled_projection_dim=dims.pooled_dim, guidance_embeds=False,
                axes_dims_rope=dims.axes,
            ).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    randomize_norm_weights(model, ("norm_q", "norm_k", "norm_added_q", "norm_added_k"), offset=0.0, seed=seed)
    return model


def flux_inputs(dims: FluxDims, image_side: int, text_tokens: int, *, batch=1, dtype=DTYPE, device="cpu", seed=0):
    """The transformer's inputs for an image of `image_side` x `image_side` latent patches."""
    gen = torch.Generator().manual_seed(seed)
    side = torch.arange(image_side, dtype=torch.float32)
    rows, cols = torch.meshgrid(side, side, indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).view(-1, 3)
    values = dict(
        hidden_states=torch.randn(batch, image_side**2, dims.channels, generator=gen),
        encoder_hidden_states=torch.randn(batch, text_tokens, dims.text_dim, generator=gen),
        pooled_projections=torch.randn(batch, dims.pooled_dim, generator=gen),
        timestep=torch.full((batch,), 0.5),
    )
    out = {name: t.to(device=device, dtype=dtype) for name, t in values.items()}
    out.update(img_ids=img_ids.to(device), txt_ids=torch.zeros(text_tokens, 3, device=device))
    return out


def randomize_norm_weights(model, names, *, offset: float, seed: int) -> None:
    """Applied weights (w + offset) of 1 + spread * N(0, 1) for every norm module called `names`."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in names and getattr(module, "weight", None) is not None:
                applied = 1.0 + NORM_WEIGHT_SPREAD * torch.randn(module.weight.shape, generator=gen)
                module.weight.copy_(applied - offset)


# --------------------------------------------------------------------------------------------
# Parity.
# --------------------------------------------------------------------------------------------
def lm_section_parity(model, family: str, backend: str = "auto") -> dict:
    """Layer 0's own q/k norms and rope against the patched section on the model's device, at
    the model's head counts: the op contracts' rule (`compare`)."""
    from cookbook.integrations import transformers as fused

    attn = attention_of(model)
    spec = fused.SPECS[type(attn).__name__]
    model_rope = fused.attention_code(type(attn)).__globals__[fused.ROPE_FUNCTION]
    device, dtype = attn.q_norm.weight.device, attn.q_norm.weight.dtype
    gen = torch.Generator().manual_seed(0)
    config = model.config
    q = torch.randn(PARITY_BATCH, PARITY_TOKENS, config.num_attention_heads, attn.head_dim, generator=gen).to(device, dtype)
    k = torch.randn(PARITY_BATCH, PARITY_TOKENS, config.num_key_value_heads, attn.head_dim, generator=gen).to(device, dtype)
    positions = torch.randint(0, 4096, (PARITY_BATCH, PARITY_TOKENS), generator=gen).to(device)
    cos, sin = rotary_of(model)(q, positions)

    def own_norm(norm, x):  # OLMo2 normalizes the whole [.., heads * head_dim] row
        return norm(x.flatten(-2)).view_as(x) if spec.op == "cross_head_norm" else norm(x)

    with torch.no_grad():
        want = model_rope(own_norm(attn.q_norm, q).transpose(1, 2), own_norm(attn.k_norm, k).transpose(1, 2), cos, sin)
        section = fused.FusedSection(attn.q_norm, attn.k_norm, spec, model_rope, backend, "bench")
        got = section(q.clone().transpose(1, 2), k.clone().transpose(1, 2), cos, sin)
    results = {name: compare(ours, theirs) for name, ours, theirs in zip("qk", got, want)}
    return {"ok": all(r.ok for r in results.values()), "detail": "; ".join(f"{n}: {r}" for n, r in results.items())}


def attention_of(model):
    return model.model.layers[0].self_attn


def rotary_of(model):
    rotary = model.model.rotary_emb
    if type(rotary).__name__.startswith("Gemma3"):  # one table per layer type in recent versions
        import inspect

        if "layer_type" in inspect.signature(rotary.forward).parameters:
            layer_type = model.config.layer_types[0]
            return lambda x, positions: rotary(x, positions, layer_type)
    return rotary


def lm_parity(model, family: str, patch, unpatch, backend: str = "auto") -> dict:
    """Section parity, then logits and greedy tokens patched against unpatched."""
    device = model.device
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (PARITY_BATCH, PARITY_TOKENS), generator=gen).to(device)
    mask = torch.ones_like(ids)
    mask[1, : PARITY_TOKENS // 4] = 0  # left padding in the second sequence
    result = {"section": lm_section_parity(model, family, backend)}
    exact_model = copy.deepcopy(model).float()
    with torch.inference_mode(), repeatable_attention():
        exact = exact_model(ids, attention_mask=mask).logits
        del exact_model
        unpatched = model(ids, attention_mask=mask).logits
        tokens_before = greedy(model, ids, mask)
        patch(model, backend=backend)
        try:
            patched = model(ids, attention_mask=mask).logits
            tokens_after = greedy(model, ids, mask)
        finally:
            unpatch(model)
    keep = mask.bool()  # padded positions carry no meaning
    result["logits"] = parity_entry(output_parity(patched[keep], unpatched[keep], exact[keep]))
    result["greedy_same"] = bool(torch.equal(tokens_before, tokens_after))
    return result


def greedy(model, ids, mask):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                         do_sample=False)
    return out[:, ids.shape[1]:]


def flux_parity(model, dims: FluxDims, image_side: int, text_tokens: int, backend: str = "auto") -> dict:
    """The transformer's output patched against unpatched, judged against its own bf16 error."""
    from cookbook.integrations import diffusers as fused

    inputs = flux_inputs(dims, image_side, text_tokens, batch=PARITY_BATCH, device=model.device)
    attn = model.transformer_blocks[0].attn
    comparisons = fused.section_comparisons(attn, device=model.device, backend=backend, heads=attn.heads,
                                            text_tokens=text_tokens, image_tokens=PARITY_TOKENS, own_weights=True)
    result = {"section": {"ok": all(c.max_ulp <= fused.PROBE_MAX_ULP for c in comparisons.values()),
                          "detail": "; ".join(f"{n}: {c}" for n, c in comparisons.items())}}
    exact_model = copy.deepcopy(model).float()
    with torch.inference_mode(), repeatable_attention():
        exact = exact_model(**{n: t.float() if t.is_floating_point() else t for n, t in inputs.items()}).sample
        del exact_model
        unpatched = model(**inputs).sample
        fused.patch(model, backend=backend)
        try:
            patched = model(**inputs).sample
        finally:
            fused.unpatch(model)
    result["output"] = parity_entry(output_parity(patched, unpatched, exact))
    return result


def parity_entry(parity) -> dict:
    return {"ok": parity.ok, "detail": str(parity), **asdict(parity)}


# --------------------------------------------------------------------------------------------
# Timing.
# --------------------------------------------------------------------------------------------
def capture_calls(modules: dict, run) -> dict:
    """{name: [Call, ...]}: every call of each module while `run()` runs, with its arguments."""
    calls = {name: [] for name in modules}

    def hook(module, args, kwargs, name):
        calls[name].append(Call(module, args, kwargs, cache_restorer(kwargs)))

    handles = [module.register_forward_pre_hook(lambda m, a, kw, name=name: hook(m, a, kw, name), with_kwargs=True)
               for name, module in modules.items()]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return calls


@dataclass
class Call:
    """One captured call: calling it again restores the KV cache's counters first, so that every
    repetition writes the same cache slots and attends over the same length (an idempotent call)."""

    module: torch.nn.Module
    args: tuple
    kwargs: dict
    restore: object

    def __call__(self):
        self.restore()
        return self.module(*self.args, **self.kwargs)


def cache_restorer(kwargs: dict):
    """A function that puts a KV cache's counters back to their values now.

    Caches keep their fill level in Python ints (advanced by every call) or in small integer
    tensors (advanced in place, even inside a CUDA graph); the big key/value tensors are written
    at positions those counters give, so restoring the counters makes a call repeatable."""
    caches = [v for v in kwargs.values() if type(v).__name__.endswith("Cache")]
    saved = []
    for cache in caches:
        for holder in (cache, *getattr(cache, "layers", ())):
            for name, value in vars(holder).items():
                if isinstance(value, int) and not isinstance(value, bool):
                    saved.append((holder, name, value))
                elif isinstance(value, torch.Tensor) and not value.is_floating_point() and value.numel() <= 64:
                    saved.append((holder, name, value.clone()))

    def restore():
        for i, (holder, name, value) in enumerate(saved):
            if isinstance(value, torch.Tensor):
                target = getattr(holder, name)
                if value.device != target.device:  # a lazily initialized cache moved its counter to
                    value = value.to(target.device)  # the GPU after the hook saved it (a prefill's
                    saved[i] = (holder, name, value)  # call): moved once, on the first, eager call
                target.copy_(value)  # in place: a CUDA graph replays this copy too
            else:
                setattr(holder, name, value)

    return restore


def graph_of(fn):
    """A CUDA graph of `fn()` (warmed up on a side stream first), or None and why not."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph, ""
    except Exception as error:  # noqa: BLE001 (recorded: the timing falls back to eager calls)
        torch.cuda.synchronize()
        return None, f"{type(error).__name__}: {error}"[:200]


def percentile(values, q):
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def time_ab(runners: dict) -> dict:
    """{name: timing} of each runner (a callable): blocks of calls alternate between the runners,
    each call timed by its own pair of CUDA events, after a warm-up."""
    for run in runners.values():
        for _ in range(WARMUP_REPLAYS):
            run()
    events = {name: [] for name in runners}
    for _ in range(TIMING_BLOCKS):
        for name, run in runners.items():
            for _ in range(REPLAYS_PER_BLOCK):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                events[name].append((start, end))
    torch.cuda.synchronize()
    out = {}
    for name, pairs in events.items():
        us = [start.elapsed_time(end) * 1000 for start, end in pairs]
        out[name] = {"median_us": percentile(us, 50), "p20_us": percentile(us, LOW_PERCENTILE),
                     "p80_us": percentile(us, HIGH_PERCENTILE), "reps": len(us)}
    return out


MODES = ("graph", "eager")


def time_modules(model, modules: dict, calls: dict, patch, unpatch, backend: str) -> list[dict]:
    """Patched against unpatched timing of each module's captured `Call`, two ways:

    * graph: replays of a CUDA graph of the call (GPU time alone). The unpatched graph is
      captured before patching and, being a graph, still replays the unpatched code while the
      patch is installed: the two alternate.
    * eager: the call itself, as `generate` makes it without graphs (Python and launch overhead
      included: CUDA events measure the GPU's timeline, idle gaps too); each variant while it is
      installed.
    """
    rows = []
    for name in modules:
        call = calls[name]
        row = {"module": name}
        with torch.inference_mode():
            with repeatable_attention():
                unpatched_out = first_tensor(call()).clone()
                again = first_tensor(call())
            if not torch.equal(again, unpatched_out):  # timing would not repeat one call: not timed
                row["not_repeatable"] = (f"two calls with the captured arguments differ (max |difference| "
                                         f"{(again.float() - unpatched_out.float()).abs().max().item():.3g})")
                rows.append(row)
                continue
            unpatched_graph, why_not = graph_of(call)
            timing = {"unpatched_eager": time_ab({"x": call})["x"]}
            patch(model, backend=backend)
            try:
                with repeatable_attention():
                    row["output_vs_unpatched"] = str(compare(first_tensor(call()), unpatched_out))
                timing["patched_eager"] = time_ab({"x": call})["x"]
                patched_graph, why_not_patched = graph_of(call)
                if unpatched_graph is not None and patched_graph is not None:
                    graphs = time_ab({"unpatched_graph": unpatched_graph.replay, "patched_graph": patched_graph.replay})
                    timing.update(graphs)
                else:
                    row["graph_failed"] = why_not or why_not_patched
            finally:
                unpatch(model)
        for variant, t in timing.items():
            row.update({f"{variant}_{key}": value for key, value in t.items()})
        rows.append(row)
    return rows


def first_tensor(output) -> torch.Tensor:
    """A module's main output: the tensor itself, or the first of a tuple (attention: its output)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def lm_timing(model, sizes: dict, patch, unpatch, backend: str) -> list[dict]:
    """A decoder layer and its attention, with the arguments `generate` passes them at each size."""
    layer = timed_layer(model)
    modules = {"attention block": layer.self_attn, "decoder layer": layer}
    rows = []
    for size, (batch, context, step) in sizes.items():
        gen = torch.Generator().manual_seed(2)
        ids = torch.randint(1, model.config.vocab_size, (batch, context), generator=gen).to(model.device)
        with torch.inference_mode():
            calls = capture_calls(modules, lambda: model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=step + 1, min_new_tokens=step + 1,
                do_sample=False, cache_implementation="static"))
        chosen = {name: c[step] for name, c in calls.items()}
        tokens = chosen["attention block"].kwargs["hidden_states"].shape[:2]
        for row in time_modules(model, modules, chosen, patch, unpatch, backend):
            rows.append({"size": size, "tokens": f"{tokens[0]} x {tokens[1]}", **row})
    return rows


def timed_layer(model):
    """The first decoder layer with global attention. A full sliding-window cache shifts its
    contents at every decode step, so a repeated call would not see the same keys (Gemma3's
    sliding layers cost the same at a context within the window)."""
    for layer in model.model.layers:
        if getattr(layer.self_attn, "sliding_window", None) is None:
            return layer
    raise RuntimeError("no decoder layer with global attention to time")


def flux_timing(model, dims: FluxDims, sizes: dict, backend: str) -> list[dict]:
    """One double-stream block, one single-stream block and their attention, per image size."""
    from cookbook.integrations import diffusers as fused

    double, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    modules = {"double-stream attention": double.attn, "double-stream block": double,
               "single-stream attention": single.attn, "single-stream block": single}
    rows = []
    for size, (image_side, text_tokens) in sizes.items():
        inputs = flux_inputs(dims, image_side, text_tokens, device=model.device)
        with torch.inference_mode():
            calls = capture_calls(modules, lambda: model(**inputs))
        chosen = {name: c[0] for name, c in calls.items()}
        for row in time_modules(model, modules, chosen, fused.patch, fused.unpatch, backend):
            rows.append({"size": size, "tokens": f"{text_tokens} text + {image_side**2} image", **row})
    return rows


def compile_check(model, patch, unpatch, backend: str) -> dict:
    """torch.compile of the patched attention block agrees with the eager patched block."""
    attn = attention_of(model)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, model.config.vocab_size, (2, 32), generator=gen).to(model.device)
    with torch.inference_mode():
        call = capture_calls({"attn": attn}, lambda: model(ids, use_cache=False))["attn"][0]
    patch(model, backend=backend)
    try:
        with torch.inference_mode():
            eager = attn(*call.args, **call.kwargs)[0]
            started = time.perf_counter()
            compiled = torch.compile(attn, fullgraph=True)(*call.args, **call.kwargs)[0]
            seconds = time.perf_counter() - started
    except Exception as error:  # noqa: BLE001 (reported in the results)
        return {"ok": False, "detail": f"{type(error).__name__}: {error}"[:300]}
    finally:
        unpatch(model)
    result = compare(compiled, eager)
    return {"ok": result.ok, "detail": f"{result} (compile {seconds:.0f} s)"}


# --------------------------------------------------------------------------------------------
# The run, and what it writes.
# --------------------------------------------------------------------------------------------
LM_SIZES = {"decode": (32, 1024, 1), "prefill": (1, 2048, 0)}  # (batch, prompt tokens, generate step timed)
TINY_LM_SIZES = {"decode": (2, 8, 1), "prefill": (1, 16, 0)}
FLUX_SIZES = {"512x512": (32, 512), "1024x1024": (64, 512)}  # (latent patches per side, text tokens)
TINY_FLUX_SIZES = {"tiny": (4, 5)}


def run(tiny: bool, families, results_dir: Path, command: str, backend: str = "auto", check_compile: bool = True) -> dict:
    """Parity (and on a GPU, timing) of each family; writes the results. A family that fails is
    recorded with its error and the run goes on to the next."""
    on_gpu = torch.cuda.is_available()
    report = {"meta": metadata(command, tiny, backend), "parity": {}, "timing": [], "notes": [], "errors": {}}
    if not on_gpu:
        report["notes"].append("no CUDA device: timing needs CUDA events and graphs, skipped")
    else:
        started = time.perf_counter()
        build_kernels(backend)
        report["notes"].append(f"kernels built or loaded before the run: {time.perf_counter() - started:.0f} s")
    for family in families:
        started = time.perf_counter()
        try:
            if family == "flux":
                run_flux(report, tiny, backend, on_gpu)
            else:
                run_lm(report, family, tiny, backend, on_gpu, check_compile)
        except Exception as error:  # noqa: BLE001 (recorded in the results; the exit status says it failed)
            report["errors"][family] = "".join(traceback.format_exception_only(type(error), error)).strip()[:500]
            traceback.print_exc()
        finally:
            if on_gpu:
                torch.cuda.empty_cache()
        print(f"[{family}] {time.perf_counter() - started:.0f} s", flush=True)
    write(report, results_dir)
    return report


def run_lm(report, family, tiny, backend, on_gpu, check_compile) -> None:
    from cookbook.integrations import transformers as fused

    dims = TINY_LM_DIMS if tiny else LM_FAMILIES[family].dims
    device = "cuda" if on_gpu else "cpu"
    print(f"[{family}] {LM_FAMILIES[family].like}-like layers x {dims.layers} on {device}", flush=True)
    model = causal_lm(family, dims, device=device)
    report["parity"][family] = lm_parity(model, family, fused.patch, fused.unpatch, backend)
    if family == "qwen3" and check_compile and on_gpu:
        report["parity"][family]["compile"] = compile_check(model, fused.patch, fused.unpatch, backend)
    print(f"[{family}] parity: {json.dumps(report['parity'][family])}", flush=True)
    if on_gpu:
        for row in lm_timing(model, TINY_LM_SIZES if tiny else LM_SIZES, fused.patch, fused.unpatch, backend):
            report["timing"].append({"family": family, **row})
            print(f"[{family}] {row_text(row)}", flush=True)


def run_flux(report, tiny, backend, on_gpu) -> None:
    try:
        import diffusers  # noqa: F401
    except ImportError as error:
        report["notes"].append(f"diffusers cannot be imported ({error}): FLUX skipped")
        return
    dims = TINY_FLUX_DIMS if tiny else FLUX_DIMS
    sizes = TINY_FLUX_SIZES if tiny else FLUX_SIZES
    model = flux_transformer(dims, device="cuda" if on_gpu else "cpu")
    side, text = next(iter(sizes.values()))
    report["parity"]["flux"] = flux_parity(model, dims, side, text, backend)
    print(f"[flux] parity: {json.dumps(report['parity']['flux'])}", flush=True)
    if on_gpu:
        for row in flux_timing(model, dims, sizes, backend):
            report["timing"].append({"family": "flux", **row})
            print(f"[flux] {row_text(row)}", flush=True)


def build_kernels(backend: str) -> None:
    """Call each op once on tiny CUDA tensors: the first call builds (or loads) its kernels."""
    q = torch.ones(1, 2, 64, device="cuda", dtype=DTYPE)
    w = torch.ones(64, device="cuda", dtype=DTYPE)
    cookbook.qk_norm(q, q.clone(), w, w, backend=backend)
    cookbook.cross_head_norm(q, q.clone(), w.repeat(2), w.repeat(2), backend=backend)
    cache = torch.ones(1, 64, device="cuda")
    positions = torch.zeros(1, dtype=torch.int64, device="cuda")
    cookbook.qk_norm_rope(q, q.clone(), w, w, cache, positions, backend=backend)
    torch.cuda.synchronize()


def all_ok(report) -> bool:
    checks = [not report["errors"]] + [not row.get("not_repeatable") for row in report["timing"]]
    for result in report["parity"].values():
        for key, value in result.items():
            if isinstance(value, dict) and "ok" in value:
                checks.append(value["ok"])
    return all(checks)


def row_text(row) -> str:
    parts = [f"{row['size']:<10} {row['module']:<24}"]
    if row.get("not_repeatable"):
        return "  ".join(parts + [f"not timed: {row['not_repeatable']}"])
    for mode in MODES:
        if f"patched_{mode}_median_us" in row:
            parts.append(f"{mode}: {row[f'unpatched_{mode}_median_us']:8.1f} -> {row[f'patched_{mode}_median_us']:8.1f} us "
                         f"({speedup(row, mode):.2f}x)")
        else:
            parts.append(f"{mode}: capture failed ({row.get('graph_failed')})")
    return "  ".join(parts)


def speedup(row, mode) -> float:
    return row[f"unpatched_{mode}_median_us"] / row[f"patched_{mode}_median_us"]


def version_of(distribution: str):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def metadata(command: str, tiny: bool, backend: str) -> dict:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "gpu": gpu, "device_slug": gpu_slug(gpu) if gpu else "cpu", "tiny": tiny,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(), "command": command, "backend": backend, "dtype": str(DTYPE).replace("torch.", ""),
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": version_of("transformers"),
        "diffusers": version_of("diffusers"), "python": platform.python_version(),
        "timing": (f"median and p{LOW_PERCENTILE}-p{HIGH_PERCENTILE} of {TIMING_BLOCKS * REPLAYS_PER_BLOCK} calls per "
                   f"variant (after {WARMUP_REPLAYS} warm-up calls), each timed by its own CUDA events; CUDA-graph "
                   f"replays of unpatched and patched alternate in blocks of {REPLAYS_PER_BLOCK}"),
    }


def results_stem(report) -> str:
    return f"in_a_model_{report['meta']['device_slug']}" + ("_tiny" if report["meta"]["tiny"] else "")


def markdown(report) -> str:
    meta = report["meta"]
    lines = [
        f"# Fused q/k norms inside models on {meta['gpu'] or 'a CPU'}" + (" (tiny dims: a smoke run)" if meta["tiny"] else ""),
        "",
        "Written by `python -m cookbook.integrations.bench`: do not edit by hand, run the command again.",
        "",
        f"- device: {meta['gpu'] or 'CPU'}; torch {meta['torch']}, CUDA {meta['cuda']}; transformers "
        f"{meta['transformers']}, diffusers {meta['diffusers']}; {meta['dtype']}, backend={meta['backend']!r}",
        f"- date: {meta['date']}; commit: {meta['commit']}",
        f"- command: `{meta['command']}`",
        f"- timing: {meta['timing']}",
        "- models: random weights (random q/k norm weights too), two layers (FLUX: one block of each kind) of "
        + (f"tiny dims ({TINY_LM_DIMS}; {TINY_FLUX_DIMS})" if meta["tiny"] else
           ", ".join(f"{LM_FAMILIES[f].like}-like dims" if f in LM_FAMILIES else "FLUX.1-like dims" for f in report["parity"])
           + f"; vocabulary cut to {LM_FAMILIES['qwen3'].dims.vocab}"),
    ]
    for note in report["notes"]:
        lines.append(f"- note: {note}")
    for family, error in report["errors"].items():
        lines.append(f"- **{family} failed**: `{error}`")
    lines += ["", "## Parity", "",
              "Section: the model's own q/k norms (and rope) against the patched section, on the device, at the "
              f"model's head counts, {PARITY_BATCH} x {PARITY_TOKENS} tokens; rule: >= 99 % bit-identical and all "
              "within 4 ulp (FLUX, whose rounding order the fused op does not follow: all within 3 ulp of each rotated pair's magnitude). "
              "Output: "
              "logits (FLUX: the transformer's output) patched and unpatched against the same weights run in "
              "float32; rule: the patched rms error at most 1.1x the model's own. Greedy: "
              f"{GREEDY_TOKENS} generated tokens, patched and unpatched, the same? Attention in these checks (and "
              "in the timing's repeat check): PyTorch's SDPA limited to its "
              f"{', '.join(n.lower() for n in REPEATABLE_SDPA)} kernels, which repeat bit for bit (its default "
              "choice did not, for masked calls on an H200).", "",
              "| model | section | output | greedy same | torch.compile |",
              "|---|---|---|---|---|"]
    for family, result in report["parity"].items():
        out = result.get("logits") or result.get("output")
        lines.append(f"| {family} | {_verdict(result.get('section'))} | {_verdict(out)} | "
                     f"{_yes(result.get('greedy_same'))} | {_verdict(result.get('compile'))} |")
    if report["timing"]:
        lines += ["", "## Time per call", "",
                  "Median us (p20-p80) per call of the module with the arguments the model passed it; speedup = "
                  "unpatched / patched. graph: CUDA-graph replays (GPU time); eager: plain calls as `generate` makes "
                  "them without graphs (launch and Python overhead included).", "",
                  "| model | size | tokens | module | graph: unpatched | graph: patched | graph speedup | "
                  "eager: unpatched | eager: patched | eager speedup | output vs unpatched |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in report["timing"]:
            cells = [row["family"], row["size"], row["tokens"], row["module"]]
            if row.get("not_repeatable"):
                lines.append("| " + " | ".join(cells + [f"not timed: {row['not_repeatable']}"] + ["-"] * 6) + " |")
                continue
            for mode in MODES:
                if f"patched_{mode}_median_us" not in row:
                    cells += [f"capture failed: {row.get('graph_failed')}", "-", "-"]
                    continue
                cells += [_timing_cell(row, f"unpatched_{mode}"), _timing_cell(row, f"patched_{mode}"),
                          f"{speedup(row, mode):.2f}x"]
            cells.append(row["output_vs_unpatched"])
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _timing_cell(row, variant) -> str:
    return f"{row[variant + '_median_us']:.1f} ({row[variant + '_p20_us']:.1f}-{row[variant + '_p80_us']:.1f})"


def _verdict(result) -> str:
    if result is None:
        return "-"
    return ("ok: " if result["ok"] else "FAIL: ") + result["detail"]


def _yes(value) -> str:
    return "-" if value is None else ("yes" if value else "no")


def write(report, results_dir: Path) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = results_stem(report)
    (results_dir / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (results_dir / f"{stem}.md").write_text(markdown(report))
    print(f"wrote {results_dir / stem}.md and .json", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny dims: a smoke run (any machine)")
    parser.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES), choices=[*LM_FAMILIES, "flux"])
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where to write the .md and .json (default: docs/results; with --tiny: bench_out)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile check (GPU)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results_dir = args.results_dir or (Path("bench_out") if args.tiny else REPO_ROOT / "docs" / "results")
    command = "python -m cookbook.integrations.bench" + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(sys.argv[1:] if argv is None else argv))
    report = run(args.tiny, args.families, results_dir, command, args.backend, not args.no_compile)
    ok = all_ok(report)
    print("parity: all ok" if ok else "parity: FAILED (see the table)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
