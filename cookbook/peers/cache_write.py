"""The split paths of `qk_norm_rope_cache`: a fused norm + RoPE kernel, then a separate kernel that
reads k and v again and writes them into the paged cache (what a serving engine runs today).

* `ours_then_index_copy`: our `qk_norm_rope` tuned kernel, then torch's ``index_copy_`` of k and
  v into the caches viewed as ``[num_blocks * block_size, num_kv_heads, head_dim]`` (an FP8 cache:
  ``(x.float() / scale).clamp(-448, 448).to(float8)`` first, then the copy of those bytes);
* `ours_then_flashinfer_append`: our `qk_norm_rope`, then FlashInfer's ``append_paged_kv_cache``
  (``flashinfer.page``), each token given as its own one-page request so that FlashInfer's page
  table says exactly what the slot mapping says (built once per argument set in `prepare`, as an
  engine builds its page table once per forward pass);
* `sglang_qknorm_rope_then_store`: SGLang's JIT ``fused_inplace_qknorm_rope``, then SGLang's
  JIT ``store_cache`` (``sglang.jit_kernel.kvcache``) into the caches viewed as token rows.

An FP8 cache is written by each split path as its package allows: FlashInfer's and SGLang's
cache writes copy elements of the cache's dtype, so k and v are quantized by torch first (two
more kernels, counted: that is the split path an engine would run). Each returns
``(q, k, k_cache, v_cache)``.
"""

from __future__ import annotations

import functools

import torch

from cookbook.peers import flashinfer_ops, guard, sglang_jit
from cookbook.peers.adapter import PeerKernel, peer

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)


def _quantized(x, cache, scale):
    """`x` as the cache stores it: itself, or its FP8 bytes (x / scale, saturated), by torch."""
    if cache.dtype != FP8:
        return x
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _token_rows(cache):
    """`[num_blocks, block_size, H, D]` as `[num_blocks * block_size, H, D]` (a view; None where the
    cache's blocks do not follow one another)."""
    try:
        return cache.view(-1, *cache.shape[2:])
    except RuntimeError:
        return None


def _our_qk_norm_rope():
    from cookbook import registry

    return registry.get("qk_norm_rope", "cuda_tuned").fn


def _rope(fn, q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox, rope_dim):
    fn(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox, rope_dim, 0)


class OursThenIndexCopy(PeerKernel):
    api = "cookbook.qk_norm_rope + torch.Tensor.index_copy_"

    def __init__(self):
        super().__init__(None)
        self._rope = _our_qk_norm_rope()

    def label(self, device) -> str:
        return f"this cookbook + torch {torch.__version__}"

    def not_applicable(self, q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping,
                       *rest):
        if _token_rows(k_cache) is None or _token_rows(v_cache) is None:
            return "caches whose blocks are not contiguous: index_copy_ takes the cache as one tensor of token rows"
        if bool((slot_mapping < 0).any()):
            return "slots of -1: index_copy_ writes every token"
        return None

    def __call__(self, q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, k_scale,
                 v_scale, eps, weight_offset, rounding, is_neox, rope_dim):
        _rope(self._rope, q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox,
              rope_dim)
        index = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
        for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            rows, values = _token_rows(cache), _quantized(x, cache, scale)
            if cache.dtype == FP8:  # index_copy_ has no float8 kernel: the same bytes as uint8
                rows, values = rows.view(torch.uint8), values.view(torch.uint8)
            rows.index_copy_(0, index, values)
        return q, k, k_cache, v_cache


def _our_cuda():
    from cookbook import cuda

    reason = cuda.unavailable()
    if reason:
        raise guard.PeerUnavailable(reason)


@peer(_our_cuda)
def ours_then_index_copy():
    return OursThenIndexCopy()


@functools.cache
def _flashinfer_page():
    """("flashinfer-python <version>", flashinfer.page) through the shim of flashinfer_ops."""
    package, _, _ = flashinfer_ops.load()
    return package, guard.first_module(("flashinfer.page",))


