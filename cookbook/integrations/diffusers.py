"""Fused q/k norm and rotary embedding in the FLUX transformer of diffusers.

    from cookbook.integrations import diffusers as fused
    report = fused.patch(pipe)        # a FluxPipeline, or its pipe.transformer
    ...
    fused.unpatch(pipe)

What changes
------------
Every ``FluxAttention`` module whose processor is diffusers' ``FluxAttnProcessor`` gets our
processor instead (``attn.set_processor``, diffusers' own seam for attention code). FLUX's
processor normalizes four tensors (image q and k with ``norm_q`` / ``norm_k``, text q and k with
``norm_added_q`` / ``norm_added_k``), joins text and image tokens into one sequence ``[text |
image]``, then rotates q and k with the sequence's cos/sin (``image_rotary_emb``, one row per
token, text rows first). Ours projects each stream the same way and, before joining them, runs
``cookbook.qk_norm_rope`` in place on each stream's q and k (views of its projection output):

* the text stream with the ``norm_added_*`` weights and cache rows ``0 .. text_len - 1``;
* the image stream with the ``norm_*`` weights, positions ``0 .. image_len - 1`` and
  ``position_offset=text_len``: the op reads cache row ``position + text_len``, the image's rows
  of the joined sequence's table.

A single-stream block (text and image already one sequence, one pair of norms) is one call over
all tokens. Four norms and two rotations become two launches (one in a single-stream block).
Then the streams are joined and attention runs through diffusers' ``dispatch_attention_fn`` with
the original processor's backend settings, then the output projections, as in the original.

Rounding: FLUX rotates in float32 but first rounds the normalized q and k to the activation
dtype; ``qk_norm_rope`` has no such middle rounding, so we use ``rounding="fused"`` (one rounding
at the end). In bfloat16 the two differ by an ulp or two of a rotated pair's magnitude in a share
of the elements; the patch-time check bounds that (see `probe`), and the tests judge the whole
transformer by accuracy against a float32 run of the same weights.
"""

from __future__ import annotations

import copy

import torch

import cookbook
from cookbook.integrations import (
    LayoutError,
    PatchedModule,
    PatchReport,
    SkippedModule,
    compare,
    prepare_backend,
    require_inference,
    require_model,
)

LIBRARY = "diffusers"
TESTED_VERSIONS = ">=0.35,<0.43"  # FluxAttention and its processor seam; the tests ran on 0.35.2 and 0.42.1
ATTENTION_CLASS, PROCESSOR_CLASS = "FluxAttention", "FluxAttnProcessor"
PATCH_ATTRIBUTE = "_cookbook_fused_patch"
SPEC = dict(op="qk_norm_rope", rounding="fused", weight_offset=0.0)

# FLUX rounds the normalized q and k before rotating them (once, or twice where its norm rounds
# before the weight too, as torch's RMSNorm may); we do not. That moves each input of a rotation
# by up to about one ulp, the rotated pair by up to sqrt(2) ulp of its magnitude, and the two
# final roundings add one more: under 3 ulp of the pair's magnitude.
PROBE_MAX_ULP = 3.0
PROBE_TEXT_TOKENS, PROBE_IMAGE_TOKENS = 4, 8
PROBE_ROPE_BASE = 10000.0
PROBE_MAX_POSITION = 4096
PROBE_WEIGHT_SPREAD = 0.25
PROBE_SEED = 0


