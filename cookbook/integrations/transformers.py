"""Fused q/k norms in Hugging Face transformers models: Qwen3 (and Qwen3-MoE), Gemma3, OLMo2.

    from cookbook.integrations import transformers as fused
    report = fused.patch(model)   # in place; prints as a summary of what it patched
    ...                           # model(...), model.generate(...), torch.compile(model)
    fused.unpatch(model)          # the original forwards again

What changes
------------
Each supported attention module normalizes q and k with two norm modules (``q_norm``,
``k_norm``) and then calls the module-level function ``apply_rotary_pos_emb`` on both. The patch
runs **the model's own attention forward, unchanged**, with three names rebound for that one
module:

* ``self.q_norm`` and ``self.k_norm`` pass their input through;
* ``apply_rotary_pos_emb`` becomes our fused section: the first place where q and k are both at
  hand, still as views of the projection outputs. It normalizes them in place in one launch and
  either applies the rotary embedding in the same pass (Qwen3: ``cookbook.qk_norm_rope`` on the
  model's own cos/sin) or hands them to the model's own ``apply_rotary_pos_emb`` (Gemma3:
  ``cookbook.qk_norm``; OLMo2: ``cookbook.cross_head_norm``).

Everything else (projections, KV cache, masks, sliding windows, the attention backend, the output
projection) is the installed transformers' code, so any batch, sequence or cache layout the
model accepts works, and ``torch.compile`` traces the fused ops as opaque custom ops.

Each model keeps its own norm's rounding order (read in its source, checked at patch time):
Qwen3's norm rounds the normalized value to the activation dtype before multiplying by the
weight (``rounding="hf"``), and its rotary embedding rounds each product in that dtype, which is
``qk_norm_rope``'s "hf" order too. Gemma3's and OLMo2's norms multiply by the weight in float32
and round once (``rounding="fused"``); Gemma3's weight is stored as ``w`` and applied as
``1 + w`` (``weight_offset=1.0``).

At patch time, for every attention class found, a small random input goes through the model's
own norm modules and rope function and through our replacement (reference backend, CPU,
bfloat16); the patch refuses, with a message, unless they agree to the op contracts' rule. A
transformers version whose forward no longer has these names, or whose norms round differently,
fails there instead of computing something else.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

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

LIBRARY = "transformers"
TESTED_VERSIONS = ">=4.53,<6"  # the tests ran on 4.53.3, 4.57.6 and 5.24.0
ROPE_FUNCTION = "apply_rotary_pos_emb"  # the module-level function the attention forwards call
NORM_NAMES = ("q_norm", "k_norm")
PATCH_ATTRIBUTE = "_cookbook_fused_patch"  # on the model: what unpatch needs


@dataclass(frozen=True)
class NormSpec:
    """How one attention class normalizes q and k, and which cookbook op replaces that."""

    op: str  # "qk_norm_rope" (norm and rope in one pass), "qk_norm" or "cross_head_norm"
    rounding: str
    weight_offset: float = 0.0

    @property
    def fused_rope(self) -> bool:
        return self.op == "qk_norm_rope"


# Read from each model's norm module (see the module docstring); verified by the patch-time probe.
SPECS = {
    "Qwen3Attention": NormSpec("qk_norm_rope", "hf"),
    "Qwen3MoeAttention": NormSpec("qk_norm_rope", "hf"),
    "Gemma3Attention": NormSpec("qk_norm", "fused", weight_offset=1.0),
    "Olmo2Attention": NormSpec("cross_head_norm", "fused"),
}

PROBE_TOKENS = 8
PROBE_MAX_POSITION = 4096
PROBE_ROPE_BASE = 10000.0
PROBE_WEIGHT_SPREAD = 0.25  # probe norm weights: 1 + 0.25 * N(0, 1) as applied (w + weight_offset)
PROBE_SEED = 0


# --------------------------------------------------------------------------------------------
# The fused section: what `apply_rotary_pos_emb` becomes inside a patched attention forward.
# --------------------------------------------------------------------------------------------
class FusedSection:
    """Norm of q and k (and, for qk_norm_rope, the rotary embedding) in one in-place launch.

    Called where the model calls ``apply_rotary_pos_emb(q, k, cos, sin)``: q and k are
    ``[batch, heads, seq, head_dim]`` views of the projection outputs (not yet normalized: the
    norm modules passed them through), cos and sin ``[batch or 1, seq, head_dim]``."""

    def __init__(self, q_norm, k_norm, spec: NormSpec, model_rope, backend: str, where: str):
        self.q_norm, self.k_norm = q_norm, k_norm  # read at every call: their weights may move or change
        self.spec, self.model_rope, self.backend, self.where = spec, model_rope, backend, where
        self.eps = norm_eps(q_norm, where)

    def __call__(self, q, k, cos, sin, *args, **kwargs):
        require_inference(q, self.where)
        extra_arguments = bool(args or kwargs) and self.spec.fused_rope  # we would have to pass them on
        if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape or extra_arguments:
            raise LayoutError(
                f"{self.where}: expected {ROPE_FUNCTION}(q [batch, heads, seq, head_dim], k, cos [batch, seq, "
                f"rope_dim], sin) with four arguments, got q {tuple(q.shape)}, k {tuple(k.shape)}, cos "
                f"{tuple(cos.shape)} and {len(args) + len(kwargs)} more argument(s) ({LIBRARY} {installed_version()})"
            )
        q_rows, k_rows = q.transpose(1, 2), k.transpose(1, 2)  # [batch, seq, heads, head_dim] views
        w_q, w_k = self.q_norm.weight, self.k_norm.weight
        spec = self.spec
        if spec.op == "qk_norm_rope":
            if cos.dtype != q.dtype:
                raise LayoutError(f"{self.where}: expected cos/sin in the activation dtype {q.dtype}, got {cos.dtype}")
            cache, positions = cos_sin_cache(cos, sin, q_rows.shape[0])
            cookbook.qk_norm_rope(q_rows, k_rows, w_q, w_k, cache, positions, self.eps, is_neox=True,
                                  weight_offset=spec.weight_offset, rounding=spec.rounding, backend=self.backend)
            return q, k
        if spec.op == "qk_norm":
            cookbook.qk_norm(q_rows, k_rows, w_q, w_k, self.eps, weight_offset=spec.weight_offset,
                             rounding=spec.rounding, backend=self.backend)
        else:  # cross_head_norm: the weight's length (heads * head_dim) makes each token's heads one row
            cookbook.cross_head_norm(q_rows, k_rows, w_q, w_k, self.eps, weight_offset=spec.weight_offset,
                                     rounding=spec.rounding, backend=self.backend)
        return self.model_rope(q, k, cos, sin, *args, **kwargs)


def cos_sin_cache(cos: torch.Tensor, sin: torch.Tensor, batch: int):
    """The model's per-token cos and sin as the op's ``[rows, rope_dim]`` cache (cos | sin halves),
    and each token's row in it, ``[batch, seq]``.

    Hugging Face's rotary tables repeat their frequencies (``cat(freqs, freqs)``), so the first
    half of each row holds every cos_i once (checked on the model's rotary modules at patch time)."""
    rows_of_cos, seq, rope_dim = cos.shape
    half = rope_dim // 2
    cache = torch.cat((cos[..., :half], sin[..., :half]), dim=-1).reshape(rows_of_cos * seq, rope_dim)
    positions = torch.arange(rows_of_cos * seq, device=cos.device).view(rows_of_cos, seq)
    return cache, positions.expand(batch, seq).contiguous()  # cos of batch 1 serves every sequence


def norm_eps(norm, where: str) -> float:
    """The eps of a Hugging Face RMSNorm module (named `variance_epsilon` or `eps`)."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    raise LayoutError(f"{where}: {type(norm).__name__} has no float `variance_epsilon` or `eps`")


def pass_through(hidden_states):
    """A patched attention's q_norm / k_norm: the norm now runs inside the fused section."""
    return hidden_states


# --------------------------------------------------------------------------------------------
# Running the model's own forward with names rebound.
# --------------------------------------------------------------------------------------------
def with_globals(fn, replacements: dict):
    """A copy of `fn` whose global names in `replacements` resolve to the given objects.

    `fn` may be wrapped by decorators (``functools.wraps``, each holding the next function in a
    closure cell); the copy keeps the whole chain and rebinds the names of the innermost function,
    the one whose code calls them."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        rebound = {**fn.__globals__, **replacements}
        # Without a module name, torch.compile guards the globals through this dict, not through
        # the module it would import by that name (where the names are not rebound).
        rebound.pop("__name__", None)
        copy = types.FunctionType(fn.__code__, rebound, fn.__name__, fn.__defaults__, fn.__closure__)
    else:
        cells = fn.__closure__ or ()
        holders = [cell for cell in cells if _cell_holds(cell, inner)]
        if len(holders) != 1:
            raise LayoutError(f"{fn.__qualname__}: a decorator that does not hold the function it wraps in a closure")
        new_inner = with_globals(inner, replacements)
        cells = tuple(types.CellType(new_inner) if cell is holders[0] else cell for cell in cells)
        copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
    copy.__dict__.update({k: v for k, v in fn.__dict__.items() if k != "__wrapped__"})  # what decorators set
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__, copy.__doc__, copy.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    if inner is not None:
        copy.__wrapped__ = new_inner
    return copy


def _cell_holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def attention_code(cls):
    """The innermost forward of an attention class, checked to call q_norm, k_norm and the rope function."""
    inner = inspect.unwrap(cls.forward)
    names = set(inner.__code__.co_names)
    missing = [name for name in (*NORM_NAMES, ROPE_FUNCTION) if name not in names]
    if missing or not callable(inner.__globals__.get(ROPE_FUNCTION)):
        raise LayoutError(
            f"{cls.__name__}.forward in {LIBRARY} {installed_version()} does not call {', '.join(missing) or ROPE_FUNCTION}: "
            f"not the layout this integration knows (tested with {LIBRARY}{TESTED_VERSIONS})"
        )
    return inner


# --------------------------------------------------------------------------------------------
# The patch-time checks.
# --------------------------------------------------------------------------------------------
def probe(cls_name: str, q_norm, k_norm, head_dim: int, spec: NormSpec, model_rope) -> None:
    """The model's own norms and rope against our section on a small random input (CPU, reference
    backend, bfloat16 or the norms' 16-bit dtype); raise LayoutError unless they agree."""
    dtype = q_norm.weight.dtype if q_norm.weight.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    gen = torch.Generator().manual_seed(PROBE_SEED)
    norms = []
    for norm in (q_norm, k_norm):
        copy = _cpu_copy(norm, dtype)
        with torch.no_grad():
            applied = 1.0 + PROBE_WEIGHT_SPREAD * torch.randn(copy.weight.shape, generator=gen)
            copy.weight.copy_(applied - spec.weight_offset)
        norms.append(copy)
    cross_head = spec.op == "cross_head_norm"
    q_heads = norms[0].weight.numel() // head_dim if cross_head else 2
    k_heads = norms[1].weight.numel() // head_dim if cross_head else 1
    q = torch.randn(1, PROBE_TOKENS, q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(1, PROBE_TOKENS, k_heads, head_dim, generator=gen).to(dtype)
    cos, sin = _probe_cos_sin(head_dim, dtype, gen)

    def model_norm(norm, x):  # the model normalizes [.., head_dim] rows, or OLMo2's whole [.., heads * head_dim]
        return norm(x.flatten(-2)).view_as(x) if cross_head else norm(x)

    with torch.no_grad():
        want = model_rope(model_norm(norms[0], q).transpose(1, 2), model_norm(norms[1], k).transpose(1, 2), cos, sin)
        section = FusedSection(*norms, spec, model_rope, "reference", cls_name)
        got = section(q.clone().transpose(1, 2), k.clone().transpose(1, 2), cos, sin)
    for name, ours, theirs in zip("qk", got, want):
        if ours.dtype != theirs.dtype:
            raise LayoutError(f"{cls_name}: its norm and rope return {name} in {theirs.dtype}, ours in {ours.dtype}")
        result = compare(ours, theirs)
        if not result.ok:
            raise LayoutError(
                f"{cls_name}: cookbook.{spec.op}(rounding={spec.rounding!r}, weight_offset={spec.weight_offset}) does "
                f"not reproduce the model's own {name} norm{' and rope' if spec.fused_rope else ''} in {LIBRARY} "
                f"{installed_version()}: {result} on a random {dtype} probe (tested with {LIBRARY}{TESTED_VERSIONS})"
            )


def _cpu_copy(norm, dtype):
    import copy

    clone = copy.deepcopy(norm).to("cpu", dtype)
    clone.__dict__.pop("forward", None)  # the class's own forward, even if this instance is patched
    return clone


def _probe_cos_sin(head_dim: int, dtype, gen):
    """cos and sin ``[1, tokens, head_dim]`` as Hugging Face's rotary modules build them."""
    positions = torch.randint(0, PROBE_MAX_POSITION, (1, PROBE_TOKENS), generator=gen).double()
    inv_freq = PROBE_ROPE_BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = positions[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def check_rotary_tables(model, where: str) -> None:
    """Every rotary module of the model repeats its frequencies (cos_i = cos_{i + half}), the
    layout `cos_sin_cache` relies on."""
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("RotaryEmbedding"):
            continue
        buffer = next(module.buffers(), None)
        device = buffer.device if buffer is not None else torch.device("cpu")
        x = torch.zeros(1, 1, 1, device=device, dtype=torch.float32)
        position_ids = torch.arange(PROBE_TOKENS, device=device)[None]
        try:
            with torch.no_grad():
                cos, sin = module(x, position_ids)[:2]
        except TypeError as error:
            raise LayoutError(f"{where}: cannot call {name} ({type(module).__name__}) as (x, position_ids): {error}") from error
        half = cos.shape[-1] // 2
        if not (torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])):
            raise LayoutError(f"{where}: {name} ({type(module).__name__}) does not repeat its frequencies in both "
                              "halves of cos/sin; the fused rope reads the first half only")


# --------------------------------------------------------------------------------------------
# patch / unpatch
# --------------------------------------------------------------------------------------------
@dataclass
class _Installed:
    """What one patched attention module needs to be restored."""

    attention: torch.nn.Module
    norms: tuple


def patch(model, *, backend: str = "auto") -> PatchReport:
    """Make every supported attention module of `model` run its q/k norms as one fused cookbook
    op, in place. Returns a `PatchReport`; raises if nothing is supported, if the model is
    already patched, or if a module's code is not a layout this integration knows."""
    require_model(model, "a loaded transformers model")
    if getattr(model, PATCH_ATTRIBUTE, None) is not None:
        raise RuntimeError(f"model: {type(model).__name__} is already patched by cookbook.integrations.{LIBRARY}; "
                           "call unpatch(model) first")
    where = type(model).__name__
    plans, skipped, checked = [], [], {}
    for name, module in model.named_modules():
        cls = type(module)
        if getattr(module, PATCH_ATTRIBUTE, None) is not None:
            raise RuntimeError(f"model: its submodule {name} ({cls.__name__}) is already patched; unpatch the model "
                               "that patch was applied to first")
        if cls.__name__ not in SPECS:
            if cls.__name__.endswith("Attention"):
                skipped.append(SkippedModule(name, cls.__name__, _why_not(module)))
            continue
        spec = SPECS[cls.__name__]
        label = f"{name} ({cls.__name__})"
        for part in (module, *(getattr(module, n, None) for n in NORM_NAMES)):
            if not isinstance(part, torch.nn.Module) or "forward" in part.__dict__:
                raise LayoutError(f"{label}: expected modules q_norm and k_norm with their class's own forward "
                                  "(an accelerate hook or another patch replaced one); patch before dispatching")
        q_norm, k_norm = module.q_norm, module.k_norm
        if norm_eps(q_norm, label) != norm_eps(k_norm, label):
            raise LayoutError(f"{label}: q_norm and k_norm have different eps; the fused ops take one")
        head_dim = _head_dim(module, spec, label)
        code = attention_code(cls)
        model_rope = code.__globals__[ROPE_FUNCTION]
        if cls not in checked:
            probe(cls.__name__, q_norm, k_norm, head_dim, spec, model_rope)
            checked[cls] = True
        plans.append((name, module, spec, model_rope))
    if not plans:
        found = "; ".join(f"{m.name} ({m.cls}): {m.reason}" for m in skipped[:4]) or "no attention modules"
        raise ValueError(f"model: no supported attention module in {where} ({found}); supported: {', '.join(SPECS)}")
    if any(spec.fused_rope for _, _, spec, _ in plans):
        check_rotary_tables(model, where)
    first = plans[0][1]
    prepare_backend(backend, first.q_norm.weight.device, [spec.op for _, _, spec, _ in plans])

    installed, patched = [], []
    for name, module, spec, model_rope in plans:
        section = FusedSection(module.q_norm, module.k_norm, spec, model_rope, backend, f"{name} ({type(module).__name__})")
        forward = with_globals(type(module).forward, {ROPE_FUNCTION: section})
        module.forward = types.MethodType(forward, module)
        for norm in (module.q_norm, module.k_norm):
            norm.forward = pass_through
        setattr(module, PATCH_ATTRIBUTE, spec)
        installed.append(_Installed(module, (module.q_norm, module.k_norm)))
        patched.append(PatchedModule(name, type(module).__name__, spec.op, spec.rounding, spec.weight_offset, spec.fused_rope))
    report = PatchReport(LIBRARY, backend, tuple(patched), tuple(skipped))
    setattr(model, PATCH_ATTRIBUTE, (report, installed))
    return report


def unpatch(model) -> PatchReport:
    """Restore the original forwards of everything `patch(model)` changed; returns its report."""
    require_model(model, "a model patched by cookbook.integrations.transformers.patch")
    state = getattr(model, PATCH_ATTRIBUTE, None)
    if state is None:
        raise RuntimeError(f"model: {type(model).__name__} is not patched by cookbook.integrations.{LIBRARY} "
                           "(nothing to unpatch)")
    report, installed = state
    for entry in installed:
        del entry.attention.forward
        delattr(entry.attention, PATCH_ATTRIBUTE)
        for norm in entry.norms:
            del norm.forward
    delattr(model, PATCH_ATTRIBUTE)
    return report


def _head_dim(module, spec: NormSpec, label: str) -> int:
    """The module's head_dim, checked against its norm weights (one head long, or whole rows of heads)."""
    head_dim = getattr(module, "head_dim", None)
    widths = [getattr(module, n).weight.numel() for n in NORM_NAMES]
    if spec.op == "cross_head_norm":
        fits = isinstance(head_dim, int) and all(w % head_dim == 0 for w in widths)
    else:
        fits = widths == [head_dim, head_dim]
    if not fits:
        raise LayoutError(f"{label}: head_dim={head_dim!r} does not fit q_norm/k_norm weights of {widths} elements "
                          f"for cookbook.{spec.op}")
    return head_dim


def _why_not(module) -> str:
    if all(isinstance(getattr(module, n, None), torch.nn.Module) for n in NORM_NAMES):
        return f"has q_norm/k_norm but is not a layout this integration knows (supported: {', '.join(SPECS)})"
    return "no q/k norm to fuse"


def installed_version() -> str:
    import transformers

    return transformers.__version__
