"""Which rounding does my model use: the model families that carry a QK norm, and how each one
normalizes q and k, in one table (docs/models.md is generated from it).

For each family: where its attention code lives, whether the norm runs per head (over head_dim)
or across heads (over each token's whole q row and k row), the rounding order of its norm module
(``"hf"``: the normalized value rounded to the activation dtype before the weight multiplies it;
``"fused"``: the weight multiplied in float32 and the result rounded once), the ``weight_offset``
its weight is applied with (``1.0``: ``x * (1 + w)``), where its RoPE runs, and the cookbook op to
call. tests/test_models.py checks every row against the installed library's own modules (the norm
module's output in bf16 against both rounding orders, the norm's width against head_dim), where the
library is installed. Families without a QK norm (Llama, Qwen2.5, Gemma2) are not in it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelNorm:
    family: str
    library: str  # "transformers" or "diffusers"
    module: str  # the attention code: transformers.models.<module>, diffusers.models.transformers.<module>
    attention: str  # the attention (or block) class that owns the q/k norms
    scope: str  # "per head" or "across heads"
    rounding: str  # the norm module's order: "hf" or "fused"
    weight_offset: float  # 1.0: the weight is applied as (1 + w)
    rope: str  # where the rotary embedding runs
    op: str  # the cookbook op to call
    patched: str  # what cookbook.integrations does for it, or "-"

    @property
    def module_path(self) -> str:
        if self.library == "transformers":
            return f"transformers.models.{self.module}.modeling_{self.module}"
        return f"diffusers.models.transformers.{self.module}"


NEOX_AFTER_NORM = "NeoX (rotate_half), right after the norm"
MODELS = [
    ModelNorm("Qwen3", "transformers", "qwen3", "Qwen3Attention", "per head", "hf", 0.0, NEOX_AFTER_NORM,
              'qk_norm_rope, rounding="hf"', "qk_norm_rope: norm and RoPE in one pass"),
    ModelNorm("Qwen3-MoE", "transformers", "qwen3_moe", "Qwen3MoeAttention", "per head", "hf", 0.0, NEOX_AFTER_NORM,
              'qk_norm_rope, rounding="hf"', "qk_norm_rope: norm and RoPE in one pass"),
    ModelNorm("Qwen3-VL (text model)", "transformers", "qwen3_vl", "Qwen3VLTextAttention", "per head", "hf", 0.0,
              "NeoX with multimodal (M-RoPE) cos/sin, right after the norm",
              'qk_norm_rope with the model\'s cos/sin, rounding="hf"', "-"),
    ModelNorm("Gemma3", "transformers", "gemma3", "Gemma3Attention", "per head", "fused", 1.0, NEOX_AFTER_NORM,
              'qk_norm, rounding="fused", weight_offset=1.0', "qk_norm, then the model's RoPE"),
    ModelNorm("OLMo2", "transformers", "olmo2", "Olmo2Attention", "across heads", "fused", 0.0,
              "NeoX, after the norm and the split into heads", 'cross_head_norm, rounding="fused"',
              "cross_head_norm, then the model's RoPE"),
    ModelNorm("OLMo3", "transformers", "olmo3", "Olmo3Attention", "across heads", "fused", 0.0,
              "NeoX, after the norm and the split into heads", 'cross_head_norm, rounding="fused"', "-"),
    ModelNorm("FlexOlmo", "transformers", "flex_olmo", "FlexOlmoAttention", "across heads", "fused", 0.0,
              "NeoX, after the norm and the split into heads", 'cross_head_norm, rounding="fused"', "-"),
    ModelNorm("MiniMax-M2", "transformers", "minimax_m2", "MiniMaxM2Attention", "across heads", "hf", 0.0,
              "NeoX on part of each head, after the norm and the split into heads",
              'cross_head_norm, rounding="hf"; tp_qk_norm under tensor parallelism', "-"),
    ModelNorm("FLUX.1", "diffusers", "transformer_flux", "FluxAttention", "per head", "fused", 0.0,
              "interleaved pairs, in float32 after the normalized q and k are rounded",
              'qk_norm_rope, is_neox=False, rounding="fused" (one rounding where FLUX has two)',
              "qk_norm_rope: norm and RoPE in one pass"),
    ModelNorm("Qwen-Image", "diffusers", "transformer_qwenimage", "QwenImageTransformerBlock", "per head", "hf", 0.0,
              "interleaved pairs (complex multiply), after the norm", 'qk_norm_rope, is_neox=False', "-"),
    ModelNorm("Wan 2.1 / 2.2", "diffusers", "transformer_wan", "WanAttention", "across heads", "fused", 0.0,
              "interleaved pairs (complex multiply), after the norm and the split into heads",
              'cross_head_norm, rounding="fused"', "-"),
]

HEADER = ("family", "library: attention", "norm over", "rounding", "weight_offset", "RoPE", "cookbook op",
          "cookbook.integrations")


def markdown_table() -> str:
    """The table of docs/models.md."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for m in MODELS:
        lines.append(f"| {m.family} | {m.library}: `{m.attention}` | {m.scope} | `{m.rounding}` | {m.weight_offset:g} | "
                     f"{m.rope} | `{m.op}` | {m.patched} |")
    return "\n".join(lines)
