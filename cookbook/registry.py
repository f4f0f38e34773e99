"""The only list of implementations: op -> reference, Numba versions, CUDA C rungs, tuned, peers.

Tests, the benchmark and the notebooks iterate this module; an implementation that is not here
does not exist, and one that is here is tested and benchmarked automatically. Targets are
`module:attribute` strings resolved on first use, so importing the registry imports neither
Numba nor the CUDA extensions.

Every implementation has the same calling convention: ``fn(*checked_args)``, in place, on the
tensors that the op's ``check_inputs`` returned (for the per-head ops, ``[T, H, D]`` views).

Levels: ``reference`` (PyTorch), ``numba``, ``cuda`` (the CUDA C ladder: rungs v1..vN, each a
standalone kernel that fixes one named bottleneck), ``tuned`` (the production CUDA C kernel,
what ``backend="cuda"`` and ``"auto"`` run on a GPU) and ``peer`` (what a user would run instead).

A lead is one line: what this implementation changes and which bottleneck it removes. A CUDA C
kernel file opens with its lead (``// v3: <lead>``, ``// tuned: <lead>``); a test keeps the two
identical. Measurements live in docs/results/, never in leads.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

LEVELS = ("reference", "numba", "cuda", "tuned", "peer")
COMPILED_LEVELS = ("cuda", "tuned")  # CUDA C, built with nvcc


@dataclass(frozen=True)
class Impl:
    op: str
    name: str
    level: str  # one of LEVELS
    version: int  # the rung's number; 0 for the reference, tuned and peers
    target: str  # "module:attribute"
    lead: str  # what changed, and which bottleneck it removes
    kernel: str | None = None  # ladder layout: its CUDA C file under kernels_cuda/, its own extension
    package: str | None = None  # peers from another package: its distribution (an optional install)

    @property
    def extension(self):
        """The `kernels_cuda.Extension` this implementation builds (ladder layout), else None."""
        if self.kernel is None:
            return None
        from kernels_cuda import Extension

        return Extension(self.op, self.kernel)

    def build(self):
        """A fresh callable (peers return a new compiled object each time: one per shape)."""
        module, attr = self.target.split(":")
        obj = getattr(importlib.import_module(module), attr)
        if self.kernel is not None:
            return functools.partial(obj, extension=self.extension)
        if self.level == "cuda":
            return functools.partial(obj, version=self.version)
        if self.level == "peer":
            return obj()  # peers are factories
        return obj

    @functools.cached_property
    def fn(self):
        return self.build()

    def unavailable(self, device) -> str | None:
        """None when this implementation can run on tensors of `device`, else the reason."""
        device = torch.device(device)
        if self.level == "reference":
            return None
        if self.level == "numba":
            from kernels_numba import simulator  # does not import numba

            if device.type == "cuda":
                return "the Numba CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1)" if simulator() else None
            if device.type != "cpu":
                return f"Numba kernels read CUDA tensors, or CPU tensors under the simulator; not {device.type} tensors"
            return None if simulator() else "Numba kernels need a CUDA GPU or NUMBA_ENABLE_CUDASIM=1"
        if self.level == "peer" and self.op in DISTRIBUTED_OPS:
            return None  # the collective baselines are plain torch.distributed: NCCL or gloo
        if device.type != "cuda":
            return f"{self.level} implementations run on CUDA tensors only"
        if self.level in COMPILED_LEVELS:
            from cookbook import cuda

            return cuda.unavailable()
        if self.level == "peer" and self.name == "torch_compile":
            return None
        module, attr = self.target.split(":")
        factory = getattr(importlib.import_module(module), attr)
        if hasattr(factory, "unavailable"):  # the peer's import guard (cookbook.peers.adapter.peer)
            return factory.unavailable()
        return "unknown"


def _ref(op, target):
    return Impl(op, "reference", "reference", 0, target,
                "the math in readable PyTorch: several kernels, float32 intermediates through memory")


def _cuda(op, version, lead):
    """A version of an op in the older layout: all versions in kernels_cuda/<op>.cuh, one extension."""
    return Impl(op, f"cuda_v{version}", "cuda", version, f"cookbook.cuda:{op}", lead)


def _rung(op, version, kernel, lead):
    """A rung of an op's ladder: kernels_cuda/<op>/<kernel>, built as its own extension."""
    return Impl(op, f"cuda_v{version}", "cuda", version, f"cookbook.cuda:{op}", lead, kernel=f"{op}/{kernel}")


