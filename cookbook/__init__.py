"""Fused Norm Cookbook: the fused normalization kernels of LLM and diffusion inference.

Each op exists as a PyTorch reference, a Numba CUDA kernel and optimized CUDA C versions; the
registry (`cookbook.registry`) lists them all. Importing this package imports neither Numba nor
the CUDA extension: both load on first use.
"""

from cookbook.ops.cross_head_norm import cross_head_norm
from cookbook.ops.qk_norm import qk_norm
from cookbook.ops.qk_norm_rope import qk_norm_rope
from cookbook.ops.tp_qk_norm import tp_qk_norm, virtual_tp

__all__ = ["qk_norm", "cross_head_norm", "tp_qk_norm", "virtual_tp", "qk_norm_rope"]
__version__ = "0.1.0"