class OursThenFlashInferAppend(PeerKernel):
    api = "cookbook.qk_norm_rope + flashinfer.page.append_paged_kv_cache"

    def __init__(self):
        package, self._page = _flashinfer_page()
        super().__init__(package)
        self._rope = _our_qk_norm_rope()
        self._tables = {}  # slot_mapping.data_ptr() -> FlashInfer's page table of one call

    def not_applicable(self, q, k, *rest):
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"{q.dtype} activations: append_paged_kv_cache is built for float16 and bfloat16"
        return None

    def prepare(self, q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, *rest):
        """Token t as request t of one page, page slot // block_size, at row slot % block_size."""
        block_size = k_cache.shape[1]
        slots = slot_mapping.long()
        tokens = torch.arange(slots.numel(), dtype=torch.int32, device=slots.device)
        self._tables[slot_mapping.data_ptr()] = dict(
            batch_indices=tokens, positions=(slots % block_size).to(torch.int32),
            kv_indices=(slots // block_size).to(torch.int32),
            kv_indptr=torch.arange(slots.numel() + 1, dtype=torch.int32, device=slots.device),
            kv_last_page_len=(slots % block_size + 1).to(torch.int32))

    def __call__(self, q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, k_scale,
                 v_scale, eps, weight_offset, rounding, is_neox, rope_dim):
        _rope(self._rope, q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox,
              rope_dim)
        if slot_mapping.data_ptr() not in self._tables:
            self.prepare(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping)
        t = self._tables[slot_mapping.data_ptr()]
        self._page.append_paged_kv_cache(_quantized(k, k_cache, k_scale), _quantized(v, v_cache, v_scale),
                                         t["batch_indices"], t["positions"], (k_cache, v_cache), t["kv_indices"],
                                         t["kv_indptr"], t["kv_last_page_len"], kv_layout="NHD")
        return q, k, k_cache, v_cache


@peer(_flashinfer_page)
def ours_then_flashinfer_append():
    return OursThenFlashInferAppend()


@functools.cache
def _sglang_store():
    package, modules = sglang_jit.load()
    return package, modules["rope"], guard.first_module(("sglang.jit_kernel.kvcache",))


def _sglang_check():
    package, rope, store = _sglang_store()
    for module, name in ((rope, "fused_inplace_qknorm_rope"), (store, "store_cache")):
        if not hasattr(module, name):
            raise guard.PeerUnavailable(f"{package} has no {name} in {module.__name__}")


class SGLangQKNormRopeThenStore(PeerKernel):
    api = "sglang.jit_kernel.diffusion.qknorm_rope.fused_inplace_qknorm_rope + sglang.jit_kernel.kvcache.store_cache"

    def __init__(self):
        package, rope, store = _sglang_store()
        super().__init__(package)
        self._qknorm_rope = sglang_jit.QKNormRope()
        self._store = store.store_cache

    def not_applicable(self, q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping,
                       k_scale, v_scale, eps, weight_offset, rounding, is_neox, rope_dim):
        if _token_rows(k_cache) is None or _token_rows(v_cache) is None:
            return "caches whose blocks are not contiguous: store_cache takes the cache as token rows"
        if bool((slot_mapping < 0).any()):
            return "slots of -1: store_cache writes every token"
        return self._qknorm_rope.not_applicable(q, k, q_weight, k_weight, cos_sin_cache, positions, eps,
                                                weight_offset, rounding, is_neox, rope_dim, 0)

    def __call__(self, q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, k_scale,
                 v_scale, eps, weight_offset, rounding, is_neox, rope_dim):
        self._qknorm_rope(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox,
                          rope_dim, 0)
        rows = [_token_rows(c) for c in (k_cache, v_cache)]
        self._store(_quantized(k, k_cache, k_scale).flatten(1), _quantized(v, v_cache, v_scale).flatten(1),
                    rows[0].flatten(1), rows[1].flatten(1), slot_mapping)
        return q, k, k_cache, v_cache


@peer(_sglang_check)
def sglang_qknorm_rope_then_store():
    return SGLangQKNormRopeThenStore()