def _peer(op, name, package, target, lead):
    """A kernel of another package, behind an import guard: the factory at cookbook.peers.`target`."""
    return Impl(op, name, "peer", 0, f"cookbook.peers.{target}", lead, package=package)


def _tuned(op, lead):
    """The production kernel of an op: kernels_cuda/<op>/tuned.cuh, its own extension."""
    return Impl(op, "cuda_tuned", "tuned", 0, f"cookbook.cuda:{op}", lead, kernel=f"{op}/tuned.cuh")


IMPLEMENTATIONS: dict[str, list[Impl]] = {
    "qk_norm": [
        _ref("qk_norm", "cookbook.ops.qk_norm:reference"),
        Impl("qk_norm", "numba_v1", "numba", 1, "kernels_numba.qk_norm:qk_norm",
             "one warp per (token, head): lanes read neighbouring elements, a warp-shuffle sum of squares, a second pass writes"),
        Impl("qk_norm", "numba_v2", "numba", 2, "kernels_numba.qk_norm:qk_norm_v2",
             "head_dim fixed at build time: the row stays in registers, its unrolled loads in flight together - removes v1's second read and serial loads"),
        Impl("qk_norm", "numba_v3", "numba", 3, "kernels_numba.qk_norm:qk_norm_v3",
             "bf16 rows as 32-bit words by lanes sized to the head, unsigned indices - removes v2's warp per row and its one 2-byte load per element"),
        _rung("qk_norm", 1, "v1_thread_per_row.cuh",
              "one thread per (token, head) row, the naive port: a warp's loads are head_dim elements apart (uncoalesced)"),
        _rung("qk_norm", 2, "v2_warp_per_row.cuh",
              "one warp per (token, head) row with a shuffle reduction: lanes read neighbouring elements (coalesced) - removes v1's scattered loads"),
        _rung("qk_norm", 3, "v3_vectors_in_registers.cuh",
              "16-byte vectors held in registers by a lane group sized to the head, on a persistent grid - removes v2's second read and one-element loads"),
        _rung("qk_norm", 4, "v4_grid_of_all_rows.cuh",
              "a grid of all rows, one per lane group, handed to SMs as they free a slot - removes v3's fixed share of rows per SM"),
        _rung("qk_norm", 5, "v5_programmatic_warm.cuh",
              "a programmatic dependent launch whose first block warms the weights into L2 while waiting - removes the launch gap and the weights' DRAM round trip"),
        _rung("qk_norm", 6, "v6_two_vectors_per_lane.cuh",
              "two 16-byte vectors per lane, half as many lanes per row - removes half the per-row work each lane repeats (addresses, shuffles, rsqrt)"),
        _tuned("qk_norm",
               "v6's kernel with streaming accesses, a multiply-high row division and the next wave's rows warmed, its shape chosen per call by one named policy"),
        Impl("qk_norm", "torch_compile", "peer", 0, "cookbook.peers:qk_norm_compiled",
             "torch.compile(fullgraph=True) of the reference: what a user would pick instead"),
        _peer("qk_norm", "sglang_qknorm", "sglang", "sglang_jit:qknorm",
              "SGLang's JIT fused_inplace_qknorm: q and k heads in one launch, in place, a warp per head"),
        _peer("qk_norm", "flashinfer_rmsnorm", "flashinfer-python", "flashinfer_ops:rmsnorm_per_head",
              "FlashInfer's rmsnorm on [T, H, D] q, then k: two launches, in place through out="),
        _peer("qk_norm", "liger_rms_norm", "liger-kernel", "liger_triton:rms_norm_per_head",
              "Liger-Kernel's Triton rms_norm on rows of head_dim, q then k: two launches, new tensors"),
    ],
    "cross_head_norm": [
        _ref("cross_head_norm", "cookbook.ops.cross_head_norm:reference"),
        Impl("cross_head_norm", "numba_v1", "numba", 1, "kernels_numba.cross_head_norm:cross_head_norm",
             "one block per (token, tensor), q and k on blockIdx.y: threads stride over the row, a block-wide sum of squares, a second pass writes"),
        Impl("cross_head_norm", "numba_v2", "numba", 2, "kernels_numba.cross_head_norm:cross_head_norm_v2",
             "bf16 rows as 32-bit words, rounding and weight storage fixed at build time - removes half of v1's loads and stores and its per-element rounding branch"),
        _rung("cross_head_norm", 1, "v1_one_cta_per_token.cuh",
              "one CTA per token normalizes its q row and its k row together: two sums of squares, both weights live, a two-value block reduction"),
        _rung("cross_head_norm", 2, "v2_q_and_k_on_grid_y.cuh",
              "q and k split over grid.y: one row, one sum and one weight per CTA - removes v1's second sum, row and weight from each thread"),
        _rung("cross_head_norm", 3, "v3_vectors_in_registers.cuh",
              "16-byte vectors of the row held in registers, the block sized to the wider row - removes v2's second read and its one-element loads"),
        _rung("cross_head_norm", 4, "v4_streaming.cuh",
              "x loaded and stored with evict-first streaming accesses - removes the caching of bytes touched once, which crowd the weights out of L1 and L2"),
        _rung("cross_head_norm", 5, "v5_programmatic_launch.cuh",
              "a programmatic dependent launch: CTAs become resident while the previous kernel drains, then wait in hardware for its writes - removes the launch gap between kernels"),
        _rung("cross_head_norm", 6, "v6_weights_with_the_row.cuh",
              "each thread's weight vectors loaded with its row, before the block sum, held in registers - removes the weights' round trip after the reduction"),
        _rung("cross_head_norm", 7, "v7_warp_per_token.cuh",
              "narrow rows: a warp per token, q row then k row, no block barrier - removes two short CTAs per token whose launches set the time"),
        _tuned("cross_head_norm",
               "rung 6's CTA per row with streaming rows, its block, grid order, held weights and L2 warming chosen per call by one named policy"),
        Impl("cross_head_norm", "torch_compile", "peer", 0, "cookbook.peers:cross_head_norm_compiled",
             "torch.compile(fullgraph=True) of the reference: what a user would pick instead"),
        _peer("cross_head_norm", "sglang_qknorm_across_heads", "sglang", "sglang_jit:qknorm_across_heads",
              "SGLang's JIT fused_inplace_qknorm_across_heads: q and k rows in one launch, in place"),
        _peer("cross_head_norm", "flashinfer_rmsnorm", "flashinfer-python", "flashinfer_ops:rmsnorm_across_heads",
              "FlashInfer's rmsnorm on [T, hidden] q, then k: two launches, in place through out="),
        _peer("cross_head_norm", "liger_rms_norm", "liger-kernel", "liger_triton:rms_norm_across_heads",
              "Liger-Kernel's Triton rms_norm on [T, hidden] q, then k: two launches, new tensors"),
    ],
    "qk_norm_rope": [
        _ref("qk_norm_rope", "cookbook.ops.qk_norm_rope:reference"),
        Impl("qk_norm_rope", "numba_v1", "numba", 1, "kernels_numba.qk_norm_rope:qk_norm_rope",
             "one warp per (token, head): the row read once into registers, a shuffle sum of squares, the rope partner fetched from its lane by a shuffle"),
        Impl("qk_norm_rope", "numba_v2", "numba", 2, "kernels_numba.qk_norm_rope:qk_norm_rope_v2",
             "lanes own whole rotation pairs, slots sized at build time so the row stays in registers - removes v1's shuffles, local-memory row and per-member cos/sin reads"),
        Impl("qk_norm_rope", "numba_v3", "numba", 3, "kernels_numba.qk_norm_rope:qk_norm_rope_v3",
             "bf16 pairs as 32-bit words, lanes sized to the head, layout and rounding fixed at build time - removes v2's per-element index and rounding work"),
        _rung("qk_norm_rope", 1, "v1_split_norm_then_rope.cuh",
              "the split path: a norm kernel writes float32 scratch, a rope kernel reads it back and rotates: two launches, two passes over q and k"),
        _rung("qk_norm_rope", 2, "v2_one_pass_warp_per_row.cuh",
              "one kernel, a warp per row, each lane owning whole (a, b) pairs - removes v1's second launch and its float32 round trip through memory"),
        _rung("qk_norm_rope", 3, "v3_vectors_lane_exchange.cuh",
              "the row in registers as 16-byte vectors, a lane per vector; a NeoX partner fetched by a shuffle - removes v2's second read and 2-byte loads"),
        _rung("qk_norm_rope", 4, "v4_pair_in_one_lane.cuh",
              "a lane holds both vectors of its pairs (NeoX: one per half) and reads their cos/sin once - removes v3's partner shuffles and duplicate cos/sin loads"),
        _rung("qk_norm_rope", 5, "v5_layout_at_compile_time.cuh",
              "the rope layout and the tables' storage types as template arguments - removes v4's per-element layout selects and the loads it issues for both storage types"),
        _rung("qk_norm_rope", 6, "v6_programmatic_warm_tables.cuh",
              "a programmatic launch, the tables warmed into L2 during its wait and read with the row - removes the launch gap and decode's table round trips"),
        _rung("qk_norm_rope", 7, "v7_walk_whole_tokens.cuh",
              "a persistent grid of whole tokens, each lane group walking one head with its weight read once - removes per-row block starts, divisions and weight loads"),
        _tuned("qk_norm_rope",
               "v6's kernel at decode, v7's walk at prefill (else a walk by the launcher's steps), streaming accesses, chosen per call by one named policy"),
        Impl("qk_norm_rope", "torch_compile", "peer", 0, "cookbook.peers:qk_norm_rope_compiled",
             "torch.compile(fullgraph=True) of the reference: what a user would pick instead"),
        _peer("qk_norm_rope", "sglang_qknorm_rope", "sglang", "sglang_jit:qknorm_rope",
              "SGLang's JIT diffusion fused_inplace_qknorm_rope: norm and rope from a cos/sin cache, one launch, in place"),
        _peer("qk_norm_rope", "sglang_trtllm_qknorm_rope", "sglang", "sglang_jit:trtllm_qknorm_rope",
              "SGLang's JIT fused_qk_norm_rope from TensorRT-LLM: one launch on packed qkv, cos/sin computed from the base"),
        _peer("qk_norm_rope", "flashinfer_rmsnorm_rope", "flashinfer-python", "flashinfer_ops:rmsnorm_then_rope",
              "FlashInfer's split path: rmsnorm on q and k, then apply_rope_with_cos_sin_cache_inplace: three launches"),
        _peer("qk_norm_rope", "liger_rms_norm_rope", "liger-kernel", "liger_triton:rms_norm_then_rope",
              "Liger-Kernel's Triton rms_norm on q and k, then rope on the new tensors: three launches"),
    ],
    "qk_norm_rope_cache": [
        _ref("qk_norm_rope_cache", "cookbook.ops.qk_norm_rope_cache:reference"),
        Impl("qk_norm_rope_cache", "numba_v1", "numba", 1, "kernels_numba.qk_norm_rope_cache:qk_norm_rope_cache",
             "qk_norm_rope's last Numba kernel in place, then a copy kernel: a warp per (token, kv head) stores k and v at the slot"),
        _rung("qk_norm_rope_cache", 1, "v1_rope_then_cache_copy.cuh",
              "the split path: qk_norm_rope's tuned kernel writes q and k, a copy kernel reads k and v back into the cache slots: two launches"),
        _rung("qk_norm_rope_cache", 2, "v2_one_pass.cuh",
              "one kernel, a lane group per q, k or v row, k stored twice from registers - removes v1's second launch and re-read"),
        _rung("qk_norm_rope_cache", 3, "v3_programmatic_warm_tables.cuh",
              "a programmatic launch, tables and slots warmed into L2 during its wait, read with the row - removes the launch gap and decode's table round trips"),
        _tuned("qk_norm_rope_cache",
               "v3's kernel, weights packed, no division: four blocks per SM; neighbours stored whole; bf16-cache calls walked by resident blocks; off the vector path the split"),
        Impl("qk_norm_rope_cache", "torch_compile", "peer", 0, "cookbook.peers:qk_norm_rope_cache_compiled",
             "torch.compile(fullgraph=True) of the reference: what a user would pick instead"),
        Impl("qk_norm_rope_cache", "ours_then_index_copy", "peer", 0, "cookbook.peers.cache_write:ours_then_index_copy",
             "the split path: our qk_norm_rope tuned kernel, then torch index_copy_ of k and v into the caches"),
        _peer("qk_norm_rope_cache", "ours_then_flashinfer_append", "flashinfer-python",
              "cache_write:ours_then_flashinfer_append",
              "the split path: our qk_norm_rope tuned kernel, then FlashInfer's append_paged_kv_cache"),
        _peer("qk_norm_rope_cache", "sglang_qknorm_rope_then_store", "sglang", "cache_write:sglang_qknorm_rope_then_store",
              "the split path: SGLang's JIT fused_inplace_qknorm_rope, then its JIT store_cache"),
    ],
    # A collective: every implementation also takes the process group (its last argument).
    "tp_qk_norm": [
        Impl("tp_qk_norm", "reference", "reference", 0, "cookbook.ops.tp_qk_norm:reference",
             "the math in readable PyTorch: local [T, 2] sums of squares, torch.distributed.all_reduce, apply"),
        Impl("tp_qk_norm", "numba_v1", "numba", 1, "kernels_numba.tp_qk_norm:tp_qk_norm",
             "the three-step pipeline: a sum-of-squares kernel (block per (token, tensor)), the all-reduce of the [T, 2] sums, an apply kernel"),
        Impl("tp_qk_norm", "numba_v2", "numba", 2, "kernels_numba.tp_qk_norm:tp_qk_norm_v2",
             "v1's pipeline on bf16 shards as 32-bit words, rounding and weight storage fixed at build time - removes half of v1's loads, stores and rounding branches"),
        _rung("tp_qk_norm", 1, "v1_three_launches.cuh",
              "three launches: a sum-of-squares kernel writes [T, 2] floats, NCCL all-reduces them, an apply kernel re-reads the shard and writes it"),
        _rung("tp_qk_norm", 2, "v2_fused_tiles.cuh",
              "one fused kernel: a CTA stages its tokens in shared memory, pushes their sums into every peer's buffer, waits - removes v1's NCCL launch and re-read"),
        _rung("tp_qk_norm", 3, "v3_decode_latency.cuh",
              "at decode sizes warps share each row, header check and epoch advance ride beside the wait, the launch is programmatic - removes v2's latency chain"),
        _rung("tp_qk_norm", 4, "v4_batched_loads.cuh",
              "each lane's loads of a row issued as one batch before any is used - removes v3's one memory latency per pack behind its tile stores"),
        _rung("tp_qk_norm", 5, "v5_lagged_walk.cuh",
              "at prefill a persistent walk: sums pushed, the token finished two steps later from L2, weights once in shared memory - removes v4's tile waits"),
        _rung("tp_qk_norm", 6, "v6_cta_per_token.cuh",
              "one CTA per token, its vectors held through the exchange, the next token's requested before the wait - removes v5's shared-memory tiles at mid sizes"),
        _rung("tp_qk_norm", 7, "v7_thread_per_vector.cuh",
              "one thread per 16-byte vector, the call's counters read beside the first loads - removes v6's serial counter reads before its first barrier"),
        _rung("tp_qk_norm", 8, "v8_two_tokens_per_exchange.cuh",
              "addresses computed before the wait, counters read by one thread, two tokens per exchange - removes v7's parameter round trip and second exchange"),
        _tuned("tp_qk_norm",
               "v7's kernel at decode, v8's at mid sizes, v5's walk at prefill, v4's tiles elsewhere, chosen per chunk by one policy; v1's kernels without peer memory"),
        Impl("tp_qk_norm", "all_gather", "peer", 0, "cookbook.peers:tp_qk_norm_all_gather",
             "the naive baseline: all-gather the shards, normalize the gathered rows, keep this rank's columns"),
    ],
}