class FusedFluxAttnProcessor:
    """FLUX attention with its q/k norms and rotary embedding as `cookbook.qk_norm_rope` calls."""

    def __init__(self, original, backend: str, where: str):
        self.original, self.backend, self.where = original, backend, where
        # diffusers configures the attention kernel on the processor (set_attention_backend, and
        # from 0.36 context parallelism): carry the original's settings over
        self._attention_backend = getattr(original, "_attention_backend", None)
        self._parallel_config = getattr(original, "_parallel_config", None)
        self.dispatch_settings = {"backend": self._attention_backend}
        if hasattr(original, "_parallel_config"):
            self.dispatch_settings["parallel_config"] = self._parallel_config

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        streams = [(self.projections(attn, hidden_states), attn.norm_q, attn.norm_k)]
        if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:  # text tokens go first
            streams.insert(0, (self.projections(attn, encoder_hidden_states, added=True), attn.norm_added_q, attn.norm_added_k))
        require_inference(streams[0][0][0], self.where)
        tokens = sum(qkv[0].shape[1] for qkv, _, _ in streams)
        cache = None if image_rotary_emb is None else flux_cos_sin_cache(image_rotary_emb, tokens, self.where)
        offset = 0
        for (q, k, _), q_norm, k_norm in streams:
            self.norm_and_rope(q, k, q_norm, k_norm, cache, offset)
            offset += q.shape[1]
        query, key, value = (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
                             for parts in zip(*(qkv for qkv, _, _ in streams)))

        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, **self.dispatch_settings)
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out
        text_len = encoder_hidden_states.shape[1]
        text_out, image_out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())

    @staticmethod
    def projections(attn, hidden_states, added=False):
        """q, k, v of one stream (image, or with `added` the text), ``[batch, tokens, heads, head_dim]``
        views of the projection outputs. Not normalized yet."""
        fused_name = "to_added_qkv" if added else "to_qkv"
        if getattr(attn, "fused_projections", False) and hasattr(attn, fused_name):
            q, k, v = getattr(attn, fused_name)(hidden_states).chunk(3, dim=-1)
        elif added:
            q, k, v = attn.add_q_proj(hidden_states), attn.add_k_proj(hidden_states), attn.add_v_proj(hidden_states)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        return tuple(x.unflatten(-1, (-1, attn.head_dim)) for x in (q, k, v))

    def norm_and_rope(self, q, k, q_norm, k_norm, cache, position_offset):
        """In place on one stream's q and k: its token t takes cache row t + position_offset."""
        eps = q_norm.eps if q_norm.eps is not None else torch.finfo(q.dtype).eps  # torch's RMSNorm: eps=None
        if cache is None:
            cookbook.qk_norm(q, k, q_norm.weight, k_norm.weight, eps, rounding=SPEC["rounding"], backend=self.backend)
            return
        batch, tokens = q.shape[:2]
        positions = torch.arange(tokens, device=q.device).expand(batch, tokens).contiguous()
        cookbook.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, cache, positions, eps, is_neox=False,
                              position_offset=position_offset, rounding=SPEC["rounding"], backend=self.backend)


