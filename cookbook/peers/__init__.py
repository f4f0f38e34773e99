"""Peers measured side by side with our kernels: what a user would run instead.

Each peer is a factory returning a fresh callable with the registry's calling convention, so
the benchmark compiles one per shape (static shapes, no recompile limit to hit).

Here: torch.compile of the references and the collective op's all-gather baseline. The kernels of
other packages, each behind an import guard (`cookbook.peers.guard`) and called through
`cookbook.peers.adapter.PeerKernel`: SGLang's JIT kernels (`sglang_jit`), FlashInfer's norm and
RoPE (`flashinfer_ops`) and Liger-Kernel's Triton ones (`liger_triton`); `cookbook.peers.orders`
says which rounding order a peer's output follows. docs/peers.md tells how each is installed and
loaded.
"""

from __future__ import annotations

import torch


def qk_norm_compiled():
    """torch.compile(fullgraph=True) of the PyTorch reference (in place, like ours)."""
    from cookbook.ops.qk_norm import reference

    return torch.compile(reference, fullgraph=True, dynamic=False)


def cross_head_norm_compiled():
    """torch.compile(fullgraph=True) of the cross_head_norm reference (in place, like ours)."""
    from cookbook.ops.cross_head_norm import reference

    return torch.compile(reference, fullgraph=True, dynamic=False)


def qk_norm_rope_compiled():
    """torch.compile(fullgraph=True) of the qk_norm_rope reference (in place, like ours)."""
    from cookbook.ops.qk_norm_rope import reference

    return torch.compile(reference, fullgraph=True, dynamic=False)


def qk_norm_rope_cache_compiled():
    """torch.compile(fullgraph=True) of the qk_norm_rope_cache reference (in place, like ours)."""
    from cookbook.ops.qk_norm_rope_cache import reference

    compiled = torch.compile(reference, fullgraph=True, dynamic=False)

    def run(*args):
        # The reference finds the tokens that write with nonzero(): a data-dependent shape, which
        # fullgraph compiles only with this flag (and which a CUDA graph cannot capture).
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            return compiled(*args)

    return run


def tp_qk_norm_all_gather():
    """The all-gather baseline of tp_qk_norm: gather the shards, normalize, keep this rank's columns."""
    from cookbook.ops.tp_qk_norm import all_gather_norm

    return all_gather_norm