# The op name -> its contract module.
CONTRACTS = {"qk_norm_rope": "cookbook.ops.qk_norm_rope", "qk_norm_rope_cache": "cookbook.ops.qk_norm_rope_cache", "qk_norm": "cookbook.ops.qk_norm",
             "cross_head_norm": "cookbook.ops.cross_head_norm", "tp_qk_norm": "cookbook.ops.tp_qk_norm"}

# Ops whose every call is a collective over a process group: the single-process benchmark and
# tour leave them to `cookbook.bench.tp` (which runs one process per GPU under torchrun).
DISTRIBUTED_OPS = ("tp_qk_norm",)


def ops() -> list[str]:
    return list(IMPLEMENTATIONS)


def contract(op: str):
    return importlib.import_module(CONTRACTS[op])


def implementations(op: str, levels=LEVELS) -> list[Impl]:
    return [impl for impl in IMPLEMENTATIONS[op] if impl.level in levels]


def get(op: str, name: str) -> Impl:
    for impl in IMPLEMENTATIONS[op]:
        if impl.name == name:
            return impl
    raise KeyError(f"{op}: no implementation named {name!r}; have {[i.name for i in IMPLEMENTATIONS[op]]}")


def latest(op: str, level: str) -> Impl:
    """The last version of a level (the highest rung of the ladder, for "cuda")."""
    return max(implementations(op, (level,)), key=lambda impl: impl.version)


