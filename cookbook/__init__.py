"""Fused Norm Cookbook: the fused normalization kernels of LLM and diffusion inference.

The ops (each in place on q and k, each with ``backend="auto" | "cuda" | "numba" | "reference"``):

* `qk_norm`: per-head RMSNorm of q and k (Qwen3, Gemma3);
* `cross_head_norm`: RMSNorm over each token's whole q row and k row (OLMo2, Wan, MiniMax);
* `tp_qk_norm`: `cross_head_norm` over tensor-parallel column shards (a collective);
* `qk_norm_rope`: per-head RMSNorm then rotary embedding, in one pass (FLUX, Qwen-Image, Qwen3);
* `qk_norm_rope_cache`: `qk_norm_rope`, then k and v written into a paged KV cache (bf16/fp16 or FP8), one pass.

Each exists as a PyTorch reference, Numba CUDA kernels and CUDA C kernels (a teaching ladder and a
tuned kernel); `cookbook.registry` lists them all, `cookbook.ops.<op>` holds each op's contract.
`explain` says which kernel a call runs, with which template arguments, grid and block, and why.
Importing this package imports neither Numba nor the CUDA extensions: both load on first use.
"""

from cookbook.api import cross_head_norm, qk_norm, qk_norm_rope, qk_norm_rope_cache, tp_qk_norm, virtual_tp
from cookbook.explainer import explain

__all__ = ["qk_norm", "cross_head_norm", "tp_qk_norm", "virtual_tp", "qk_norm_rope", "qk_norm_rope_cache", "explain"]
__version__ = "0.1.0"