def flux_cos_sin_cache(image_rotary_emb, tokens: int, where: str) -> torch.Tensor:
    """FLUX's (cos, sin), ``[tokens, head_dim]`` with each angle repeated for the two dims of its
    interleaved pair, as the op's ``[tokens, head_dim]`` cache: cos_i | sin_i, one per pair."""
    cos, sin = image_rotary_emb
    if cos.dim() != 2 or cos.shape[0] != tokens or sin.shape != cos.shape:
        raise LayoutError(f"{where}: expected image_rotary_emb (cos, sin) of [tokens={tokens}, head_dim], got "
                          f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    dtype = cos.dtype if cos.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
    return torch.cat((cos[:, 0::2], sin[:, 0::2]), dim=-1).to(dtype).contiguous()


# --------------------------------------------------------------------------------------------
# Patch-time checks.
# --------------------------------------------------------------------------------------------
def section_comparisons(attn, *, device="cpu", backend="reference", dtype=torch.bfloat16, heads=2,
                        text_tokens=PROBE_TEXT_TOKENS, image_tokens=PROBE_IMAGE_TOKENS, own_weights=False) -> dict:
    """{"q": Comparison, "k": Comparison}: the module's own norms and diffusers' rotary embedding
    against our `norm_and_rope`, on random q and k of the joined ``[text | image]`` layout.

    The norms are copies (in `dtype`, on `device`), with random weights unless `own_weights`."""
    from diffusers.models.embeddings import apply_rotary_emb

    gen = torch.Generator().manual_seed(PROBE_SEED)
    norms = {}
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        if getattr(attn, name, None) is None:
            continue
        norm = copy.deepcopy(getattr(attn, name)).to(device, dtype)
        if not own_weights:
            with torch.no_grad():
                norm.weight.copy_(1.0 + PROBE_WEIGHT_SPREAD * torch.randn(norm.weight.shape, generator=gen))
        norms[name] = norm
    joint = "norm_added_q" in norms
    text_len = text_tokens if joint else 0
    tokens = text_len + image_tokens
    head_dim = norms["norm_q"].weight.numel()
    q, k = (torch.randn(2, tokens, heads, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    inv_freq = PROBE_ROPE_BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.rand(tokens, 1, dtype=torch.float64, generator=gen) * PROBE_MAX_POSITION * inv_freq
    rope = tuple(f(angles).repeat_interleave(2, dim=1).float().to(device) for f in (torch.cos, torch.sin))

    streams = [(slice(text_len, None), "norm_q", "norm_k", text_len)]
    if joint:
        streams.insert(0, (slice(0, text_len), "norm_added_q", "norm_added_k", 0))
    section = FusedFluxAttnProcessor(None, backend, "section check")
    cache = flux_cos_sin_cache(rope, tokens, "section check")
    with torch.no_grad():
        theirs = {}
        for name, x in (("q", q), ("k", k)):  # FLUX's order: norm each stream, join, rotate
            parts = [norms[f"norm_{name}"](x[:, text_len:])]
            if joint:
                parts.insert(0, norms[f"norm_added_{name}"](x[:, :text_len]))
            theirs[name] = apply_rotary_emb(torch.cat(parts, dim=1), rope, sequence_dim=1)
        ours = {"q": q.clone(), "k": k.clone()}
        for part, q_name, k_name, offset in streams:
            q_part, k_part = q[:, part].clone(), k[:, part].clone()  # one stream, as the processor sees it
            section.norm_and_rope(q_part, k_part, norms[q_name], norms[k_name], cache, offset)
            ours["q"][:, part], ours["k"][:, part] = q_part, k_part
    return {name: compare(ours[name], theirs[name], pair_magnitude(theirs[name])) for name in ("q", "k")}


def pair_magnitude(x: torch.Tensor) -> torch.Tensor:
    """|(a, b)| of each interleaved pair, for both of its dims: the scale a rotation preserves
    (see PROBE_MAX_ULP)."""
    pairs = x.double().unflatten(-1, (-1, 2))
    return pairs.square().sum(-1, keepdim=True).sqrt().expand_as(pairs).flatten(-2)


def probe(attn, where: str) -> None:
    """The patch-time check: `section_comparisons` on a small random input (CPU, reference
    backend, bfloat16); LayoutError unless every element is within PROBE_MAX_ULP."""
    for name, result in section_comparisons(attn).items():
        if result.max_ulp > PROBE_MAX_ULP:
            raise LayoutError(
                f"{where}: cookbook.qk_norm_rope(rounding='fused') is not within {PROBE_MAX_ULP} ulp of the model's own {name} "
                f"norm and rope in {LIBRARY} {installed_version()}: {result} (tested with {LIBRARY}{TESTED_VERSIONS})"
            )


def check_pos_embed(transformer, where: str) -> None:
    """FLUX's rotary table repeats each angle for the two dims of a pair (what the cache reads)."""
    pos_embed = getattr(transformer, "pos_embed", None)
    if pos_embed is None:
        return
    axes = len(getattr(pos_embed, "axes_dim", ())) or 3
    device = next(transformer.parameters()).device
    ids = torch.arange(PROBE_IMAGE_TOKENS * axes, device=device).view(PROBE_IMAGE_TOKENS, axes).float()
    cos, sin = pos_embed(ids)
    if not (torch.equal(cos[:, 0::2], cos[:, 1::2]) and torch.equal(sin[:, 0::2], sin[:, 1::2])):
        raise LayoutError(f"{where}: {type(pos_embed).__name__} does not repeat each angle for both dims of a pair")


# --------------------------------------------------------------------------------------------
# patch / unpatch
# --------------------------------------------------------------------------------------------
def _transformer_of(pipe_or_transformer):
    transformer = getattr(pipe_or_transformer, "transformer", None)
    if isinstance(transformer, torch.nn.Module):
        return transformer
    require_model(pipe_or_transformer, "a FluxPipeline or a FluxTransformer2DModel")
    return pipe_or_transformer


def patch(pipe_or_transformer, *, backend: str = "auto") -> PatchReport:
    """Give every FLUX attention module of the pipeline's transformer (or of the given module) the
    fused processor. Returns a `PatchReport`; raises if none is found or it is already patched."""
    transformer = _transformer_of(pipe_or_transformer)
    where = type(transformer).__name__
    if getattr(transformer, PATCH_ATTRIBUTE, None) is not None:
        raise RuntimeError(f"model: {where} is already patched by cookbook.integrations.{LIBRARY}; call unpatch first")
    plans, skipped, probed = [], [], False
    for name, module in transformer.named_modules():
        cls = type(module).__name__
        if not cls.endswith("Attention"):
            continue
        processor = getattr(module, "processor", None)
        reason = _why_not(module, processor)
        if reason:
            skipped.append(SkippedModule(name, cls, reason))
            continue
        if not probed:
            probe(module, f"{name} ({cls})")
            probed = True
        plans.append((name, module, processor))
    if not plans:
        found = "; ".join(f"{m.name} ({m.cls}): {m.reason}" for m in skipped[:4]) or "no attention modules"
        raise ValueError(f"model: no FLUX attention with {PROCESSOR_CLASS} in {where} ({found})")
    check_pos_embed(transformer, where)
    prepare_backend(backend, plans[0][1].norm_q.weight.device, ("qk_norm", "qk_norm_rope"))
    patched = []
    for name, module, processor in plans:
        module.set_processor(FusedFluxAttnProcessor(processor, backend, f"{name} ({type(module).__name__})"))
        patched.append(PatchedModule(name, type(module).__name__, SPEC["op"], SPEC["rounding"], SPEC["weight_offset"], True))
    report = PatchReport(LIBRARY, backend, tuple(patched), tuple(skipped))
    setattr(transformer, PATCH_ATTRIBUTE, (report, [(module, processor) for _, module, processor in plans]))
    return report


def unpatch(pipe_or_transformer) -> PatchReport:
    """Put the original processors back; returns the report of the patch it undoes."""
    transformer = _transformer_of(pipe_or_transformer)
    state = getattr(transformer, PATCH_ATTRIBUTE, None)
    if state is None:
        raise RuntimeError(f"model: {type(transformer).__name__} is not patched by cookbook.integrations.{LIBRARY} "
                           "(nothing to unpatch)")
    report, installed = state
    for module, processor in installed:
        module.set_processor(processor)
    delattr(transformer, PATCH_ATTRIBUTE)
    return report


def _why_not(module, processor) -> str | None:
    if type(module).__name__ != ATTENTION_CLASS:
        return f"not {ATTENTION_CLASS}"
    if type(processor).__name__ != PROCESSOR_CLASS:
        return f"processor {type(processor).__name__}, not {PROCESSOR_CLASS} (IP-Adapter and custom processors are left alone)"
    norms = [getattr(module, n, None) for n in ("norm_q", "norm_k")]
    if getattr(module, "added_kv_proj_dim", None) is not None:
        norms += [getattr(module, n, None) for n in ("norm_added_q", "norm_added_k")]
    if any(getattr(n, "weight", None) is None for n in norms):
        return "a q/k norm without a weight"
    return None


def installed_version() -> str:
    import diffusers

    return diffusers.__version__