def fastest(op: str) -> Impl:
    """What `backend="cuda"` runs: the op's tuned kernel, or its last CUDA C version where the op
    has no tuned kernel yet (ops still in the older layout)."""
    tuned = implementations(op, ("tuned",))
    return tuned[0] if tuned else latest(op, "cuda")


@functools.cache
def _warn_fallback(op: str, reason: str) -> None:
    import warnings

    warnings.warn(f"{op}: backend='auto' falls back to the PyTorch reference ({reason})", RuntimeWarning, stacklevel=3)


def resolve(op: str, backend: str, device) -> Impl:
    """The implementation `backend` names, for tensors on `device`: "reference" and "numba" their
    level's last version, "cuda" the tuned kernel, "auto" the fastest that can run there."""
    device = torch.device(device)
    if backend == "auto":
        if device.type != "cuda":
            return latest(op, "reference")
        for candidate in (fastest(op), latest(op, "numba")):
            if candidate.unavailable(device) is None:
                return candidate
        _warn_fallback(op, fastest(op).unavailable(device))
        return latest(op, "reference")
    from cookbook._checks import require_backend_device

    require_backend_device(backend, device)
    impl = fastest(op) if backend == "cuda" else latest(op, backend)
    reason = impl.unavailable(device)
    if reason:
        raise RuntimeError(f"backend={backend!r} is unavailable for {op} on {device}: {reason}")
    return impl
